"""The recurrence as one Triton scan (triton_recurrence.py) against the torch column loop (recurrence.py, the
reference), through ops.signal_scan and through the model.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1); with
one, everything runs on it (TF32 is off by default for fp32 matmuls). `kernel_backend("triton")` forces the
kernels, `kernel_backend("torch")` the loop. fp32 everywhere: signals, loss and
every gradient within 1e-5 relative (to the largest entry of the reference), on random sparse and dense graphs,
right and left padding, continuation from a state, with dense and sparse gradients, and with and without the
candidate backward's gradient hand-over (EdgeGradLink). Shapes are tiny: the interpreter is slow.
"""

import pytest
import torch

from modeling_brillm import BriLLMForCausalLM, BriLLMModel, graph_from_edges, ops
from modeling_brillm.backend import HAVE_TRITON, kernel_backend
from modeling_brillm.energy import gather_edges
from modeling_brillm.recurrence import scan_dropout_mask
from modeling_brillm.state import Columns, Mix
from modeling_brillm.tables import EdgeTable

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install .[gpu])")

V, D = 9, 8
TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_model(seed=0, dense=False, positions="random", cls=BriLLMForCausalLM, **config):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if dense:
        model = cls.from_graph(None, vocab_size=V, node_size=D, **config)
    else:
        mask = torch.rand(V, V, generator=g) < 0.45
        mask[V - 1] = False  # a node without real successors: every edge from it is the shared one
        src, tgt = mask.nonzero(as_tuple=True)
        model = cls.from_graph(graph_from_edges(src, tgt, V), node_size=D, **config)
    if positions == "random":
        with torch.no_grad():
            model.base_model.positions.uniform_(-2, 2, generator=g)
    return model.to(DEVICE)  # positions="ones": the released init, where every running-max update is a tie


def assert_rel(actual, expected, name="", tol=TOL):
    actual = actual.to_dense() if actual.is_sparse else actual
    expected = expected.to_dense() if expected.is_sparse else expected
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"{name}: max error {float(err):.3g} vs scale {float(scale):.3g}"


def both_backends(fn):
    """fn() under the torch loop and under the Triton scan; the model's gradients are collected per run."""
    results = []
    for backend in ("torch", "triton"):
        with kernel_backend(backend):
            results.append(fn())
    return results


def run_lm(model, ids, mask, sparse, labels=None, return_logits=True):
    model.sparse_gradients = sparse
    model.zero_grad(set_to_none=True)
    labels = ids if labels is None else labels
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True,
                return_logits=return_logits)
    out.loss.backward()
    for name in ("weights", "biases"):
        grad = getattr(model.base_model, name).grad
        if grad.is_sparse:  # one gradient per table: the recurrence's rows were added into the candidates' own
            rows = grad._indices()[0]
            assert bool((rows[1:] > rows[:-1]).all()), f"{name}: the sparse gradient has repeated rows"
    grads = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
             for n, p in model.base_model.named_parameters() if p.grad is not None}
    logits = out.logits.detach() if return_logits else None
    return out.loss.detach(), out.hidden_states[0].detach(), logits, grads


def masks(kind, B, T):
    mask = torch.ones(B, T, dtype=torch.long)
    if kind == "right":
        mask[1, -3:] = 0
        mask[2, -1:] = 0
    elif kind == "left":
        mask[0, :2] = 0
        mask[2, :4] = 0
    return mask


@pytest.mark.parametrize("dense,sparse,padding", [
    (False, True, "right"), (False, False, "left"), (True, True, "left"), (True, False, "none"),
])
def test_training_forward_and_backward_equal_the_torch_loop(dense, sparse, padding):
    model = random_model(seed=1, dense=dense)
    B, T = 3, 7
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = masks(padding, B, T).to(DEVICE)
    (l0, h0, z0, g0), (l1, h1, z1, g1) = both_backends(lambda: run_lm(model, ids, mask, sparse))
    assert_rel(l1, l0, "loss")
    assert_rel(h1, h0, "signals")
    assert_rel(z1, z0, "logits")
    assert g0.keys() == g1.keys() == {"node_bias", "weights", "biases", "positions"}
    for name in g0:
        assert_rel(g1[name], g0[name], name)


