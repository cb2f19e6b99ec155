"""Source-sharded training (modeling_brillm/sharding/): same losses and parameters as one process with
SparseAdamW and gradient clipping on the same global batch (learned start signals too; the whole recipe:
non_edge_bias, node readout, edge back-off, node vectors, the count prior, node and shared-edge learning-rate
scales, lazy weight decay), checkpoints that resume on another process count, clear errors.

Processes are spawned with torch.multiprocessing over gloo (file:// rendezvous in tmp_path); one tiny sparse
model (V = 300, d = 8) and one fixed sequence of global batches serve every test.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from modeling_brillm import BigramGraph, BriLLMConfig, BriLLMForCausalLM
from modeling_brillm.optimization import SparseAdamW
from modeling_brillm.sharding import ShardedBriLLM, balance_sources, check_assignment, sharded_memory, source_costs
from modeling_brillm.training.loop import clip_grad_norm_
from modeling_brillm.training.optimizers import parameter_groups

V, D, GLOBAL_BATCH, LENGTH, STEPS = 300, 8, 12, 16, 20
LR, WD = 1e-2, 0.01
MAX_NORM = 0.3  # the global gradient norm is 0.21-0.36 here: about half the steps clip
LEARNED = {"start_signal": "learned", "num_start_signals": 2}
# every model extension of the default recipe, plus lazy weight decay strong enough that rows untouched for a few
# steps visibly decay
RECIPE = {"non_edge_bias": True, "node_readout": True, "edge_backoff": True, "node_embedding": True,
          "count_prior": True}
RECIPE_GROUPS = {"node_lr_scale": 2.0, "shared_edge_lr_scale": 0.5, "lazy_weight_decay": True}
RECIPE_WD = 0.5


def _sequences(n: int, seed: int) -> torch.Tensor:
    """Zipf-like token paths with some padding (0 = pad) so the graph is sparse and skewed."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, V) ** 1.1
    ids = torch.multinomial(weights.expand(n, -1), LENGTH, replacement=True, generator=g) + 1
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths.unsqueeze(1)).long()
    return ids * mask, mask


def _model(loss_type: str = "exact", **config) -> BriLLMForCausalLM:
    ids, mask = _sequences(400, seed=1)
    seqs = [row[m.bool()] for row, m in zip(ids, mask)]
    torch.manual_seed(0)
    return BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=V, node_size=D, max_position_embeddings=LENGTH,
                                                  loss_type=loss_type, num_negatives=8, negative_sampling="frequency",
                                                  **config)


def _batch(step: int):
    ids, mask = _sequences(GLOBAL_BATCH, seed=100 + step)
    return ids, mask


def _signal_ids(model, step: int):
    """Which learned start signal each row of the global batch starts from ({} for the uniform start)."""
    if model.config.start_signal != "learned":
        return {}
    g = torch.Generator().manual_seed(500 + step)
    return {"signal_ids": torch.randint(0, model.config.num_start_signals, (GLOBAL_BATCH,), generator=g)}


