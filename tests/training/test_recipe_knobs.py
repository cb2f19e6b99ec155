"""The recipe knobs: SparseAdamW's lazy weight decay and shared-edge learning rate, the signal dropout and
the non-edge node bias of the model (exact paths unchanged when off, saved with the config), and their flags."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from modeling_brillm.optimization import SparseAdamW
from modeling_brillm.training.optimizers import apply_pending_weight_decay, parameter_groups
from tests._tiny import PAD, corpus_ids, make_model, make_tokenizer

BETAS, EPS = (0.9, 0.99), 1e-8


def sparse_rows(rows, values, shape):
    rows = torch.as_tensor(rows, dtype=torch.long)
    return torch.sparse_coo_tensor(rows[None], values, shape, check_invariants=True)


def batch():
    tok = make_tokenizer()
    seqs = corpus_ids(tok)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return tok, ids, mask


# ------------------------------------------------------------------------------------------ lazy weight decay
def lazy_reference(steps, shape, lr_of, wd):
    """Dense decay of every row at every step, lazy Adam moments on the touched rows (float64)."""
    torch.manual_seed(3)
    p = torch.randn(shape, dtype=torch.float64)
    start = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, (rows, g) in enumerate(steps, start=1):
        lr = lr_of(t)
        p *= 1 - lr * wd  # every row, as AdamW's decoupled decay
        for r, gr in zip(rows, g.double()):
            m[r] = BETAS[0] * m[r] + (1 - BETAS[0]) * gr
            v[r] = BETAS[1] * v[r] + (1 - BETAS[1]) * gr * gr
            p[r] -= lr * (m[r] / (1 - BETAS[0] ** t)) / ((v[r] / (1 - BETAS[1] ** t)).sqrt() + EPS)
    return start, p


def random_steps(n_steps, n_rows, width, seed=4):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for t in range(n_steps):
        # a contiguous run (view path) and scattered rows (gather path); some rows untouched for several steps
        rows = sorted(set(torch.randint(0, n_rows, (4,), generator=gen).tolist()) | set(range(t % 5, t % 5 + 9)))
        steps.append((rows, torch.randn(len(rows), width, generator=gen)))
    return steps


def test_lazy_weight_decay_equals_dense_decay_of_every_row():
    shape, wd = (30, 3), 0.5
    lr_of = lambda t: 0.05 * (1 + t) / 10  # noqa: E731  (a changing learning rate: the decay is a product of rates)
    steps = random_steps(12, shape[0], shape[1])
    start, expected = lazy_reference(steps, shape, lr_of, wd)
    p = torch.nn.Parameter(start.float())
    opt = SparseAdamW([p], lr=0.05, betas=BETAS, eps=EPS, weight_decay=wd, lazy_weight_decay=True)
    for t, (rows, g) in enumerate(steps, start=1):
        opt.param_groups[0]["lr"] = lr_of(t)
        p.grad = sparse_rows(rows, g, shape)
        opt.step()
    untouched_last = sorted(set(range(30)) - set(steps[-1][0]))
    assert not torch.allclose(p.detach()[untouched_last].double(), expected[untouched_last], rtol=1e-5)  # pending
    opt.apply_pending_weight_decay()
    torch.testing.assert_close(p.detach().double(), expected, rtol=2e-6, atol=2e-7)
    # the default (touched rows only) leaves untouched rows alone: a different model
    q = torch.nn.Parameter(start.float())
    plain = SparseAdamW([q], lr=0.05, betas=BETAS, eps=EPS, weight_decay=wd)
    for t, (rows, g) in enumerate(steps, start=1):
        plain.param_groups[0]["lr"] = lr_of(t)
        q.grad = sparse_rows(rows, g, shape)
        plain.step()
    assert not torch.allclose(q.detach().double(), expected, rtol=1e-3)


def test_lazy_weight_decay_flush_and_checkpoint_continue_exactly():
    shape, wd = (20, 2, 2), 0.3
    steps = random_steps(10, shape[0], 4, seed=5)
    torch.manual_seed(0)
    init = torch.randn(shape)

    def train(p, opt, part):
        for rows, g in part:
            p.grad = sparse_rows(rows, g.view(-1, 2, 2), shape)
            opt.step()

    a = torch.nn.Parameter(init.clone())
    opt_a = SparseAdamW([a], lr=0.1, weight_decay=wd, lazy_weight_decay=True)
    train(a, opt_a, steps)
    # the same run saved after 5 steps (state_dict through JSON-free torch round trip) and resumed
    b = torch.nn.Parameter(init.clone())
    opt_b = SparseAdamW([b], lr=0.1, weight_decay=wd, lazy_weight_decay=True)
    train(b, opt_b, steps[:5])
    state = opt_b.state_dict()
    assert state["state"][0]["decayed_at"].dtype == torch.float64
    c = torch.nn.Parameter(b.detach().clone())
    opt_c = SparseAdamW([c], lr=0.1, weight_decay=wd, lazy_weight_decay=True)
    opt_c.load_state_dict(state)
    assert opt_c.state[c]["decayed_at"].dtype == torch.float64
    assert torch.equal(opt_c.state[c]["decayed_at"], opt_b.state[b]["decayed_at"])
    train(c, opt_c, steps[5:])
    assert torch.equal(c.detach(), a.detach())  # bit for bit
    # flushing in the middle (an evaluation) does not change where training goes, beyond rounding
    d = torch.nn.Parameter(init.clone())
    opt_d = SparseAdamW([d], lr=0.1, weight_decay=wd, lazy_weight_decay=True)
    train(d, opt_d, steps[:5])
    apply_pending_weight_decay(opt_d)
    train(d, opt_d, steps[5:])
    opt_a.apply_pending_weight_decay()
    opt_d.apply_pending_weight_decay()
    torch.testing.assert_close(d.detach(), a.detach(), rtol=1e-6, atol=1e-7)


def test_lazy_weight_decay_changes_nothing_for_dense_gradients_and_zero_decay():
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(6, 3))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a = SparseAdamW([a], lr=0.05, weight_decay=0.1, lazy_weight_decay=True)
    opt_b = torch.optim.AdamW([b], lr=0.05, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(6, 3)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)
    c = torch.nn.Parameter(torch.randn(6, 3))
    opt_c = SparseAdamW([c], lr=0.05, weight_decay=0.0, lazy_weight_decay=True)
    c.grad = sparse_rows([1, 4], torch.randn(2, 3), (6, 3))
    opt_c.step()
    assert "decayed_at" not in opt_c.state[c]


# ------------------------------------------------------------------------------------ shared-edge learning rate
def test_first_row_lr_scale_scales_row_zero_only():
    torch.manual_seed(2)
    shape, scale, wd = (8, 3), 0.25, 0.1
    init = torch.randn(shape)
    rows = [0, 1, 2, 5]
    g = torch.randn(len(rows), 3)
    p = torch.nn.Parameter(init.clone())
    opt = SparseAdamW([p], lr=0.1, weight_decay=wd, first_row_lr_scale=scale)
    p.grad = sparse_rows(rows, g, shape)
    opt.step()
    q = torch.nn.Parameter(init.clone())
    ref = SparseAdamW([q], lr=0.1, weight_decay=wd)
    q.grad = sparse_rows(rows, g, shape)
    ref.step()
    assert torch.equal(p.detach()[1:], q.detach()[1:])
    # first Adam step: m̂/√v̂ = sign(g) (up to eps); decay stays lr·wd, the step is lr·scale
    expected = init[0] * (1 - 0.1 * wd) - 0.1 * scale * torch.sign(g[0])
    torch.testing.assert_close(p.detach()[0], expected, rtol=1e-5, atol=1e-6)
    dense = torch.nn.Parameter(init.clone())
    dense.grad = torch.randn(shape)
    with pytest.raises(RuntimeError, match="first_row_lr_scale needs sparse gradients"):
        SparseAdamW([dense], lr=0.1, first_row_lr_scale=0.5).step()
    with pytest.raises(ValueError, match="first_row_lr_scale"):
        SparseAdamW([dense], lr=0.1, first_row_lr_scale=0.0)


def test_parameter_groups_with_recipe_options():
    model = BriLLMForCausalLM.from_token_sequences([torch.tensor([1, 2, 3, 1, 3])], 6, node_size=4,
                                                   non_edge_bias=True)
    m = model.base_model
    plain = parameter_groups(model, 0.1)
    assert len(plain) == 2 and plain[0]["params"] == [m.base_model.weights]
    groups = parameter_groups(model, 0.1, 0.05, lazy_weight_decay=True, shared_edge_lr_scale=0.5, node_lr_scale=2.0)
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert (by_param[id(m.base_model.weights)]["lazy_weight_decay"]
            and by_param[id(m.base_model.weights)]["weight_decay"] == 0.1)
    assert (by_param[id(m.base_model.weights)]["first_row_lr_scale"] == 0.5
            == by_param[id(m.base_model.biases)]["first_row_lr_scale"])
    assert (by_param[id(m.base_model.node_bias)]["lr"] == pytest.approx(0.1)
            == by_param[id(m.base_model.non_edge_bias)]["lr"])
    assert (by_param[id(m.base_model.positions)]["lr"] == 0.05
            and by_param[id(m.base_model.positions)]["weight_decay"] == 0.0)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    SparseAdamW(groups, lr=0.05)  # accepted as they are


# -------------------------------------------------------------------------------------------- signal dropout
def test_signal_dropout_is_training_only_and_zero_is_exact():
    tok, ids, mask = batch()
    model = make_model(tok)
    dropped = make_model(tok)
    dropped.config.signal_dropout = 0.3
    dropped.train()
    model.train()
    with torch.no_grad():
        torch.manual_seed(0)
        a = dropped(ids, attention_mask=mask, labels=ids).loss
        torch.manual_seed(0)
        b = dropped(ids, attention_mask=mask, labels=ids).loss
        torch.manual_seed(0)
        c = model(ids, attention_mask=mask, labels=ids).loss
    assert torch.equal(a, b) and not torch.equal(a, c)  # seeded, and it does something
    dropped.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(dropped(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    # gradients flow through the dropped signals
    dropped.train()
    dropped(ids, attention_mask=mask, labels=ids).loss.backward()
    assert dropped.base_model.weights.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="signal_dropout"):
        BriLLMConfig(graph="dense", vocab_size=4, signal_dropout=1.0)


def test_scaled_signal_dropout_is_the_dropout_of_its_share():
    tok, ids, mask = batch()
    off, half, scaled = make_model(tok), make_model(tok), make_model(tok)
    half.config.signal_dropout = 0.15
    scaled.config.signal_dropout = 0.3
    scaled.train(), half.train(), off.train()
    with torch.no_grad():
        scaled.base_model.signal_dropout_scale = 0.0
        assert torch.equal(scaled(ids, attention_mask=mask, labels=ids).loss,
                           off(ids, attention_mask=mask, labels=ids).loss)
        scaled.base_model.signal_dropout_scale = 0.5
        torch.manual_seed(0)
        a = scaled(ids, attention_mask=mask, labels=ids).loss
        torch.manual_seed(0)
        assert torch.equal(a, half(ids, attention_mask=mask, labels=ids).loss)


def test_dropout_rows_are_the_blocks_places_in_the_global_batch_as_accelerate_deals_them():
    """The training step's `dropout_rows` name the same block in one process (batch 16) as in two processes (batch 4,
    2 micro-batches each) and in one process with 4 micro-batches of 4: loaders prepared as accelerate prepares
    pretrain.py's (seedable sampler, batch k to process k mod W), two epochs."""
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from modeling_brillm.recurrence import mix64
    from modeling_brillm.training.loop import StepKeys

    blocks = list(range(96))

    def placed(processes: int, batch: int, accumulation: int) -> list[dict]:
        """Per epoch, {(step, global row): block} over every process's micro-batches."""
        epochs = [{}, {}]
        for rank in range(processes):
            loader = prepare_data_loader(DataLoader(blocks, batch_size=batch, shuffle=True, drop_last=True),
                                         num_processes=processes, process_index=rank, use_seedable_sampler=True,
                                         data_seed=3)
            keys = StepKeys()
            keys.keys_from(SimpleNamespace(num_processes=processes, process_index=rank, device="cpu"), batch, 0)
            for epoch, seen in enumerate(epochs):
                loader.set_epoch(epoch)
                keys.steps = keys.micro = 0
                for got in loader:
                    inputs = keys.dropout_inputs({"input_ids": got}, None)
                    assert inputs["dropout_seed"] == mix64(0, keys.steps)
                    for row, block in zip(inputs["dropout_rows"].tolist(), got.tolist()):
                        seen[keys.steps, row] = block
                    keys.advance(keys.micro + 1 == accumulation)
        return epochs

    one = placed(1, 16, 1)
    assert len(one[0]) == 96 and one[0] != one[1]  # 6 steps of 16 blocks; the order changes with the epoch
    assert placed(2, 4, 2) == one
    assert placed(1, 4, 4) == one