@pytest.mark.parametrize("sparse", [False, True])
def test_node_vectors_through_the_model_equal_the_torch_loop(sparse):
    """config.node_embedding with the recipe's other options: loss, signals, logits and every gradient (the nodes'
    vectors' too) through the scan equal the column loop's, and a decoded continuation equals the forward."""
    model = random_model(seed=12, node_embedding=True, edge_backoff=True, node_readout=True, non_edge_bias=True)
    with torch.no_grad():
        model.base_model.node_embedding.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    mask = masks("right", 3, 7).to(DEVICE)
    (l0, h0, z0, g0), (l1, h1, z1, g1) = both_backends(lambda: run_lm(model, ids, mask, sparse))
    assert_rel(l1, l0, "loss")
    assert_rel(h1, h0, "signals")
    assert_rel(z1, z0, "logits")
    assert "node_embedding" in g0 and g0.keys() == g1.keys()
    assert float(g0["node_embedding"].abs().sum()) > 0
    for name in g0:
        assert_rel(g1[name], g0[name], name)
    with kernel_backend("triton"), torch.no_grad():
        model.eval()
        full = model(ids[:1]).logits
        out = model(ids[:1, :4], use_cache=True)
        step = model(ids[:1, 4:5], cache=out.state)
    assert_rel(step.logits[:, 0], full[:, 4], "one decoded token")
    runs = []
    for backend, mode in (("torch", "off"), ("torch", "eager"), ("triton", "eager")):  # eager: the sync-free step
        model.decode_mode = mode
        with kernel_backend(backend):
            runs.append(model.generate(ids[:2, :3], max_new_tokens=5, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True))
    model.decode_mode = "auto"
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        for a, b in zip(run.scores, runs[0].scores):
            assert_rel(a, b, "decode step scores")


@pytest.mark.parametrize("sparse", [False, True])
def test_edges_outside_the_scored_blocks(sparse):
    """Unscored positions (-100): the recurrence crosses edges whose source block the candidate backward does not
    touch; their gradients must still land in the one gradient it publishes (rows merged through the link)."""
    model = random_model(seed=12)
    indptr, indices = model.csr()
    u = int((indptr.diff() > 0).nonzero()[0])  # a source with real successors, read at one unscored position only
    others = torch.tensor([n for n in range(V) if n != u])
    ids = others[torch.randint(0, V - 1, (3, 7), generator=torch.Generator().manual_seed(13))]
    ids[0, 2], ids[0, 3] = u, indices[indptr[u]]  # the real edge u -> its first successor
    labels = ids.clone()
    labels[0, 3] = -100  # position 2 (source u) is not scored
    assert model.edge_rows(ids[0, 2:3], ids[0, 3:4]).item() > 0
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)
    # no logits: only the scored positions' source blocks get candidate energies
    (l0, h0, z0, g0), (l1, h1, z1, g1) = both_backends(lambda: run_lm(model, ids, None, sparse, labels, False))
    assert_rel(l1, l0, "loss")
    for name in g0:
        assert_rel(g1[name], g0[name], name)


def test_released_positions_ties_and_learned_start_signal():
    # positions all ones: every running-max update compares equal numbers (torch.maximum splits the gradient)
    model = random_model(seed=3, positions="ones", start_signal="learned", num_start_signals=2)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, signal_ids=torch.tensor([1, 0], device=DEVICE))
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.base_model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    (l0, g0), (l1, g1) = both_backends(run)
    assert_rel(l1, l0, "loss")
    assert "start_signals" in g0
    for name in g0:
        assert_rel(g1[name], g0[name], name)


@pytest.mark.parametrize("positions", ["random", "ones"])
def test_continuation_from_a_state_passes_gradients_to_the_state(positions):
    """Two calls chained through the cache, differentiated through both, with a loss that reads the raw
    running sums of the final state too (their gradient is not invariant to the max rescaling, so the route
    through the running max counts, ties included)."""
    model = random_model(seed=5, cls=BriLLMModel, positions=positions)
    g = torch.Generator().manual_seed(6)
    first, second = torch.randint(0, V, (3, 4), generator=g), torch.randint(0, V, (3, 3), generator=g)
    mask2 = torch.ones(3, 7, dtype=torch.long)
    mask2[1, -1] = 0  # a right-padded column in the continuation
    weights = torch.randn(3, 3, D, generator=g)
    first, second, mask2, weights = (t.to(DEVICE) for t in (first, second, mask2, weights))

    def run():
        model.zero_grad(set_to_none=True)
        out1 = model(first, use_cache=True)
        state = out1.state
        out2 = model(second, attention_mask=mask2, cache=state, use_cache=True)
        end = out2.state
        loss = (out2.last_hidden_state * weights).sum() + (out1.last_hidden_state ** 2).sum() \
            + (end.mix_sum * weights[:, 0]).sum() + end.mix_norm.sum() * 0.3 + end.mix_max.sum() * 0.7 \
            + end.signal.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.base_model.named_parameters() if p.grad is not None}
        return loss.detach(), out2.last_hidden_state.detach(), end.mix_sum.detach(), grads

    (l0, h0, s0, g0), (l1, h1, s1, g1) = both_backends(run)
    assert_rel(l1, l0, "loss")
    assert_rel(h1, h0, "signals of the continuation")
    assert_rel(s1, s0, "final mix_sum")
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_rel(g1[name], g0[name], name)


