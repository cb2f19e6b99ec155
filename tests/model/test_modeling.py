"""Core model: exact spec math, loss, padding, state, generate, graph building, HF integration, bad input."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from _tiny import assert_same
from spec_reference import released_edge_rows, spec_forward, spec_loss, spec_positional_encoding, spec_sampled_loss
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import modeling_brillm as mb
from modeling_brillm import BriLLMConfig, BriLLMForCausalLM, BriLLMModel, build_sparse_graph, positional_encoding
from modeling_brillm.state import CACHE
from tests.integration.test_remote_code import BLOCK_PACKAGE  # a fresh process that cannot import the package

V, D = 12, 6


def tiny_model(seed=0, dense=False, length=9, rows=6, device="cpu", **config):
    torch.manual_seed(seed)
    seqs = [torch.randint(0, V, (length,)) for _ in range(rows)]
    model = BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=V, node_size=D, dense=dense, **config)
    with torch.no_grad():
        model.base_model.positions.normal_()  # non-uniform mix weights, so the softmax mix is really exercised
    return model.to(device), seqs


def row_map(model):
    u, v = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    rows = model.edge_rows(u.reshape(-1), v.reshape(-1)).tolist()
    return {(a, b): r for a, b, r in zip(u.reshape(-1).tolist(), v.reshape(-1).tolist(), rows)}


def released_state(model, requires_grad=False):
    return {k: model.base_model.state_dict()[k].detach().cpu().clone().requires_grad_(requires_grad)
            for k in ("node_bias", "weights", "biases", "positions")}


# --------------------------------------------------------------------------------------------- config
def test_config_rejects_invalid_combinations():
    for kwargs, needle in [
        (dict(graph="mesh"), "graph must be one of"),
        (dict(vocab_size=10, num_edges=5, node_size=0), "node_size must be a positive integer"),
        (dict(vocab_size=10, num_edges=5, pad_token_id=10), "pad_token_id=10"),
        (dict(vocab_size=10, num_edges=5, position_encoding="rope"), "position_encoding"),
        (dict(vocab_size=10, num_edges=5, loss_type="sampled", num_negatives=10), "num_negatives=10"),
        (dict(vocab_size=10, graph="dense", loss_type="sampled", num_negatives=3), "frequency negatives"),
    ]:
        with pytest.raises(ValueError, match=needle.replace("*", r"\*").replace("(", r"\(")):
            BriLLMConfig(**kwargs)
    # the graph's size is checked where a model is built (the config alone builds, as transformers expects)
    for kwargs, needle in [
        (dict(vocab_size=10), "needs num_edges"),
        (dict(vocab_size=10, num_edges=101), "exceeds vocab_size**2"),
        (dict(vocab_size=4, graph="dense", num_edges=3), "dense graph has"),
    ]:
        with pytest.raises(ValueError, match=needle.replace("*", r"\*").replace("(", r"\(")):
            BriLLMForCausalLM(BriLLMConfig(**kwargs))


def test_config_round_trip_and_defaults(tmp_path):
    config = BriLLMConfig(vocab_size=50, num_edges=70, pad_token_id=0)
    assert (config.node_size, config.max_position_embeddings, config.position_encoding, config.loss_type) == (
        32, 512, "released", "exact")
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(again, BriLLMConfig) and again.num_edges == 70 and again.pad_token_id == 0


def test_parameter_count_matches_paper_without_allocating():
    config = BriLLMConfig(vocab_size=4000, node_size=32, graph="dense")
    assert round(config.num_parameters_formula() / 1e9, 2) == 16.90
    with torch.device("meta"):
        model = BriLLMForCausalLM(config)
    assert model.base_model.weights.is_meta
    assert model.num_parameters() == config.num_parameters_formula()
    sparse = BriLLMConfig(vocab_size=4000, node_size=32, num_edges=227 * 4000)
    assert round(sparse.num_parameters_formula() / 1e9, 3) == 0.959  # the paper's English sparse size


# ------------------------------------------------------------------------------------------ exact math
@pytest.mark.parametrize("d", [8, 32, 64])
def test_positional_encoding_is_the_released_formula_bit_for_bit(d):
    # the release's own float32 steps; an "equal" formula (exp of a log) differs by up to 0.19 at d=32, pos≈511
    freq = 10000.0 ** (torch.arange(0, d, 2) / d)
    angle = torch.arange(513).reshape(-1, 1) * freq
    release = torch.zeros(513, d)
    release[:, 0::2], release[:, 1::2] = torch.sin(angle), torch.cos(angle)
    pe = positional_encoding(torch.arange(513), d)
    assert pe.dtype == torch.float32 and torch.equal(pe, release)
    assert torch.equal(pe, spec_positional_encoding(513, d))
    # any integer dtype and shape, positions past the table: the same rows
    some = torch.tensor([[511, 0], [3, 700]], dtype=torch.int32)
    assert torch.equal(positional_encoding(some, d)[1, 0], pe[3])
    assert torch.equal(positional_encoding(some, d)[0, 0], pe[511])
    far = 10000.0 ** (torch.arange(0, d, 2) / d) * torch.tensor(700)
    assert torch.equal(positional_encoding(some, d)[1, 1, 0::2], torch.sin(far))


def test_positional_encoding_variants_and_errors():
    pe = positional_encoding(torch.arange(6), 8)
    pos, j = 3.0, 1  # PE[pos, 2j] = sin(pos * 10000^(2j/d)) — multiplied, not divided
    assert pe[3, 2 * j].item() == pytest.approx(torch.sin(torch.tensor(pos * 10000 ** (2 * j / 8))).item(), abs=1e-4)
    textbook = positional_encoding(torch.arange(6), 8, "sinusoidal")
    assert textbook[3, 2].item() == pytest.approx(torch.sin(torch.tensor(pos / 10000 ** (2 * j / 8))).item(), abs=1e-6)
    assert torch.equal(textbook, spec_positional_encoding(6, 8, released=False))
    assert positional_encoding(torch.arange(4), 5).shape == (4, 5)  # odd d: one more sin column than cos
    with pytest.raises(TypeError, match="integer tensor"):
        positional_encoding(torch.arange(4.0), 8)
    with pytest.raises(ValueError, match="'released' or 'sinusoidal'"):
        positional_encoding(torch.arange(4), 8, "rope")


@pytest.mark.parametrize("dense", [False, True])
def test_teacher_forced_logits_equal_spec(dense, device):
    model, seqs = tiny_model(dense=dense, device=device)
    rows = row_map(model) if not dense else released_edge_rows(V)[0]
    state = released_state(model)
    logits = model(torch.stack(seqs[:3])).logits.cpu()
    for b in range(3):
        torch.testing.assert_close(logits[b], spec_forward(state, rows, seqs[b].tolist()), atol=1e-5, rtol=1e-5)


def test_textbook_position_encoding_option_changes_logits(device):
    model, seqs = tiny_model(device=device)
    textbook = BriLLMForCausalLM(BriLLMConfig(**{**model.config.to_dict(), "position_encoding": "sinusoidal"}))
    textbook.load_state_dict(model.state_dict())
    textbook.to(device)
    ids = seqs[0][None]
    assert not torch.allclose(model(ids).logits, textbook(ids).logits)
    torch.testing.assert_close(textbook(ids).logits[0].cpu(), spec_forward(released_state(model), row_map(model),
                                                                     seqs[0].tolist(), released_pe=False))


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("sparse_gradients", [False, True])
def test_exact_loss_and_gradients_equal_spec(dense, sparse_gradients, device):
    model, seqs = tiny_model(dense=dense, device=device)
    model.sparse_gradients = sparse_gradients
    rows = row_map(model) if not dense else released_edge_rows(V)[0]
    tokens = seqs[1]
    out = model(tokens[None], labels=tokens[None], return_logits=False)
    assert out.logits is None
    out.loss.backward()
    state = released_state(model, requires_grad=True)
    expected = spec_loss(state, rows, tokens.tolist())
    expected.backward()
    torch.testing.assert_close(out.loss.cpu(), expected, atol=1e-5, rtol=1e-5)
    for name in state:
        grad = getattr(model.base_model, name).grad.cpu()
        if sparse_gradients and name != "positions":
            assert grad.is_sparse
            grad = grad.to_dense()
        torch.testing.assert_close(grad, state[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_exact_loss_equals_full_softmax_over_logits_and_costs_real_successors_only(device):
    model, seqs = tiny_model(rows=12, device=device)
    ids = torch.stack(seqs).to(device)
    out = model(ids, labels=ids)
    full = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, full)
    # a shared energy per position, plus one per real successor: never V per position
    plan = mb.plans.make_torch_plan(ids[:, :-1].reshape(-1), *model.csr(), V)
    assert (plan.num_entries == int((model.base_model.graph_indptr.diff()[ids[:, :-1].reshape(-1)]).sum())
            < ids[:, :-1].numel() * V)


def test_labels_minus_100_and_padding_are_ignored(device):
    model, seqs = tiny_model(device=device)
    ids = seqs[0][None].repeat(2, 1)
    labels = ids.clone()
    labels[:, 5:] = -100
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    short = model(ids[:1, :5], labels=ids[:1, :5]).loss
    torch.testing.assert_close(model(ids[:1], labels=labels[:1]).loss, short)
    torch.testing.assert_close(model(ids[1:], attention_mask=mask[1:], labels=ids[1:]).loss, short)
    everything_ignored = model(ids, labels=torch.full_like(ids, -100)).loss
    assert everything_ignored.item() == 0.0


def _frequency_negatives(model, tokens, K):
    """The K most frequent successors of each source (by stored bigram count, ties by id), target excluded; fill
    with non-successors."""
    indptr, indices, counts = (model.base_model.graph_indptr, model.base_model.graph_indices,
                               model.base_model.graph_counts)
    negatives = []
    for u, target in zip(tokens[:-1], tokens[1:]):
        succ = indices[indptr[u]:indptr[u + 1]].tolist()
        cnt = counts[indptr[u]:indptr[u + 1]].tolist()
        ranked = [v for _, v in sorted(zip([-c for c in cnt], succ))]
        chosen = [v for v in ranked[:K + 1] if v != target][:K]
        fillers = [v for v in range(V) if v not in succ and v != target]
        negatives.append(chosen + fillers[:K - len(chosen)])
    return negatives


def test_sampled_loss_frequency_negatives_equals_release_objective(device):
    model, seqs = tiny_model(loss_type="sampled", num_negatives=3, rows=20, device=device)
    tokens = seqs[2].tolist()
    out = model(seqs[2][None], labels=seqs[2][None])
    expected = spec_sampled_loss(released_state(model), row_map(model), tokens, _frequency_negatives(model, tokens, 3))
    torch.testing.assert_close(out.loss.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_uniform_sampled_loss_with_all_nodes_is_the_exact_loss(device):
    model, seqs = tiny_model(loss_type="sampled", negative_sampling="uniform", num_negatives=V - 1, device=device)
    exact = BriLLMForCausalLM(BriLLMConfig(**{**model.config.to_dict(), "loss_type": "exact"}))
    exact.load_state_dict(model.state_dict())
    exact.to(device)
    ids = torch.stack(seqs[:2])
    torch.testing.assert_close(model(ids, labels=ids).loss, exact(ids, labels=ids).loss)
    small = BriLLMForCausalLM(BriLLMConfig(**{**model.config.to_dict(), "num_negatives": 2}))
    small.load_state_dict(model.state_dict())
    small.to(device)
    assert small(ids, labels=ids).loss < exact(ids, labels=ids).loss  # fewer competitors, lower loss


# ------------------------------------------------------------------------------------- padding, state
def test_padding_either_side_gives_the_rows_own_logits(device):
    model, seqs = tiny_model(length=10, device=device)
    a, b = seqs[0][:6], seqs[1]
    alone_a, alone_b = model(a[None]).logits[0], model(b[None]).logits[0]
    for left in (True, False):
        ids = torch.zeros(2, 10, dtype=torch.long, device=device)
        mask = torch.zeros(2, 10, dtype=torch.long, device=device)
        cols = slice(4, 10) if left else slice(0, 6)
        ids[0, cols], mask[0, cols] = a, 1
        ids[1], mask[1] = b, 1
        logits = model(ids, attention_mask=mask).logits
        assert_same(logits[0, cols], alone_a)
        assert_same(logits[1], alone_b)
        assert torch.count_nonzero(logits[0, mask[0] == 0]) == 0


def test_incremental_decoding_equals_teacher_forcing_with_constant_state(device):
    model, seqs = tiny_model(length=40, rows=3, device=device)
    ids = torch.stack(seqs[:2])
    full = model(ids).logits
    out = model(ids[:, :5])
    pieces, state = [out.logits], out.state
    sizes = {sum(t.numel() for t in (state.signal, state.mix_sum, state.mix_norm, state.mix_max))}
    for t in range(5, 40):
        out = model(ids[:, t:t + 1], cache=state)
        pieces.append(out.logits)
        state = out.state
        sizes.add(sum(t.numel() for t in (state.signal, state.mix_sum, state.mix_norm, state.mix_max)))
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    assert sizes == {2 * (2 * D + 2)}  # O(d) per sequence, whatever the length
    assert state.seen == 40 and state.length.tolist() == [40, 40]


def test_the_state_goes_by_either_name_of_the_cache(device):
    """transformers renamed past_key_values to cache (5.24): outputs carry the state under the installed release's
    name (and as `.state`), forward() takes it under either, and both at once is refused."""
    model, seqs = tiny_model(length=12, device=device)
    ids = seqs[0][None]
    out = model(ids[:, :6])
    assert out.state is getattr(out, CACHE) and out.state is out[CACHE]
    by_new = model(ids[:, 6:7], cache=out.state.clone()).logits
    by_old = model(ids[:, 6:7], past_key_values=out.state.clone()).logits
    torch.testing.assert_close(by_new, by_old, atol=0, rtol=0)
    torch.testing.assert_close(by_new[:, 0], model(ids[:, :7]).logits[:, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        model(ids[:, 6:7], cache=out.state, past_key_values=out.state)
    generated = model.generate(ids[:, :6], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert generated[CACHE].seen == 8  # the prompt and the two tokens fed back


def test_running_mix_is_stable_with_extreme_position_weights(device):
    model, seqs = tiny_model(length=20, device=device)
    with torch.no_grad():
        model.base_model.positions.view(-1)[:20] = torch.linspace(-200, 200, 20)
    ids = seqs[0][None]
    logits = model(ids).logits.cpu()
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], spec_forward(released_state(model), row_map(model), ids[0].tolist()),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_on_device", [True, False])
def test_inputs_on_another_device_follow_the_model(device, model_on_device):
    """Ids, mask, labels and signal_ids on one device, the model on the other (with a GPU: CPU inputs to a CUDA
    model and CUDA inputs to a CPU model): every entry point computes on the model's device, as on one device."""
    from modeling_brillm.evaluation import perplexity
    from modeling_brillm.interpretability import energy_trace

    model, seqs = tiny_model(start_signal="learned", num_start_signals=2, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.base_model.start_signals[1] = torch.linspace(-1, 1, D)
    ids = torch.stack(seqs[:2])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    labels, signal_ids = ids.masked_fill(mask == 0, -100), torch.tensor([1, 0])
    generation = dict(max_new_tokens=3, do_sample=False)
    ref = model(ids, attention_mask=mask, labels=labels, signal_ids=signal_ids)
    ref_generated = model.generate(ids, attention_mask=mask, signal_ids=signal_ids, **generation)
    ref_energy = model.energy_generate(ids, attention_mask=mask, signal_ids=signal_ids, **generation).sequences
    ref_ppl, ref_trace = perplexity(model, None, [ids[1]]).perplexity, energy_trace(model, ids[1]).energies
    ref_rows = model.edge_rows(ids[0], ids[1])

    model.to(device if model_on_device else "cpu")
    at = "cpu" if model_on_device else device
    ids, mask, labels, signal_ids = (t.to(at) for t in (ids, mask, labels, signal_ids))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, signal_ids=signal_ids)
    assert out.logits.device == model.input_device == model.base_model.weights.device
    torch.testing.assert_close(out.logits.cpu(), ref.logits.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.cpu(), ref.loss.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(model.generate(ids, attention_mask=mask, signal_ids=signal_ids, **generation).cpu(),
                       ref_generated)
    assert torch.equal(model.energy_generate(ids, attention_mask=mask, signal_ids=signal_ids,
                                             **generation).sequences.cpu(), ref_energy)
    assert perplexity(model, None, [ids[1]]).perplexity == pytest.approx(ref_ppl, rel=1e-5)
    torch.testing.assert_close(energy_trace(model, ids[1]).energies, ref_trace, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.edge_rows(ids[0], ids[1]).cpu(), ref_rows)


def test_sequences_past_max_positions_are_refused(device):
    model, _ = tiny_model(max_position_embeddings=8, device=device)
    model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    state = model(torch.zeros(1, 8, dtype=torch.long)).state
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=state)