def test_pretraining_warms_the_dropout_up_over_the_first_epochs():
    from types import SimpleNamespace

    from accelerate import Accelerator

    from modeling_brillm.training.epochs import Job, Position, train_epochs, warm_signal_dropout
    from modeling_brillm.training.loop import StepResult

    tok, _, _ = batch()
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(2)), batch_size=1))
    model = make_model(tok)
    scales, steps = [], []

    def step(_batch, completed):
        scales.append(model.base_model.signal_dropout_scale)
        steps.append(completed)  # the optimizer steps before this one: what keys its dropout masks
        return StepResult(loss=1.0, targets=1, tokens=1, lr=0.1)

    job = Job(accelerator, model, None, None, loader, None, step, None, log=lambda row: None,
              best=None, tokenizer=tok, signature={})
    for warmup, expected in ((1, [0, 0.5, 1, 1, 1, 1]), (2, [0, 0.25, 0.5, 0.75, 1, 1]), (0, [1] * 6)):
        scales.clear()
        args = SimpleNamespace(max_train_steps=6, num_train_epochs=3, step_sleep=0, eval_steps=None,
                               checkpointing_steps=None, signal_dropout_warmup_epochs=warmup)
        model.base_model.signal_dropout_scale = 0.123
        train_epochs(job, args, Position())
        assert scales == expected and model.base_model.signal_dropout_scale == 1.0  # all of it after the run
    assert steps[:6] == list(range(6))
    # a resume in the second epoch continues the warm-up (and the masks' steps) where the uninterrupted run was
    scales.clear(), steps.clear()
    args.signal_dropout_warmup_epochs = 2
    train_epochs(job, args, Position(completed_steps=3, epoch=1, batches_in_epoch=1))
    assert scales == [0.75, 1, 1] and steps == [3, 4, 5]
    # the model inside a wrapper (as ShardedBriLLM holds one) is reached too
    warm_signal_dropout(torch.nn.ModuleDict({"model": model}), 0.5, 2.0)
    assert model.base_model.signal_dropout_scale == 0.25