@pytest.mark.parametrize("sparse", [False, True])
def test_own_edge_gradients_without_candidate_energies(sparse):
    """The base model (signals only): no candidate backward publishes buffers, the scan returns its own
    gradients, dense or sparse over the rows read (row 0 included for padding columns, as gather_edges)."""
    model = random_model(seed=7, cls=BriLLMModel)
    model.sparse_gradients = sparse
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    mask = torch.ones(2, 5, dtype=torch.long, device=DEVICE)
    mask[0, -2:] = 0

    def run():
        model.zero_grad(set_to_none=True)
        hidden = model(ids, attention_mask=mask).last_hidden_state
        (hidden.sin() * 3).sum().backward()
        return hidden.detach(), {n: p.grad for n, p in model.base_model.named_parameters() if p.grad is not None}

    (h0, g0), (h1, g1) = both_backends(run)
    assert_rel(h1, h0, "signals")
    for name in g0:
        assert g1[name].is_sparse == g0[name].is_sparse, name
        if g0[name].is_sparse:
            assert torch.equal(g1[name].coalesce().indices(), g0[name].coalesce().indices()), name
        assert_rel(g1[name], g0[name], name)


def test_inference_and_fetched_rows():
    """No grad: signals equal; and the sharded path's `edge_fetch` (rows handed in as a gathered table)."""
    model = random_model(seed=9, dense=True, cls=BriLLMModel)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    with torch.no_grad():
        h0, h1 = both_backends(lambda: model(ids).last_hidden_state)
    assert_rel(h1, h0, "no-grad signals")

    def fetched():
        model.zero_grad(set_to_none=True)
        run = model.base_model.run_signals(ids, edge_fetch=lambda rows: gather_edges(model.base_model.weights,
                                                                                     model.base_model.biases, rows))
        run.signals.square().sum().backward()
        return run.signals.detach(), model.base_model.weights.grad.clone(), model.base_model.positions.grad.clone()

    (s0, w0, p0), (s1, w1, p1) = both_backends(fetched)
    assert_rel(s1, s0, "signals")
    assert_rel(w1, w0, "weights (through the fetched rows)")
    assert_rel(p1, p0, "positions")


def _spy_scan(monkeypatch):
    """Count the calls that reach the Triton scan."""
    calls = []
    kernel = ops.kernel_signal_scan
    monkeypatch.setattr(ops, "kernel_signal_scan", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def test_scan_is_chosen_only_where_it_applies(monkeypatch):
    calls = _spy_scan(monkeypatch)
    model = random_model(seed=11)
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def picks_kernel(m, **kwargs):
        before = len(calls)
        m(ids[:, :4] % m.config.vocab_size, **kwargs)
        return len(calls) > before

    with kernel_backend("torch"):
        assert not picks_kernel(model)
    with kernel_backend("triton"):
        assert picks_kernel(model)
        model.config.signal_dropout = 0.1  # the scan applies the dropout mask itself
        model.train()
        assert picks_kernel(model)
        big = BriLLMModel.from_graph(None, vocab_size=2, node_size=136).to(DEVICE)
        assert not picks_kernel(big)  # d > 128: the tile would not fit in registers
        half = BriLLMModel.from_graph(None, vocab_size=3, node_size=8).to(DEVICE, torch.bfloat16)
        assert not picks_kernel(half)  # training bf16 weights: the loop
        with torch.no_grad():
            assert picks_kernel(half)  # bf16 inference: the scan (float32 arithmetic)


def run_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe, sparse=False,
             dropout=0.0, edge_base=None, node_add=None):
    """`ops.signal_scan` of these tensors: (signals, signal, mix_sum, mix_norm, mix_max), dropout's mask seeded 7."""
    keep = scan_dropout_mask(dropout, 7, None, None, rows.shape, pe.shape[-1], pe.device) if dropout else None
    signals, mix = ops.signal_scan(Mix(signal, mix_sum, mix_norm, mix_max),
                                   Columns(rows, has_edge, pe, mix_weight, node_add, keep),
                                   EdgeTable(weights, biases, edge_base, None, sparse))
    return (signals, *mix.tensors())