# ------------------------------------------------------------------------------------------- generate
def greedy_by_hand(model, ids, steps):
    ids = ids.clone()
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def test_generate_greedy_sampling_and_beam(device):
    model, seqs = tiny_model(eos_token_id=None, device=device)
    prompt = seqs[0][None, :4].to(device)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, greedy_by_hand(model, prompt, 6))
    for kwargs in (dict(do_sample=True, top_k=3), dict(do_sample=True, top_p=0.8, temperature=0.7),
                   dict(num_beams=3), dict(num_beams=2, do_sample=True)):
        torch.manual_seed(0)
        out = model.generate(prompt, max_new_tokens=6, **kwargs)
        assert out.shape == (1, 10) and torch.equal(out[:, :4], prompt) and int(out.max()) < V
    beams = model.generate(prompt, max_new_tokens=3, num_beams=4, num_return_sequences=4, output_scores=True,
                           return_dict_in_generate=True)
    best = beams.sequences[0]
    # the best beam's score is its summed log-probability under teacher forcing
    logp = model(best[None]).logits[0, 3:-1].log_softmax(-1).gather(1, best[4:, None]).sum()
    torch.testing.assert_close(beams.sequences_scores[0] * 3, logp, atol=1e-4, rtol=1e-4)


def test_generate_batched_left_padding_equals_single_prompts(device):
    model, seqs = tiny_model(eos_token_id=None, pad_token_id=0, device=device)
    short, longer = seqs[0][:3], seqs[1][:6]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    ids[0, 3:], mask[0, 3:] = short, 1
    ids[1], mask[1] = longer, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    for row, prompt in ((0, short), (1, longer)):  # explicit masks: the prompts may contain the pad id
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=5, do_sample=False)
        assert torch.equal(batch[row, 6:], alone[0, len(prompt):])