def _reference(loss_type: str, steps: int = STEPS, groups=None, wd=WD, **config):
    """One process, SparseAdamW with pretrain.py's groups (`groups`: their recipe options), clipped to MAX_NORM as
    loop.TrainStep clips: (losses, norms, final state, lazy decay brought up to date)."""
    model = _model(loss_type, **config)
    model.sparse_gradients = True
    opt = SparseAdamW(parameter_groups(model, wd, LR, **(groups or {})), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        ids, mask = _batch(step)
        loss = model(ids, attention_mask=mask, labels=ids, return_logits=False, dropout_seed=step,
                     **_signal_ids(model, step)).loss
        loss.backward()
        norms.append(clip_grad_norm_(list(model.parameters()), MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    opt.apply_pending_weight_decay()
    return losses, norms, {k: v.detach().clone() for k, v in model.base_model.state_dict().items()}


def _train(sharded, opt, first: int, last: int, rank: int, world: int, save_at=None, save_dir=None):
    losses, norms = [], []
    for step in range(first, last):
        ids, mask = _batch(step)
        part = torch.arange(GLOBAL_BATCH).tensor_split(world)[rank]  # uneven with 3 processes
        extra = {k: v[part] for k, v in _signal_ids(sharded.model, step).items()}
        # the dropout masks (config.signal_dropout) keyed by the rows' global indices and the step
        out = sharded(ids[part], mask[part], labels=ids[part], dropout_rows=part, dropout_seed=step, **extra)
        out.loss.backward()
        sharded.reduce_gradients()
        norms.append(sharded.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        if save_at is not None and step + 1 == save_at:
            sharded.save_shard(save_dir, opt)
    return losses, norms


def _worker(rank, world, init_file, job, out_file):
    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sharded = ShardedBriLLM(_model(job.get("loss_type", "exact"), **job.get("config", {})))
        opt = SparseAdamW(sharded.parameter_groups(job.get("wd", WD), LR, **job.get("groups", {})), lr=LR)
        if job.get("resume"):
            sharded.load_shard(job["resume"], opt)
        losses, norms = _train(sharded, opt, job["first"], job["last"], rank, world, job.get("save_at"),
                               job.get("save_dir"))
        opt.apply_pending_weight_decay()  # each owner's lazily decayed rows (a no-op without lazy_weight_decay)
        state = sharded.full_state_dict()
        if job.get("reload"):  # the whole model's file read back by owner (how a sharded run's best model returns)
            from safetensors.torch import save_file

            if rank == 0:
                save_file({f"brillm.{k}": v.contiguous() for k, v in state.items()}, job["reload"])
            if world > 1:
                torch.distributed.barrier()
            fresh = ShardedBriLLM(_model(job.get("loss_type", "exact"), **job.get("config", {})),
                                  owners=sharded.owners.cpu())
            fresh.load_full_state_dict(job["reload"])
            reloaded = fresh.full_state_dict()
        result = {"losses": losses, "norms": norms, "state": state, "bytes": sharded.bytes_sent,
                  "rows": sharded.model.base_model.weights.shape[0]}
        all_norms = [None] * world
        if world > 1:  # the clip coefficient must be the same everywhere: every process saw the same norms
            torch.distributed.all_gather_object(all_norms, norms)
            result["norms_agree"] = all(n == norms for n in all_norms)
        if job.get("sampled_steps"):  # a second model in the same process group: the sampled (frequency) loss
            sharded = ShardedBriLLM(_model("sampled"))
            opt = SparseAdamW(sharded.parameter_groups(WD), lr=LR)
            result["sampled"] = {"losses": _train(sharded, opt, 0, job["sampled_steps"], rank, world)[0],
                                 "state": sharded.full_state_dict()}
        if job.get("reload"):
            result["reloaded"] = reloaded
        if rank == 0:
            torch.save(result, out_file)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def _run(tmp_path, world: int, job: dict, name: str):
    out_file = str(tmp_path / f"{name}.pt")
    init_file = str(tmp_path / f"{name}.init")
    if world == 1:
        _worker(0, 1, init_file, job, out_file)
    else:
        mp.start_processes(_worker, args=(world, init_file, job, out_file), nprocs=world, join=True,
                           start_method="spawn")
    return torch.load(out_file)


def _assert_close(state, ref, atol=1e-6):
    for key, value in ref.items():
        diff = float((state[key].double() - value.double()).abs().max()) if value.numel() else 0.0
        assert torch.allclose(state[key], value, rtol=1e-5, atol=atol), (key, diff)


@pytest.fixture(scope="module")
def reference():
    return _reference("exact")


def test_assignment_balances_work_and_rejects_empty_processes():
    model = _model()
    costs = source_costs(model)
    owners = balance_sources(costs, 3, model.base_model.graph_indptr.diff())
    loads = torch.zeros(3, dtype=torch.float64).index_add_(0, owners, costs)
    # LPT: the busiest process carries the hottest source alone, or the mean load within a few percent
    assert float(loads.max()) <= 1.05 * max(float(costs.max()), float(loads.mean()))
    assert owners.shape == (V,) and set(owners.tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="would own no edge rows"):
        check_assignment(torch.zeros(V, dtype=torch.long), model.base_model.graph_indptr.diff(), 2)


@pytest.mark.slow
def test_three_then_two_then_one_processes_match_one_process(tmp_path, reference):
    ref_losses, ref_norms, ref_state = reference
    clipped = sum(n > MAX_NORM for n in ref_norms)
    assert 0 < clipped < STEPS, ref_norms  # both branches of the clipping are exercised
    ckpt3, ckpt2 = str(tmp_path / "ckpt3"), str(tmp_path / "ckpt2")
    # 3 processes (uneven split of the 12 rows and of the sources), 20 steps, checkpoint at step 10
    three = _run(tmp_path, 3, {"first": 0, "last": STEPS, "save_at": 10, "save_dir": ckpt3}, "three")
    assert torch.allclose(torch.tensor(three["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # the global norm: every owner's rows plus the replicated parameters once, the same on every process
    assert torch.allclose(torch.tensor(three["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert three["norms_agree"]
    _assert_close(three["state"], ref_state)
    assert three["rows"] < ref_state["weights"].shape[0] // 2  # this process holds about a third of the table
    # resume 3 -> 2 at step 10, checkpoint again at step 15
    two = _run(tmp_path, 2, {"first": 10, "last": STEPS, "resume": ckpt3, "save_at": 15, "save_dir": ckpt2,
                             "sampled_steps": 5}, "two")
    assert torch.allclose(torch.tensor(two["losses"]), torch.tensor(ref_losses[10:]), rtol=1e-5, atol=0)
    _assert_close(two["state"], ref_state)
    # resume 2 -> 1 at step 15 (one process, no process group)
    one = _run(tmp_path, 1, {"first": 15, "last": STEPS, "resume": ckpt2}, "one")
    assert torch.allclose(torch.tensor(one["losses"]), torch.tensor(ref_losses[15:]), rtol=1e-5, atol=0)
    _assert_close(one["state"], ref_state)
    # the sampled loss (frequency negatives), 2 processes
    ref_losses, _, ref_state = _reference("sampled", steps=5)
    assert torch.allclose(torch.tensor(two["sampled"]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # Adam's normalised step turns summation-order rounding in rows whose gradient is ~0 into up to ~1e-3 of one
    # lr=1e-2 step (seen: 1.8e-6 after 5 steps); the losses above agree to 1e-5 relative
    _assert_close(two["sampled"]["state"], ref_state, atol=1e-5)




@pytest.mark.slow
def test_signal_dropout_trains_sharded_like_one_process_and_resumes(tmp_path):
    """With signal dropout two processes drop, row for row, what one process drops on the whole batch: the same
    losses and weights; their checkpoint resumes in one process on the same masks."""
    dropout = {"signal_dropout": 0.3}
    ref_losses, _, ref_state = _reference("exact", steps=10, **dropout)
    plain_losses = _reference("exact", steps=10)[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, plain_losses)) > 1e-2  # the dropout is on
    ckpt = str(tmp_path / "ckpt")
    two = _run(tmp_path, 2, {"first": 0, "last": 10, "save_at": 5, "save_dir": ckpt, "config": dropout}, "dropout")
    assert torch.allclose(torch.tensor(two["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _assert_close(two["state"], ref_state)
    sharded = ShardedBriLLM(_model(**dropout))
    opt = SparseAdamW(sharded.parameter_groups(WD), lr=LR)
    sharded.load_shard(ckpt, opt)
    losses, _ = _train(sharded, opt, 5, 10, 0, 1)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses[5:]), rtol=1e-5, atol=0)


def test_export_loads_as_a_plain_model(tmp_path):
    sharded = ShardedBriLLM(_model())
    model = sharded.export_model()
    model.save_pretrained(tmp_path / "out")
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path / "out")
    ids, mask = _batch(0)
    ref = _model()
    with torch.no_grad():
        got, want = loaded(ids, attention_mask=mask, labels=ids).loss, ref(ids, attention_mask=mask, labels=ids).loss
        assert torch.allclose(got, want)


def test_from_config_never_builds_the_full_table():
    config = BriLLMConfig(vocab_size=40, node_size=D, graph="dense", max_position_embeddings=LENGTH)
    sharded = ShardedBriLLM.from_config(config, seed=3)
    assert (sharded.model.base_model.weights.shape == (1 + 40 * 40, D, D)
            and sharded.model.base_model.weights.device.type == "cpu")
    again = ShardedBriLLM.from_config(config, seed=3)  # the same initialisation (per-source generators)
    assert torch.equal(sharded.model.base_model.weights, again.model.base_model.weights)
    assert float(sharded.model.base_model.weights.detach().abs().max()) > 0
    ids = torch.randint(0, 40, (3, 8))
    out = sharded(ids, labels=ids)
    out.loss.backward()
    sharded.reduce_gradients()
    assert out.num_targets == 3 * 7 and sharded.model.base_model.weights.grad.is_sparse
    plain = sharded.export_model()(ids, labels=ids).loss.detach()
    assert float(out.loss.detach()) == pytest.approx(float(plain), rel=1e-6)
    learned = ShardedBriLLM.from_config(BriLLMConfig(vocab_size=40, node_size=D, graph="dense",
                                                     max_position_embeddings=LENGTH, **LEARNED), seed=3)
    # the release's uniform start
    assert torch.equal(learned.model.base_model.start_signals, torch.full((2, D), 1.0 / D))
    # position weights start where BriLLMForCausalLM starts them
    recent = BriLLMConfig(vocab_size=40, node_size=D, graph="dense", max_position_embeddings=LENGTH,
                          position_recency=0.3)
    assert torch.equal(ShardedBriLLM.from_config(recent, seed=3).model.base_model.positions,
                       BriLLMForCausalLM(recent).base_model.positions)
    # the extensions start at zero as in BriLLMForCausalLM, and score as the exported model does
    extended = ShardedBriLLM.from_config(BriLLMConfig(vocab_size=40, node_size=D, graph="dense",
                                                      max_position_embeddings=LENGTH, node_readout=True,
                                                      edge_backoff=True, node_embedding=True), seed=3)
    for name in ("node_readout", "edge_base", "node_embedding"):
        assert not getattr(extended.model.base_model, name).any(), name
    with torch.no_grad():
        plain = extended.export_model()(ids, labels=ids).loss
        assert float(extended(ids, labels=ids).loss) == pytest.approx(float(plain), rel=1e-6)


def test_from_config_builds_a_sparse_graph_too():
    """The graph's buffers are filled, not left on the meta device: the shards score as the exported model."""
    model = _model()
    graph = BigramGraph(model.base_model.graph_indptr, model.base_model.graph_indices, model.base_model.graph_counts)
    sharded = ShardedBriLLM.from_config(model.config, graph, seed=3)
    assert torch.equal(sharded.model.base_model.graph_indices, graph.indices)
    ids, mask = _batch(0)
    with torch.no_grad():
        want = sharded.export_model()(ids, attention_mask=mask, labels=ids).loss
        assert float(sharded(ids, mask, labels=ids).loss) == pytest.approx(float(want), rel=1e-6)


def test_the_local_table_fetch_and_checkpoints_follow_the_row_indexed_parameters(tmp_path):
    """A model that lists another row-indexed parameter (as an edge variant would: any tensor whose first
    dimension is the edge row) gets it cut to the local rows, fetched with sparse row gradients, checkpointed and
    gathered, with no change to the sharding code."""
    def with_extra(seed):
        model = _model()
        torch.manual_seed(seed)
        model.base_model.edge_extra = torch.nn.Parameter(torch.randn(model.config.num_edge_rows, 3))
        model.base_model.edge_row_parameters = ("weights", "biases", "edge_extra")
        return model

    full = with_extra(0).base_model.edge_extra.detach().clone()
    sharded = ShardedBriLLM(with_extra(0))
    m = sharded.model.base_model
    assert m.edge_extra.shape == (m.weights.shape[0], 3)
    rows = torch.tensor([[0, 5, 7], [7, 2, 0]])
    anchors = []
    w, b, extra = sharded.table.fetch(m, sharded.transport, rows, None, anchors)
    assert w.shape == (2, 3, D, D) and b.shape == (2, 3, 1, D) and torch.equal(extra, full[rows])
    (extra.sum() + w.sum()).backward()
    assert m.edge_extra.grad.is_sparse and m.weights.grad.is_sparse
    assert torch.equal(m.edge_extra.grad.to_dense()[7], torch.full((3,), 2.0))  # row 7 fetched twice
    sharded.save_shard(tmp_path / "ckpt")
    again = ShardedBriLLM(with_extra(1))
    assert not torch.equal(again.model.base_model.edge_extra, m.edge_extra)
    again.load_shard(tmp_path / "ckpt")
    assert torch.equal(again.model.base_model.edge_extra, m.edge_extra)
    assert torch.equal(again.full_state_dict()["edge_extra"], full)


def test_mismatched_checkpoint_is_a_clear_error(tmp_path):
    sharded = ShardedBriLLM(_model())
    sharded.save_shard(tmp_path / "ck")
    torch.manual_seed(0)
    other = ShardedBriLLM(BriLLMForCausalLM.from_token_sequences([torch.arange(50)], vocab_size=V, node_size=D,
                                                                 max_position_embeddings=LENGTH))
    with pytest.raises(ValueError, match="saved for another model"):
        other.load_shard(tmp_path / "ck")
    with pytest.raises(ValueError, match="no source-sharded checkpoint"):
        other.load_shard(tmp_path)


@pytest.mark.slow
def test_learned_start_signals_train_sharded_resume_and_export(tmp_path):
    ref_losses, ref_norms, ref_state = _reference("exact", **LEARNED)
    assert 0 < sum(n > MAX_NORM for n in ref_norms) < STEPS, ref_norms
    ckpt = str(tmp_path / "ckpt")
    two = _run(tmp_path, 2, {"first": 0, "last": STEPS, "save_at": 10, "save_dir": ckpt, "config": LEARNED}, "learned")
    assert torch.allclose(torch.tensor(two["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert torch.allclose(torch.tensor(two["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    _assert_close(two["state"], ref_state)  # the start signals among them
    signals = two["state"]["start_signals"]
    assert float((signals - 1.0 / D).abs().min()) > 1e-3 and not torch.allclose(signals[0], signals[1])  # trained
    # the two-process checkpoint resumes in one process (the start signals and their moments come back)
    sharded = ShardedBriLLM(_model(**LEARNED))
    opt = SparseAdamW(sharded.parameter_groups(WD), lr=LR)
    sharded.load_shard(ckpt, opt)
    losses, _ = _train(sharded, opt, 10, STEPS, 0, 1)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses[10:]), rtol=1e-5, atol=0)
    # exported: a plain model with the trained start signals
    sharded.export_model().save_pretrained(tmp_path / "out")
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.allclose(loaded.base_model.start_signals.detach(), ref_state["start_signals"], rtol=1e-5, atol=1e-6)
    # a checkpoint of a uniform-start model is not silently loaded into a learned one
    ShardedBriLLM(_model()).save_shard(tmp_path / "uniform")
    with pytest.raises(ValueError, match="saved for another model"):
        ShardedBriLLM(_model(**LEARNED)).load_shard(tmp_path / "uniform")


@pytest.mark.slow
def test_recipe_trains_sharded_like_one_process_and_resumes_on_one(tmp_path):
    """Every model extension + node_lr_scale + shared_edge_lr_scale + lazy weight decay, clipping active: two
    processes give one process's losses, norms and parameters; their checkpoint (pending decay included) resumes
    in one."""
    steps, half = 10, 5
    ref_losses, ref_norms, ref_state = _reference("exact", steps, RECIPE_GROUPS, RECIPE_WD, **RECIPE)
    assert 0 < sum(n > MAX_NORM for n in ref_norms) < steps, ref_norms
    init = _model(**RECIPE).base_model.state_dict()
    for name in ("non_edge_bias", "node_readout", "edge_base", "node_embedding"):  # every extension trained
        assert float((ref_state[name] - init[name]).abs().max()) > 1e-3, name
    assert float(init["prior_values"].abs().max()) > 0  # the count prior is in the logits
    ckpt = str(tmp_path / "ckpt")
    job = {"first": 0, "last": steps, "save_at": half, "save_dir": ckpt, "config": RECIPE, "groups": RECIPE_GROUPS,
           "wd": RECIPE_WD, "reload": str(tmp_path / "whole.safetensors")}
    two = _run(tmp_path, 2, job, "recipe")
    _assert_close(two["reloaded"], two["state"], atol=0)  # each owner read back exactly its rows
    assert torch.allclose(torch.tensor(two["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert torch.allclose(torch.tensor(two["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    _assert_close(two["state"], ref_state)  # the extensions, row 0 at half the rate, every row decayed
    # without lazy decay the rows the batches did not touch would keep more of their weight: the test sees it
    plain = _reference("exact", steps, {**RECIPE_GROUPS, "lazy_weight_decay": False}, RECIPE_WD, **RECIPE)[2]
    assert float((plain["weights"] - ref_state["weights"]).abs().max()) > 1e-3
    # 2 -> 1: the rows, moments, step counts, pending decay and the replicated parameters come back
    sharded = ShardedBriLLM(_model(**RECIPE))
    opt = SparseAdamW(sharded.parameter_groups(RECIPE_WD, LR, **RECIPE_GROUPS), lr=LR)
    sharded.load_shard(ckpt, opt)
    losses, _ = _train(sharded, opt, half, steps, 0, 1)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses[half:]), rtol=1e-5, atol=0)
    opt.apply_pending_weight_decay()
    _assert_close(sharded.full_state_dict(), ref_state)


def test_bfloat16_moments_resume_sharded_bit_for_bit(tmp_path):
    """SparseAdamW(moment_dtype="bfloat16") on the shards: a checkpoint's moments come back in bfloat16 and training
    continues exactly as without the interruption (in one process: the file format is the same for any count)."""
    def fresh():
        sharded = ShardedBriLLM(_model(**RECIPE))
        opt = SparseAdamW(sharded.parameter_groups(RECIPE_WD, LR, **RECIPE_GROUPS), lr=LR, moment_dtype="bfloat16")
        return sharded, opt

    sharded, opt = fresh()
    ckpt = str(tmp_path / "ckpt")
    losses, _ = _train(sharded, opt, 0, 6, 0, 1, save_at=3, save_dir=ckpt)
    resumed, opt2 = fresh()
    resumed.load_shard(ckpt, opt2)
    again, _ = _train(resumed, opt2, 3, 6, 0, 1)
    assert again == losses[3:]
    for p, q in zip(sharded.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == torch.bfloat16 and torch.equal(opt.state[p][key], opt2.state[q][key])


def test_recipe_groups_and_errors(tmp_path):
    sharded = ShardedBriLLM(_model(**RECIPE))
    m = sharded.model
    groups = sharded.parameter_groups(WD, LR, **RECIPE_GROUPS)
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert (by_param[id(m.base_model.node_bias)]["lr"] == by_param[id(m.base_model.non_edge_bias)]["lr"]
            == pytest.approx(2 * LR))
    assert (by_param[id(m.base_model.weights)]["first_row_lr_scale"]
            == by_param[id(m.base_model.biases)]["first_row_lr_scale"] == 0.5)
    assert (by_param[id(m.base_model.weights)]["lazy_weight_decay"]
            and by_param[id(m.base_model.weights)]["weight_decay"] == WD)
    assert sum(len(g["params"]) for g in groups) == len(list(sharded.parameters()))
    with pytest.raises(ValueError, match="pass learning_rate"):
        sharded.parameter_groups(WD, node_lr_scale=2.0)
    # one process group-less: the sharded loss is the plain model's, with trained-looking offsets
    with torch.no_grad():
        m.base_model.non_edge_bias.copy_(torch.linspace(-1, 1, V))
    ids, mask = _batch(0)
    plain = _model(**RECIPE)
    with torch.no_grad():
        plain.base_model.non_edge_bias.copy_(torch.linspace(-1, 1, V))
        want = plain(ids, attention_mask=mask, labels=ids).loss
        assert float(sharded(ids, mask, labels=ids).loss) == pytest.approx(float(want), rel=1e-6)
    # the sampled loss cannot score the offsets: refused as BriLLMConfig refuses it
    with pytest.raises(ValueError, match="non_edge_bias needs loss_type='exact'"):
        sharded(ids, mask, labels=ids, loss_type="sampled")
    # a checkpoint without non_edge_bias is not silently loaded into a model with it
    ShardedBriLLM(_model()).save_shard(tmp_path / "plain")
    with pytest.raises(ValueError, match="saved for another model"):
        sharded.load_shard(tmp_path / "plain")


def test_clip_needs_reduced_gradients_and_scales_every_gradient():
    sharded = ShardedBriLLM(_model(**LEARNED))
    ids, mask = _batch(0)
    sharded(ids, mask, labels=ids, **_signal_ids(sharded.model, 0)).loss.backward()
    with pytest.raises(RuntimeError, match="call reduce_gradients"):
        sharded.clip_grad_norm_(MAX_NORM)
    sharded.reduce_gradients()
    w = sharded.model.base_model.weights
    g = w.grad  # split every row into two entries (as accumulated micro-batches may leave it): duplicate rows
    w.grad = torch.sparse_coo_tensor(torch.cat([g._indices(), g._indices().flip(1)], 1),
                                     torch.cat([0.25 * g._values(), 0.75 * g._values().flip(0)]), w.shape,
                                     check_invariants=True)
    grads = {n: p.grad.to_dense().clone() for n, p in sharded.named_parameters()}
    norm = sharded.clip_grad_norm_(1e-3)
    dense = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5  # duplicate rows summed by to_dense
    assert norm == pytest.approx(dense, rel=1e-6) and norm > 1e-3
    for n, p in sharded.named_parameters():
        assert torch.allclose(p.grad.to_dense(), grads[n] * (1e-3 / (norm + 1e-6)), rtol=1e-5, atol=1e-12), n


def test_dense_paper_graph_fits_40_gb_per_process_on_8():
    config = BriLLMConfig(vocab_size=4000, node_size=32, graph="dense")
    parts = sharded_memory(config, world_size=8, global_tokens=128 * 64)  # 16 x 64 tokens per GPU
    assert config.num_edge_rows == 1 + 4000 * 4000
    # the table's share: 16M rows x (32x32 + 32) x 4 B / 8 = 8.45 GB; + 2 moments + gradient = 33.9 GB,
    # + 3.3 GB candidate workspace (1,280 positions x 4,000 successors x 5 x 128 B)
    assert 8.4e9 < parts["edge rows (weights + biases)"] < 8.5e9
    assert parts["total"] <= 40e9, parts


# ------------------------------------------------------------------------------------ examples/pretrain.py
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tests._scripts import refused  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pretrain.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
CPU2 = ROOT / "configuration" / "accelerate" / "cpu_2.yaml"
# --max_grad_norm 0.6: the global gradient norm of these runs is 0.42-0.77, so 7 of the 10 steps clip
TINY = ["--vocab_size", "300", "--node_size", "8", "--block_size", "16", "--num_generations", "0",
        "--learning_rate", "0.05", "--num_warmup_steps", "2", "--eval_steps", "5", "--max_train_steps", "10",
        "--max_grad_norm", "0.6"]
GLOBAL = 24  # = 1 x 24 = 2 x 12 blocks


def _env():
    e = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                          "MASTER_PORT", "MASTER_ADDR", "ACCELERATE_USE_CPU",
                                                          "BRILLM_AVAILABLE_MEMORY_GB")}
    e.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1")  # one process on the CPU like cpu_2.yaml's, on any machine
    return e


def _pretrain(args, processes: int = 1, check=True):
    cmd = [sys.executable, str(SCRIPT)]
    if processes > 1:
        cmd = [str(ACCELERATE), "launch", "--config_file", str(CPU2), "--main_process_port",
               str(random.randint(20000, 40000)), str(SCRIPT)]
    batch = ["--per_device_train_batch_size", str(GLOBAL // processes)]
    result = subprocess.run(cmd + [str(a) for a in [*TINY, *batch, *args]], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=_env())
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _losses(out) -> dict[int, float]:
    with open(Path(out) / "train_log.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _final_params(out) -> dict:
    from safetensors.torch import load_file

    return {name.removeprefix("brillm."): t for name, t in load_file(str(Path(out) / "model.safetensors")).items()}


def _same_run(out, ref_out, steps):
    got, ref = _losses(out), _losses(ref_out)
    assert sorted(got) == sorted(ref)
    for step in steps:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0), step
    # lr 0.05: float rounding of the summed gradients moves AdamW's steps by a few 1e-6 over 10 steps
    _assert_close(_final_params(out), _final_params(ref_out), atol=2e-5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat dog bird sat on mat log tree saw a big small red blue ran over under and with house".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(400)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_pretrain_flag_matches_one_process_and_resumes_across_process_counts(corpus, tmp_path):
    import shutil

    one, two = tmp_path / "one", tmp_path / "two"
    # default flags: the whole recipe, one process against two sharded ones, 20 steps
    steps = ["--max_train_steps", "20", "--checkpointing_steps", "5"]
    _pretrain(["--train_file", corpus, "--output_dir", one, *steps])
    result = _pretrain(["--train_file", corpus, "--output_dir", two, "--edge_sharding", "source", *steps],
                       processes=2)
    assert "edge sharding by source: edge rows per process" in result.stdout
    assert "gradient norm clipped to 0.6" in result.stdout
    assert "keeping the best model by validation loss" in result.stdout  # and the final folder holds it: below
    config = json.loads((two / "config.json").read_text())
    assert all(config[k] for k in ("node_readout", "node_embedding", "count_prior"))  # the recipe's extensions
    _same_run(two, one, range(1, 21))
    assert sorted(p.name for p in (two / "step_5").glob("edge_*")) == [
        "edge_shard_00000_of_00002.safetensors", "edge_shard_00001_of_00002.safetensors", "edge_shared.safetensors"]
    # the final folder is a plain one: from_pretrained in one process, no sharding involved
    loaded = BriLLMForCausalLM.from_pretrained(two)
    assert loaded.base_model.weights.shape[0] == loaded.config.num_edge_rows

    # (3 processes, an uneven split: the model-level test above, through the same engine)

    # 2 -> 1: resume the two-process checkpoint at step 5 in one process (latest), checkpoint at 7
    shutil.copytree(two, tmp_path / "r1")
    for later in ("step_10", "step_15", "step_20"):
        shutil.rmtree(tmp_path / "r1" / later)
    result = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "r1", "--edge_sharding", "source",
                        "--resume_from_checkpoint", "latest", "--max_train_steps", "20", "--checkpointing_steps", "7"])
    assert "resumed from" in result.stdout and "step 5" in result.stdout
    _same_run(tmp_path / "r1", one, range(6, 21))
    # 1 -> 2: resume that one-process checkpoint at step 7 with two processes
    shutil.copytree(tmp_path / "r1", tmp_path / "r2")
    for earlier in ("step_5", "step_14"):
        shutil.rmtree(tmp_path / "r2" / earlier)
    _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "r2", "--edge_sharding", "source",
               "--resume_from_checkpoint", "latest", "--max_train_steps", "20"], processes=2)
    _same_run(tmp_path / "r2", one, range(8, 21))

    # errors: a checkpoint of the other kind; a checkpoint of another model (what the flags alone refuse: below)
    bad = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "bad", "--edge_sharding", "source",
                     "--resume_from_checkpoint", one / "step_5"], check=False)
    assert bad.returncode == 2 and "saved without --edge_sharding source" in bad.stderr
    bad = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "bad", "--resume_from_checkpoint",
                     two / "step_5"], check=False)
    assert bad.returncode == 2 and "resume it with --edge_sharding source" in bad.stderr
    bad = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "bad", "--edge_sharding", "source",
                     "--resume_from_checkpoint", two / "step_5", "--node_size", "4"], check=False)
    assert bad.returncode == 2 and "saved for another model" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_pretrain_demo_recipe_sharded_matches_one_process_and_resumes_in_one(corpus, tmp_path):
    """The demo preset's recipe (--node_lr_scale 2, --shared_edge_lr_scale 0.5, weight decay 0.1) plus
    --non_edge_bias and --lazy_weight_decay, at TINY's size: two sharded processes equal one process; their step-5
    checkpoint resumes in one sharded process to the same end."""
    import shutil

    recipe = ["--config", "demo", "--non_edge_bias", "--lazy_weight_decay", "--checkpointing_steps", "5",
              "--checkpoints_total_limit", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    _pretrain(["--train_file", corpus, "--output_dir", one, *recipe])
    _pretrain(["--train_file", corpus, "--output_dir", two, "--edge_sharding", "source", *recipe], processes=2)
    config = json.loads((two / "config.json").read_text())
    assert config["non_edge_bias"] is True and config["node_size"] == 8
    _same_run(two, one, range(1, 11))
    assert float(_final_params(two)["non_edge_bias"].abs().max()) > 1e-2  # trained, and equal to one process's
    shutil.copytree(two, tmp_path / "r1")
    shutil.rmtree(tmp_path / "r1" / "step_10")
    result = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "r1", "--edge_sharding", "source",
                        "--resume_from_checkpoint", "latest", *recipe])
    assert "resumed from" in result.stdout and "step 5" in result.stdout
    _same_run(tmp_path / "r1", one, range(6, 11))


@pytest.fixture(scope="module")
def pretrain():
    from modeling_brillm.training import pretraining  # what examples/pretrain.py runs

    return pretraining


def test_pretrain_refuses_what_sharding_cannot_train(pretrain, corpus, tmp_path, monkeypatch, capsys):
    argv = ["--train_file", corpus, "--output_dir", tmp_path / "bad", "--edge_sharding", "source",
            "--optimizer", "adamw"]
    assert "use --optimizer sparse_adamw" in refused(pretrain, argv, monkeypatch, capsys)