# --------------------------------------------------------------------------------------------- non-edge bias
def test_non_edge_bias_starts_exact_and_is_a_full_softmax(tmp_path):
    tok, ids, mask = batch()
    base = make_model(tok)
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "non_edge_bias": True}))
    model.load_state_dict(base.state_dict(), strict=False)
    model.eval()
    with torch.no_grad():
        out_base = base(ids, attention_mask=mask, labels=ids)
        out = model(ids, attention_mask=mask, labels=ids)
    assert torch.equal(out.logits, out_base.logits) and torch.equal(out.loss, out_base.loss)
    with torch.no_grad():
        model.base_model.non_edge_bias.copy_(torch.randn(model.config.vocab_size))
        out = model(ids, attention_mask=mask, labels=ids)
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    full = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)
    torch.testing.assert_close(out.loss, full, rtol=1e-5, atol=1e-6)
    # non-successors differ by their bias, real successors keep their energies
    real = model.edge_rows(ids[:1, :1].expand(1, model.config.vocab_size).reshape(-1),
                           torch.arange(model.config.vocab_size)) > 0
    row = out.logits[0, 0]
    assert torch.equal(row[real], out_base.logits[0, 0][real])
    bias = model.base_model.non_edge_bias
    assert torch.allclose(row[~real] - bias[~real], row[~real][0] - bias[~real][0])
    # one-token decoding gives the teacher-forced logits
    with torch.no_grad():
        state = model(ids[:1, :5]).state
        step = model(ids[:1, 5:6], cache=state).logits[0, -1]
    torch.testing.assert_close(step, out.logits[0, 5], rtol=1e-5, atol=1e-5)
    # trains, saves and loads with its config
    model.train()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    assert model.base_model.non_edge_bias.grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["non_edge_bias"] is True
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.base_model.non_edge_bias, model.base_model.non_edge_bias)
    # an older checkpoint loaded with the knob on starts from zeros (the release's energies)
    base.save_pretrained(tmp_path / "base")
    grown = BriLLMForCausalLM.from_pretrained(tmp_path / "base", non_edge_bias=True)
    assert torch.equal(grown.base_model.non_edge_bias, torch.zeros(model.config.vocab_size))
    with pytest.raises(ValueError, match="non_edge_bias needs loss_type='exact'"):
        BriLLMConfig(**{**base.config.to_dict(), "non_edge_bias": True, "loss_type": "sampled", "num_negatives": 3})