# ------------------------------------------------------------------------------------------- graph
def test_graph_from_bigram_counts():
    seqs = [[1, 2, 3, 2, 3], [3, 2, 0, 0], [4]]
    graph = build_sparse_graph(seqs, vocab_size=5)
    edges = {}
    for u in range(5):
        for k in range(int(graph.indptr[u]), int(graph.indptr[u + 1])):
            edges[(u, int(graph.indices[k]))] = int(graph.counts[k])
    assert edges == {(1, 2): 1, (2, 3): 2, (3, 2): 2, (2, 0): 1, (0, 0): 1}
    frequent = build_sparse_graph(seqs, vocab_size=5, min_count=2)
    assert frequent.num_edges == 2
    no_pad = build_sparse_graph(seqs, vocab_size=5, ignore_ids=[0])
    assert no_pad.num_edges == 3
    with pytest.raises(ValueError, match="no bigram"):
        build_sparse_graph([[1], [2]], vocab_size=5)
    with pytest.raises(ValueError, match="outside|out of range"):
        build_sparse_graph([[1, 9]], vocab_size=5)


def test_edges_stored_in_csr_order_with_shared_row_zero():
    model = BriLLMForCausalLM.from_token_sequences([[3, 1, 2, 1, 0]], vocab_size=4, node_size=2)
    assert model.base_model.graph_indptr.tolist() == [0, 0, 2, 3, 4]
    assert model.base_model.graph_indices.tolist() == [0, 2, 1, 1]
    assert model.edge_rows(torch.tensor([1, 1, 2, 3, 0, 3]),
                           torch.tensor([0, 2, 1, 1, 1, 3])).tolist() == [1, 2, 3, 4, 0, 0]
    assert (model.base_model.weights.shape == (5, 2, 2) and model.base_model.biases.shape == (5, 1, 2)
            and model.base_model.node_bias.shape == (4, 1, 2))
    assert model.base_model.positions.shape == (1, 512, 1) and torch.all(model.base_model.positions == 1)
    assert model.base_model.weights.abs().max() <= 0.5