def scan_inputs(seed, B=3, L=6, P=11, fetched=False):
    """A consistent random state (signal = sum / norm), rows, a padded column and a sequence start."""
    g = torch.Generator().manual_seed(seed)
    if fetched:  # the sharded path: one fetched row per column, the table indexed by b·L + j
        P = B * L
    weights, biases = torch.randn(P, D, D, generator=g) * 0.5, torch.randn(P, 1, D, generator=g) * 0.5
    rows = torch.arange(B * L).view(B, L) if fetched else torch.randint(0, P, (B, L), generator=g)
    has_edge = torch.rand(B, L, generator=g) < 0.8
    has_edge[0, 0] = False
    signal, norm = torch.randn(B, D, generator=g), torch.rand(B, generator=g) + 1
    state = [signal, signal * norm.unsqueeze(1), norm, torch.randn(B, generator=g)]
    state[2][0], state[3][0], state[1][0] = 0.0, float("-inf"), 0.0  # row 0 starts a sequence
    mix_weight, pe = torch.randn(B, L, generator=g), torch.randn(B, L, D, generator=g)
    leaves = [t.to(DEVICE).requires_grad_() for t in (*state[:3], mix_weight, weights, biases)]
    return leaves, state[3].to(DEVICE), rows.to(DEVICE), has_edge.to(DEVICE), pe.to(DEVICE)


@pytest.mark.parametrize("sparse,fetched,shared_matrix,dropout,node_vectors", [
    (False, False, False, 0.0, False), (True, False, False, 0.0, False), (False, True, False, 0.0, False),
    (True, False, True, 0.0, False), (False, True, True, 0.0, False), (False, False, False, 0.3, False),
    (True, False, True, 0.3, False), (False, False, False, 0.0, True), (True, False, True, 0.3, True),
])
def test_ops_signal_scan_kernel_equals_the_reference(sparse, fetched, shared_matrix, dropout, node_vectors):
    """ops.signal_scan through the kernel and through the torch column loop: signals, final state and every
    gradient within 1e-5 (sparse gradients: the same rows); the sharded path's fetched table too, the matrix
    every edge adds to its own (config.edge_backoff) with its gradient, signal dropout (one mask for both), and the
    entered nodes' vectors added to the edge outputs (config.node_embedding) with their gradient."""
    results = []
    names = ["signal", "mix_sum", "mix_norm", "mix_weight", "weights", "biases"]
    extra = (["edge_base"] if shared_matrix else []) + (["node_add"] if node_vectors else [])
    for backend in ("torch", "triton"):
        leaves, mix_max, rows, has_edge, pe = scan_inputs(3, fetched=fetched)
        signal, mix_sum, mix_norm, mix_weight, weights, biases = leaves
        edge_base = node_add = None
        if shared_matrix:
            edge_base = (torch.randn(D, D, generator=torch.Generator().manual_seed(5)) * 0.5).to(DEVICE)
            leaves.append(edge_base.requires_grad_())
        if node_vectors:
            node_add = torch.randn(*rows.shape, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
            leaves.append(node_add.requires_grad_())
        with kernel_backend(backend):  # the same dropout mask on both paths
            out = run_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe,
                           sparse, dropout=dropout, edge_base=edge_base, node_add=node_add)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), device=DEVICE).view(o.shape)).sum()
                   for o in out if o.requires_grad)
        loss.backward()
        results.append((out, [t.grad for t in leaves]))
    (out0, grads0), (out1, grads1) = results
    for a, b, name in zip(out1, out0, ("signals", "signal", "mix_sum", "mix_norm", "mix_max")):
        assert_rel(a.detach(), b.detach(), name)
    if dropout:  # the candidates saw dropped signals: some entries zero, the final state undropped
        assert (out0[0] == 0).float().mean() > 0.1 and not torch.equal(out0[0][:, -1], out0[1])
    assert len(grads1) == len(grads0) == len(names) + len(extra)
    for a, b, name in zip(grads1, grads0, names + extra):
        assert a.is_sparse == b.is_sparse, name
        assert_rel(a, b, name)


def test_ops_signal_scan_torch_reference_is_the_model_loop_bit_for_bit():
    """The reference is the column loop as the model ran it: dropout off, the final signal the last column's."""
    (signal, mix_sum, mix_norm, mix_weight, weights, biases), mix_max, rows, has_edge, pe = scan_inputs(4)
    with kernel_backend("torch"), torch.no_grad():
        signals, last, *_ = run_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge,
                                     pe)
    assert torch.equal(signals[:, -1], last)