@pytest.mark.slow
def test_pretrain_flags_reach_the_config_and_optimizer(tmp_path):
    from tests.training.test_pretrain import TINY, losses, run

    corpus = tmp_path / "corpus.txt"
    lines = [" ".join(("the cat sat on the mat and the dog ran over a log " * 3).split()[i % 7:][:9]).capitalize() + "."
             for i in range(200)]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = run(["--train_file", corpus, "--output_dir", out, *TINY, "--max_train_steps", "6",
                  "--per_device_train_batch_size", "16", "--weight_decay", "0.1", "--lazy_weight_decay",
                  "--shared_edge_lr_scale", "0.5", "--node_lr_scale", "2", "--signal_dropout", "0.1",
                  "--non_edge_bias", "--moment_dtype", "bfloat16"])
    assert "sparse_adamw" in result.stdout and "moments in bfloat16 with stochastic rounding" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["signal_dropout"] == 0.1 and config["non_edge_bias"] is True
    assert len(losses(out)) == 6
    bad = run(["--train_file", corpus, "--output_dir", tmp_path / "bad", *TINY, "--shared_edge_lr_scale", "0"],
              check=False)
    assert bad.returncode == 2 and "--shared_edge_lr_scale must be a positive number" in bad.stderr


def test_non_edge_bias_through_remote_code(tmp_path):
    """A folder with the default recipe's model options (non-edge bias, readout, recency) loads as remote code and
    gives the same logits."""
    from tests.model.test_modeling import run_isolated

    tok, ids, mask = batch()
    base = make_model(tok)
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "non_edge_bias": True, "signal_dropout": 0.1,
                                              "node_readout": True, "position_recency": 0.2}))
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        model.base_model.non_edge_bias.copy_(torch.linspace(-1, 1, model.config.vocab_size))
        model.base_model.node_readout.copy_(torch.linspace(-1, 1, model.base_model.node_readout.numel()).view(
            model.base_model.node_readout.shape))
    model.eval()
    model.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.save({"ids": ids, "mask": mask, "logits": model(ids, attention_mask=mask).logits},
                   tmp_path / "expected.pt")
    out = run_isolated("""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("saved", trust_remote_code=True).eval()
        assert "transformers_modules" in type(model).__module__ and model.config.non_edge_bias
        assert model.config.node_readout and model.config.position_recency == 0.2
        expected = torch.load("expected.pt")
        with torch.no_grad():
            logits = model(expected["ids"], attention_mask=expected["mask"]).logits
        torch.testing.assert_close(logits, expected["logits"])
        print("ok")
    """, tmp_path)
    assert "ok" in out