# ------------------------------------------------------------------------------------ HF integration
def test_auto_classes_are_registered():
    model, _ = tiny_model()
    assert AutoModelForCausalLM.from_config(model.config).__class__ is BriLLMForCausalLM
    assert AutoModel.from_config(model.config).__class__ is BriLLMModel
    base = BriLLMModel(model.config)
    base.load_state_dict(model.base_model.state_dict())
    ids = torch.randint(0, V, (2, 5))
    hidden = base(ids).last_hidden_state
    assert hidden.shape == (2, 5, D)


def test_save_pretrained_writes_safetensors_auto_map_and_code(tmp_path):
    model, seqs = tiny_model()
    model.save_pretrained(tmp_path)
    names = set(os.listdir(tmp_path))
    assert {"model.safetensors", "config.json", "modeling_brillm.py", "configuration_brillm.py", "energy.py",
            "csr.py"} <= names
    # the package's tools stay out of the saved code: the model is what a folder carries
    assert not names & {"graph.py", "decoding.py", "interpretability.py", "optimization.py", "row_adamw.py",
                        "triton_optim.py", "selfcheck.py", "evaluation.py", "model_card.py", "naive.py"}
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoConfig": "configuration_brillm.BriLLMConfig", "AutoModel": "modeling_brillm.BriLLMModel",
                        "AutoModelForCausalLM": "modeling_brillm.BriLLMForCausalLM"}
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def run_isolated(code, tmp_path, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    environment.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", **env)
    result = subprocess.run([sys.executable, "-c", BLOCK_PACKAGE + textwrap.dedent(code)], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_remote_code_loads_in_a_fresh_process_without_the_package(tmp_path):
    model, seqs = tiny_model()
    model.save_pretrained(tmp_path / "saved")
    ids = torch.stack(seqs[:2])
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    out = run_isolated("""
        import torch
        from transformers import AutoModelForCausalLM, AutoModel
        model = AutoModelForCausalLM.from_pretrained("saved", trust_remote_code=True)
        assert type(model).__name__ == "BriLLMForCausalLM", type(model)
        assert "transformers_modules" in type(model).__module__
        expected = torch.load("expected.pt")
        torch.testing.assert_close(model(expected["ids"]).logits, expected["logits"])
        generated = model.generate(expected["ids"][:1, :3], max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, 7)
        base = AutoModel.from_pretrained("saved", trust_remote_code=True)
        assert type(base).__name__ == "BriLLMModel"
        print("ok")
    """, tmp_path)
    assert "ok" in out


def test_dtype_conversion_and_dtype_loading(tmp_path, device):
    model, seqs = tiny_model(device=device)
    model.save_pretrained(tmp_path)
    ids = torch.stack(seqs[:2])
    reference = model(ids, labels=ids)
    for half in (model.to(torch.bfloat16),
                 AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(device)):
        assert half.base_model.weights.dtype == torch.bfloat16 and half.base_model.graph_indices.dtype == torch.long
        out = half(ids, labels=ids)
        assert out.logits.dtype == torch.float32
        torch.testing.assert_close(out.logits, reference.logits, atol=0.1, rtol=0.05)
        torch.testing.assert_close(out.loss, reference.loss, atol=0.05, rtol=0.05)
        out.loss.backward()
        assert half.base_model.weights.grad.dtype == torch.bfloat16


# -------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_get_clear_errors(device):
    model, _ = tiny_model(device=device)
    cases = [
        (dict(input_ids=torch.tensor([[1, V]])), ValueError, f"token id {V} is outside the vocabulary"),
        (dict(input_ids=torch.tensor([[-1, 2]])), ValueError, "token id -1 is outside"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "empty input"),
        (dict(input_ids=torch.zeros(1, 3)), TypeError, "integer token ids"),
        (dict(input_ids=torch.zeros(3, dtype=torch.long)), ValueError, "unsqueeze"),
        (dict(input_ids=[[1, 2]]), TypeError, "torch.LongTensor"),
        (dict(input_ids=None), ValueError, "input_ids is required"),
        (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4)), ValueError,
         "attention_mask must have the shape"),
        (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])),
         ValueError, "all zeros"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)), ValueError,
         "labels must have the shape"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), labels=torch.full((1, 3), V)), ValueError,
         "labels hold ids outside"),
    ]
    for kwargs, error, needle in cases:
        with pytest.raises(error, match=needle):
            model(**kwargs)


def test_broken_checkpoints_get_clear_errors(tmp_path):
    model, _ = tiny_model()
    model.save_pretrained(tmp_path / "good")

    def copy(name):
        shutil.copytree(tmp_path / "good", tmp_path / name)
        return tmp_path / name

    missing = copy("missing")
    (missing / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(missing)
    for name, damage in (("garbage", lambda b: b"not a safetensors file" * 4),
                         ("truncated", lambda b: b[: len(b) // 2])):
        broken = copy(name)
        path = broken / "model.safetensors"
        path.write_bytes(damage(path.read_bytes()))
        with pytest.raises(OSError, match="corrupt or incomplete"):
            AutoModelForCausalLM.from_pretrained(broken)
    other = copy("other_config")
    config = json.loads((other / "config.json").read_text())
    config["num_edges"] += 3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="disagree"):
        AutoModelForCausalLM.from_pretrained(other)


def test_malformed_edge_list_is_refused(tmp_path):
    model, _ = tiny_model()
    with torch.no_grad():
        model.base_model.graph_indices[:2] = model.base_model.graph_indices[:2].flip(0) \
            if model.base_model.graph_indices[0] != model.base_model.graph_indices[1] \
            else torch.tensor([V - 1, 0])
        model.base_model.graph_indptr[3], model.base_model.graph_indptr[4] = (model.base_model.graph_indptr[4],
                                                                              model.base_model.graph_indptr[3])
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="edge list does not fit"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_num_items_in_batch_gives_the_summed_loss_over_that_count(device):
    """transformers' Trainer passes the scored tokens of all accumulated micro-batches as `num_items_in_batch`
    (the forward takes **kwargs): the loss is then the sum over this batch divided by that count."""
    model, seqs = tiny_model(device=device)
    ids = torch.stack(seqs[:2])
    mean = model(ids, labels=ids).loss
    count = (ids.shape[1] - 1) * ids.shape[0]
    torch.testing.assert_close(model(ids, labels=ids, num_items_in_batch=torch.tensor(3 * count)).loss, mean / 3)


def test_weights_holding_nan_are_refused_at_load_with_the_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model = BriLLMForCausalLM(BriLLMConfig(vocab_size=6, node_size=4, graph="dense"))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["brillm.biases"].view(-1)[:2] = float("nan")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the weights are broken: brillm\.biases holds 2 NaN or infinite value\(s\) "
                                         r"of 148; load an earlier checkpoint or retrain"):
        BriLLMForCausalLM.from_pretrained(tmp_path)
