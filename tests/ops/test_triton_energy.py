"""The Triton candidate-energy and decode kernels against the torch path (fp32).

On a machine with a GPU the tensors live on it and the kernels are compiled; without one they stay on the CPU and
`kernel_backend("triton")` runs the kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
Shapes are tiny (the interpreter runs every program in Python), d is not a power of two (the kernels pad it to 16 with
masks), the graphs have sources without real successors, sources
repeated over more than one position chunk, and both graph kinds.
"""

import pytest
import torch
import torch.nn.functional as F

from modeling_brillm import ops, plans, triton_energy
from modeling_brillm.backend import kernel_backend
from modeling_brillm.graph import graph_from_edges
from modeling_brillm.ops import (
    EdgeGradLink,
    KernelPlan,
    candidate_energies,
    exact_log_partition,
    gather_edges,
    make_plan,
    scatter_logits,
    successor_logits,
    target_energies,
)
from modeling_brillm.plans import make_kernel_plan
from modeling_brillm.state import TENSORS, Mix
from modeling_brillm.tables import EdgeTable, GraphView, StepAt

pytest.importorskip("triton")

D = 5
RTOL = 1e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 8 successors (two sub-tiles of 4): blocks of up to 9 successors span two tiles, the second with an
    empty sub-tile; 40 extra positions on one node span three chunks of 16."""
    monkeypatch.setattr(plans, "KERNEL_TILE_SUCCESSORS", 8)


def graph(V, seed, dense):
    if dense:
        return torch.arange(V + 1) * V, None
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(V, V, generator=g) < 0.5
    mask[V - 1] = False  # a node without real successors
    mask[0] = True  # node 0 has every node as a real successor: its block spans two tiles
    src, tgt = mask.nonzero(as_tuple=True)
    gr = graph_from_edges(src, tgt, V)
    return gr.indptr, gr.indices


def setup(V=9, N=12, seed=0, dense=False, hot=0):
    """Random fp32 tables and N positions; `hot` extra positions all on node 0 (more than one chunk of 32)."""
    g = torch.Generator().manual_seed(seed)
    indptr, indices = graph(V, seed, dense)
    P = int(indptr[-1]) + 1
    weights = torch.randn(P, D, D, generator=g) * 0.5
    biases = torch.randn(P, 1, D, generator=g) * 0.5
    sources = torch.cat([torch.randint(0, V, (N,), generator=g), torch.zeros(hot, dtype=torch.long)])
    sources[0] = V - 1  # a source with no real successor
    x = torch.randn(sources.numel(), D, generator=g)
    pe = torch.randn(sources.numel(), D, generator=g)
    indices = None if indices is None else indices.to(DEVICE)
    return (*(t.to(DEVICE) for t in (weights, biases, indptr)), indices, *(t.to(DEVICE) for t in (sources, x, pe)), V)


def views(weights, biases, indptr, indices, V, bias=None, edge_base=None):
    """The `EdgeTable` and `GraphView` a step reads of these tables and graph."""
    keys = None if indices is None else ops.edge_keys(indptr, indices, V)
    return EdgeTable(weights, biases, edge_base, bias), GraphView(indptr, indices, keys, V)


def successors(x, pe, weights, biases, sources, indptr, indices, V, bias=None, width=None):
    """`ops.successor_logits` of these tables and graph; `width` None: each row's own degree."""
    edges, graph = views(weights, biases, indptr, indices, V, bias)
    return successor_logits(x, pe, edges, sources, graph, width)


def rows_of(sources, targets, indptr, indices, V):
    if indices is None:
        return 1 + sources * V + targets
    edge_src = torch.repeat_interleave(torch.arange(V, device=indptr.device), indptr.diff())
    keys = edge_src * V + indices
    key = sources * V + targets
    pos = torch.searchsorted(keys, key).clamp_max(keys.numel() - 1)
    return torch.where(keys[pos] == key, pos + 1, torch.zeros_like(pos))


def close(a, b, name):
    a = (a.to_dense() if a.is_sparse else a).detach()
    b = (b.to_dense() if b.is_sparse else b).detach()
    scale = b.abs().max().clamp_min(1e-30)
    err = float((a - b).abs().max() / scale)
    assert err <= RTOL, f"{name}: max error {err:.2e} of the largest value"


LOSS_RESULTS = ("loss", "log Z", "target energy", "grad weights", "grad biases", "grad x", "grad pe")


def exact_loss(backend, tensors, sources, targets, indptr, indices, V, sparse_grad, link_rows=None):
    """Mean exact loss and every gradient, through ops' functions as the model calls them."""
    weights, biases, x, pe = [t.clone().requires_grad_() for t in tensors]
    with kernel_backend(backend):
        link = None
        extra = 0
        if link_rows is not None:  # a recurrence-like gather on the same link
            link = EdgeGradLink()
            ws, bs = gather_edges(weights, biases, link_rows, sparse_grad, link)
            extra = (F.gelu(ws.sum(-1) + bs.squeeze(-2)) ** 2).sum()
        plan = make_plan(sources, indptr, indices, V)
        assert isinstance(plan, KernelPlan) == (backend == "triton")
        src, tgt = sources[plan.order], targets[plan.order]
        energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan, sparse_grad, link)
        rows = rows_of(src, tgt, indptr, indices, V)
        true = target_energies(energies, shared, plan, tgt, rows, indptr[src] + 1)
        log_z = exact_log_partition(energies, shared, plan, V)
        loss = (log_z - true).mean() + extra
        loss.backward()
    return loss.detach(), log_z.detach(), true.detach(), weights.grad, biases.grad, x.grad, pe.grad


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_exact_loss_and_gradients_match_torch(dense, sparse_grad):
    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, hot=40)
    targets = torch.randint(0, V, sources.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    targets[1] = int(indices[0]) if indices is not None else 3  # at least one real-edge target
    tensors = (weights, biases, x, pe)
    ref = exact_loss("torch", tensors, sources, targets, indptr, indices, V, sparse_grad)
    got = exact_loss("triton", tensors, sources, targets, indptr, indices, V, sparse_grad)
    for a, b, name in zip(got, ref, LOSS_RESULTS, strict=True):
        if sparse_grad and name.startswith("grad w"):
            assert a.is_sparse and b.is_sparse
            assert torch.equal(a.coalesce().indices(), b.coalesce().indices()), "touched rows differ"
        close(a, b, name)


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_link_hands_recurrence_rows_into_the_kernel_gradient(sparse_grad):
    weights, biases, indptr, indices, sources, x, pe, V = setup(seed=3)
    targets = torch.randint(0, V, sources.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # rows read by "the recurrence": row 0, rows of candidate blocks, a row outside every candidate block
    present = set(sources.tolist())
    outside = [r for u in range(V) if u not in present for r in range(int(indptr[u]) + 1, int(indptr[u + 1]) + 1)]
    inside = int(indptr[int(sources[1])]) + 1
    link_rows = torch.tensor([[0, inside, inside], [outside[0] if outside else 0, 1, 2]], device=DEVICE)
    tensors = (weights, biases, x, pe)
    ref = exact_loss("torch", tensors, sources, targets, indptr, indices, V, sparse_grad, link_rows)
    got = exact_loss("triton", tensors, sources, targets, indptr, indices, V, sparse_grad, link_rows)
    for a, b, name in zip(got, ref, LOSS_RESULTS, strict=True):
        close(a, b, name)
    if sparse_grad:  # one coalesced gradient: the recurrence added into the kernel's buffers
        idx = got[3]._indices()[0]
        assert bool((idx[1:] > idx[:-1]).all())


@pytest.mark.parametrize("dense", [False, True])
def test_logits_and_their_gradients_match_torch(dense):
    """scatter_logits (sampled loss, eval) and successor_logits (decoding) write the (N, V) energies directly."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, seed=4, hot=3)
    probe = torch.randn(sources.numel(), V, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        w, b, xx = [t.clone().requires_grad_() for t in (weights, biases, x)]
        with kernel_backend(backend):
            plan = make_plan(sources, indptr, indices, V)
            energies, shared = candidate_energies(xx[plan.order], pe[plan.order], w, b, plan, True)
            logits = scatter_logits(energies, shared, plan, V)
            inv = torch.argsort(plan.order)
            (logits[inv] * probe).sum().backward()
            direct = successors(x, pe, weights, biases, sources, indptr, indices, V)
        out[backend] = (logits[inv].detach(), direct, w.grad, b.grad, xx.grad)
    for a, c, name in zip(out["triton"], out["torch"], ("logits", "successor logits", "grad w", "grad b", "grad x")):
        close(a, c, name)
    close(out["triton"][1], out["torch"][0], "successor logits vs grouped")


def test_eval_without_gradients_fills_partials_lazily():
    weights, biases, indptr, indices, sources, x, pe, V = setup(seed=6)
    results = {}
    for backend in ("torch", "triton"):
        with torch.no_grad(), kernel_backend(backend):
            plan = make_plan(sources, indptr, indices, V)
            energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan)
            logits = scatter_logits(energies, shared, plan, V)
            results[backend] = (logits, exact_log_partition(energies, shared, plan, V))
    close(results["triton"][0], results["torch"][0], "logits")
    close(results["triton"][1], results["torch"][1], "log Z")
    close(results["triton"][1], torch.logsumexp(results["torch"][0], 1), "log Z vs logits")


def test_float64_falls_back_to_the_torch_path():
    weights, biases, indptr, indices, sources, x, pe, V = setup(seed=7)
    w64, b64, x64, pe64 = (t.double() for t in (weights, biases, x, pe))
    with kernel_backend("triton"):
        plan = make_plan(sources, indptr, indices, V)
        energies, shared = candidate_energies(x64[plan.order], pe64[plan.order], w64, b64, plan)
        assert plan.fallback is not None and energies.dim() == 1  # packed energies: the torch path ran
        log_z = exact_log_partition(energies, shared, plan, V)
    with kernel_backend("torch"):
        ref_plan = make_plan(sources, indptr, indices, V)
        e2, s2 = candidate_energies(x64[ref_plan.order], pe64[ref_plan.order], w64, b64, ref_plan)
        torch.testing.assert_close(log_z, exact_log_partition(e2, s2, ref_plan, V))


def test_plan_building_is_host_sync_free():
    """On meta tensors any .item(), .tolist(), nonzero() or data-dependent size raises: the plan has none."""
    V, N = 50, 64
    sources = torch.empty(N, dtype=torch.long, device="meta")
    indptr = torch.empty(V + 1, dtype=torch.long, device="meta")
    indices = torch.empty(300, dtype=torch.long, device="meta")
    plan = make_kernel_plan(sources, indptr, indices, V, max_degree=40)
    assert plan.num_tiles == 5 and plan.tile_source.shape == (min(N, V) * 5,) and plan.count.shape == (V,)
    dense = make_kernel_plan(sources, torch.empty(V + 1, dtype=torch.long, device="meta"), None, V)
    assert dense.num_tiles == 7 and dense.degree.shape == (N,)


# ----------------------------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def tiny():
    """Trained tiny models (d = 6: padded to 16 inside the kernels), sparse and dense, and their tokenizer."""
    from _tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    models = {False: make_model(tok, node_size=6, seed=2), True: make_model(tok, dense=True, node_size=6, seed=2)}
    return tok, {dense: model.to(DEVICE) for dense, model in models.items()}


def _batch(tok, side):
    tok.padding_side = side
    enc = tok(["the cat sat on", "a dog", "my cat"], return_tensors="pt", padding=True)
    tok.padding_side = "left"
    return enc["input_ids"].to(DEVICE), enc["attention_mask"].to(DEVICE)


def _model_step(model, ids, mask, backend, return_logits):
    model.zero_grad(set_to_none=True)
    with kernel_backend(backend):
        out = model(ids, attention_mask=mask, labels=ids, return_logits=return_logits)
        out.loss.backward()
    grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
             for n, p in model.base_model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits, grads


@pytest.mark.parametrize("dense,sparse_gradients,side,loss_type", [
    (False, True, "right", "exact"),
    (True, False, "left", "exact"),
    (False, False, "left", "sampled"),
])
def test_model_loss_logits_and_gradients_match_torch(tiny, dense, sparse_gradients, side, loss_type):
    """The model's forward/backward with the kernels equals the torch path: loss and logits within 1e-5; every
    gradient as close to a float64 run as the torch path's own (fp32) gradients are (the node and position
    gradients pass through the whole recurrence, where fp32 alone loses ~1e-5), or within 1e-5."""
    tok, models = tiny
    model = models[dense]
    config = (model.config.loss_type, model.config.num_negatives, model.sparse_gradients)
    model.config.loss_type, model.config.num_negatives, model.sparse_gradients = loss_type, 5, sparse_gradients
    try:
        ids, mask = _batch(tok, side)
        return_logits = not dense  # the dense run checks the loss path alone (the interpreter is slow)
        loss_t, logits_t, grads_t = _model_step(model, ids, mask, "torch", return_logits)
        loss_k, logits_k, grads_k = _model_step(model, ids, mask, "triton", return_logits)
        model.double()
        loss_64, _, grads_64 = _model_step(model, ids, mask, "torch", False)
    finally:
        model.float()
        model.config.loss_type, model.config.num_negatives, model.sparse_gradients = config
    close(loss_k, loss_t, "loss")
    if return_logits:
        close(logits_k, logits_t, "logits")
    assert grads_k.keys() == grads_t.keys() == grads_64.keys()
    for name, exact in grads_64.items():
        scale = exact.abs().max()
        err_k = float((grads_k[name].double() - exact).abs().max() / scale)
        err_t = float((grads_t[name].double() - exact).abs().max() / scale)
        assert err_k <= max(RTOL, 2 * err_t), f"grad {name}: kernels {err_k:.1e}, torch fp32 {err_t:.1e}"


def test_generate_tokens_equal_torch(tiny):
    tok, models = tiny
    model = models[False]
    ids, mask = _batch(tok, "left")
    outs = {}
    for backend in ("torch", "triton"):
        with kernel_backend(backend):
            outs[backend] = (model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                             model.energy_generate(ids, attention_mask=mask, max_new_tokens=4).sequences)
    assert torch.equal(outs["triton"][0], outs["torch"][0])
    assert torch.equal(outs["triton"][1], outs["torch"][1])


def decode_step_matches_torch(model, tokens, state):
    """One fixed-shape decode step through the kernels equals the torch step: logits and every state tensor."""
    out = {}
    base = model.base_model
    for backend in ("torch", "triton"):
        with torch.no_grad(), kernel_backend(backend):
            out[backend] = base.decode_step(tokens, state, base.graph_view().max_degree)
    close(out["triton"][0], out["torch"][0], "logits")
    for a, b, name in zip(out["triton"][1].tensors(), out["torch"][1].tensors(), TENSORS):
        close(a.float(), b.float(), name)


@pytest.mark.parametrize("dense", [False, True])
def test_decode_step_kernels_equal_the_torch_step(tiny, dense):
    """The sync-free decode step (decode_mode="eager") as two kernels: logits, state and greedy tokens as torch's."""
    tok, models = tiny
    model = models[dense]
    ids, mask = _batch(tok, "left")
    state = model(ids, attention_mask=mask, use_cache=True).state
    tokens = torch.tensor([5, 9, 4], device=DEVICE)
    if not dense:  # row 0 steps along the last real edge of its block, row 1 along a non-edge (the shared row)
        indptr, indices = model.csr()
        last = state.last_token.tolist()
        tokens[0] = indices[int(indptr[last[0] + 1]) - 1]
        successors = set(indices[int(indptr[last[1]]):int(indptr[last[1] + 1])].tolist())
        tokens[1] = min(set(range(model.config.vocab_size)) - successors)
        assert model.edge_rows(state.last_token, tokens)[:2].tolist()[1] == 0
    decode_step_matches_torch(model, tokens, state)
    model.decode_mode = "eager"
    try:
        seqs = {}
        for backend in ("torch", "triton"):
            with kernel_backend(backend):
                seqs[backend] = model.energy_generate(ids, attention_mask=mask, max_new_tokens=5).sequences
    finally:
        model.decode_mode = "auto"
    assert torch.equal(seqs["triton"], seqs["torch"])


def test_bfloat16_tables_are_read_with_float32_math():
    """bf16 edge tables (half the bytes per row): the kernels read them and compute in float32, so the loss equals
    a float32 computation on the same (bf16-rounded) values; gradients come back in bf16."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(seed=8, hot=3)
    targets = torch.randint(0, V, sources.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    w16, b16, x16 = weights.bfloat16(), biases.bfloat16(), x.bfloat16()
    got = exact_loss("triton", (w16, b16, x16, pe), sources, targets, indptr, indices, V, True)
    ref = exact_loss("torch", (w16.float(), b16.float(), x16.float(), pe), sources, targets, indptr, indices, V, True)
    close(got[0], ref[0], "loss")
    close(got[1], ref[1], "log Z")
    assert got[3].dtype == torch.bfloat16 and got[5].dtype == torch.bfloat16
    for a, b, name in zip(got[3:], ref[3:], ("grad weights", "grad biases", "grad x")):
        a, b = a.to_dense().float() if a.is_sparse else a.float(), b.to_dense() if b.is_sparse else b
        assert float((a - b).abs().max() / b.abs().max()) < 1e-2, name  # one bf16 rounding of each value


def test_launches_do_not_grow_with_the_number_of_sources():
    """The exact loss's candidate part (plan, energies, target, log Z, backward) dispatches the same operations for
    5 or 19 distinct sources and V = 10 or 24 (the torch path grows by ~2 per source): on a GPU, a fixed launch
    count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for V, N in ((10, 6), (24, 40)):
        weights, biases, indptr, indices, sources, x, pe, V = setup(V=V, N=N, seed=1)
        targets = torch.randint(0, V, sources.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        rows = rows_of(sources, targets, indptr, indices, V)
        ops.graph_max_degree(indptr)  # read once per graph, before the step
        w, b, xx = (t.clone().requires_grad_() for t in (weights, biases, x))
        with kernel_backend("triton"):
            Count.ops = 0
            with Count():
                plan = make_plan(sources, indptr, indices, V)
                src = sources[plan.order]
                energies, shared = candidate_energies(xx[plan.order], pe[plan.order], w, b, plan, True)
                true = target_energies(energies, shared, plan, targets[plan.order], rows[plan.order], indptr[src] + 1)
                (exact_log_partition(energies, shared, plan, V) - true).mean().backward()
            counts.append(Count.ops)
        assert len(set(sources.tolist())) >= (5 if V == 10 else 18)
    assert counts[0] == counts[1]


def test_one_plan_two_calls_in_flight():
    """A plan reused for a second call (gradient accumulation over two signals) keeps each call's hand-over."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(seed=10)
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    targets = torch.randint(0, V, sources.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    grads = {}
    for backend in ("torch", "triton"):
        w, b = weights.clone().requires_grad_(), biases.clone().requires_grad_()
        with kernel_backend(backend):
            plan = make_plan(sources, indptr, indices, V)
            src, tgt = sources[plan.order], targets[plan.order]
            rows = rows_of(src, tgt, indptr, indices, V)
            losses = []
            for signal in (x, x2):
                energies, shared = candidate_energies(signal[plan.order], pe[plan.order], w, b, plan, True)
                true = target_energies(energies, shared, plan, tgt, rows, indptr[src] + 1)
                losses.append((exact_log_partition(energies, shared, plan, V) - true).sum())
            (losses[0] + 2 * losses[1]).backward()
        grads[backend] = (w.grad, b.grad)
    for a, c, name in zip(grads["triton"], grads["torch"], ("weights", "biases")):
        close(a, c, name)


# ------------------------------------------------------------------------------------------- non_edge_bias
def biased_loss(backend, tensors, bias, sources, targets, indptr, indices, V, sparse_grad, probe):
    """The exact loss plus a probe of the logits, with a per-node `non_edge_bias`, through ops' functions as
    the model calls them; returns the values and every gradient (the bias's included)."""
    weights, biases, x, pe, nb = [t.clone().requires_grad_() for t in (*tensors, bias)]
    with kernel_backend(backend):
        plan = make_plan(sources, indptr, indices, V)
        assert isinstance(plan, KernelPlan) == (backend == "triton")
        src, tgt = sources[plan.order], targets[plan.order]
        energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan, sparse_grad,
                                              non_edge_bias=nb)
        true = target_energies(energies, shared, plan, tgt, rows_of(src, tgt, indptr, indices, V), indptr[src] + 1,
                               nb)
        log_z = exact_log_partition(energies, shared, plan, V, nb)
        logits = scatter_logits(energies, shared, plan, V, nb)
        ((log_z - true).mean() + (logits * probe).sum()).backward()
        inv = torch.argsort(plan.order)
        direct = successors(x, pe, weights, biases, sources, indptr, indices, V, nb.detach())
        static = successors(x, pe, weights, biases, sources, indptr, indices, V, nb.detach(),
                            V if indices is None else ops.graph_max_degree(indptr))
    grad_nb = nb.grad if nb.grad is not None else torch.zeros_like(nb)  # dense: no non-successor anywhere
    return (log_z.detach(), true.detach(), logits.detach()[inv], direct, static, weights.grad, biases.grad, x.grad,
            pe.grad, grad_nb)


@pytest.mark.parametrize("dense,sparse_grad", [(False, False), (False, True), (True, True)])
def test_non_edge_bias_loss_logits_and_gradients_match_torch(dense, sparse_grad):
    """`non_edge_bias` on the kernel path: log Z (the non-successors' mass from the CSR), target energies (real and
    non-edge targets), logits (training and both decoding functions) and every gradient, the bias's included, as
    the torch path's; node 0 has every node as a successor (no non-successor mass), node V−1 none."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, seed=13, hot=20)
    g = torch.Generator().manual_seed(14)
    targets = torch.randint(0, V, sources.shape, generator=g).to(DEVICE)
    bias = (torch.randn(V, generator=g) * 2).to(DEVICE)
    probe = (torch.randn(sources.numel(), V, generator=g) * 0.1).to(DEVICE)
    tensors = (weights, biases, x, pe)
    ref = biased_loss("torch", tensors, bias, sources, targets, indptr, indices, V, sparse_grad, probe)
    got = biased_loss("triton", tensors, bias, sources, targets, indptr, indices, V, sparse_grad, probe)
    names = ("log Z", "target energy", "logits", "successor logits", "static successor logits", "grad weights",
             "grad biases", "grad x", "grad pe", "grad non_edge_bias")
    for a, b, name in zip(got, ref, names, strict=True):
        close(a, b, name)
    close(got[0], torch.logsumexp(ref[2], 1)[torch.argsort(sources, stable=True)], "log Z vs logits")
    if not dense:
        real = rows_of(sources, targets, indptr, indices, V) > 0
        assert bool(real.any()) and bool((~real).any())  # both kinds of target were scored
        assert float(got[-1].abs().max()) > 0


def with_option(model, field: str, parameter: str, seed: int, scale: float = 1.0):
    """`model` with config option `field` on and its new parameter set to random values (the others copied)."""
    from modeling_brillm import BriLLMConfig, BriLLMForCausalLM

    out = BriLLMForCausalLM(BriLLMConfig(**{**model.config.to_dict(), field: True}))
    out.load_state_dict(model.state_dict(), strict=False)
    tensor = getattr(out.base_model, parameter)
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)) * scale)
    return out.to(DEVICE)


@pytest.fixture(scope="module")
def biased(tiny):
    """The sparse tiny model with `non_edge_bias` set to random offsets."""
    return with_option(tiny[1][False], "non_edge_bias", "non_edge_bias", seed=15)


@pytest.fixture(scope="module")
def read_out(biased):
    """`biased` plus a random `node_readout` (every node's logit also reads the signal)."""
    return with_option(biased, "node_readout", "node_readout", seed=16)


@pytest.fixture(scope="module")
def shared_matrix(read_out):
    """`read_out` plus a random matrix every edge adds to its own (config.edge_backoff): the default recipe."""
    return with_option(read_out, "edge_backoff", "edge_base", seed=17, scale=0.3)


@pytest.mark.parametrize("sparse_gradients,side,variant", [(True, "right", "biased"), (False, "left", "biased"),
                                                           (True, "left", "read_out"), (True, "right", "shared_matrix"),
                                                           (False, "left", "shared_matrix")])
def test_non_edge_bias_model_matches_torch(tiny, sparse_gradients, side, variant, monkeypatch, request):
    """The model with `non_edge_bias` (and `node_readout`, and the edges' shared matrix) runs the kernels (no torch
    fallback) and gives the torch path's loss and logits within 1e-5 and every gradient as close to a float64 run as
    the torch path's own."""
    tok, _ = tiny
    model = request.getfixturevalue(variant)
    model.sparse_gradients = sparse_gradients
    ids, mask = _batch(tok, side)
    try:
        loss_t, logits_t, grads_t = _model_step(model, ids, mask, "torch", True)
        calls = []
        kernel_energies = triton_energy.KernelEnergies
        original = kernel_energies.apply
        with monkeypatch.context() as patch:
            patch.setattr(kernel_energies, "apply", lambda *a: calls.append(1) or original(*a))
            loss_k, logits_k, grads_k = _model_step(model, ids, mask, "triton", True)
        model.double()
        loss_64, _, grads_64 = _model_step(model, ids, mask, "torch", False)
    finally:
        model.float()
        model.sparse_gradients = False
    assert calls, "the kernels did not run"
    close(loss_k, loss_t, "loss")
    close(logits_k, logits_t, "logits")
    assert "non_edge_bias" in grads_k and grads_k.keys() == grads_t.keys() == grads_64.keys()
    assert ("node_readout" in grads_k) == (variant != "biased")
    assert ("edge_base" in grads_k) == (variant == "shared_matrix")
    for name, exact in grads_64.items():
        scale = exact.abs().max()
        err_k = float((grads_k[name].double() - exact).abs().max() / scale)
        err_t = float((grads_t[name].double() - exact).abs().max() / scale)
        assert err_k <= max(RTOL, 2 * err_t), f"grad {name}: kernels {err_k:.1e}, torch fp32 {err_t:.1e}"


@pytest.mark.parametrize("variant", ["biased", "shared_matrix"])
def test_non_edge_bias_decoding_equals_torch(tiny, variant, request):
    """The sync-free step's two kernels write shared + non_edge_bias[v] for non-successors (and add the edges'
    shared matrix): logits and state as the torch step's, and greedy tokens (kernels, eager step) as the general
    torch path's."""
    tok, _ = tiny
    model = request.getfixturevalue(variant)
    ids, mask = _batch(tok, "left")
    state = model(ids, attention_mask=mask, use_cache=True).state
    tokens = torch.tensor([5, 9, 4], device=DEVICE)
    decode_step_matches_torch(model, tokens, state)
    with kernel_backend("torch"):
        model.decode_mode = "off"
        try:
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        finally:
            model.decode_mode = "auto"
    for mode in ("auto", "eager"):  # on CPU tensors: "auto" is the general path with the kernels, "eager" the step
        model.decode_mode = mode
        try:
            with kernel_backend("triton"):
                got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        finally:
            model.decode_mode = "auto"
        assert torch.equal(got, ref), mode


@pytest.mark.parametrize("dense,biased,shared_matrix", [
    (False, False, False), (False, True, False), (True, False, False), (True, True, False), (False, True, True),
    (True, False, True),
])
def test_ops_decode_step_kernel_equals_the_reference(dense, biased, shared_matrix):
    """ops.decode_step through the two decode kernels and through recurrence.decode_step: logits and state within
    1e-5, along a real edge, a non-edge, from a node without successors, a sequence start and past the position
    weights; also with the matrix every edge adds to its own (config.edge_backoff)."""
    weights, biases, indptr, indices, _, _, _, V = setup(seed=13, dense=dense)
    g = torch.Generator().manual_seed(14)
    B = 4
    last = torch.tensor([0, V - 1, 3, 5], device=DEVICE)
    tokens = torch.randint(0, V, (B,), generator=g).to(DEVICE)
    keys = None if indices is None else ops.edge_keys(indptr, indices, V)
    if not dense:  # row 0 along the last real edge of node 0's block
        tokens[0] = indices[int(indptr[1]) - 1]
    signal, norm = torch.randn(B, D, generator=g), torch.rand(B, generator=g) + 1
    state = [signal, signal * norm.unsqueeze(1), norm, torch.randn(B, generator=g)]
    mix = Mix(*(t.to(DEVICE) for t in state))
    length = torch.tensor([0, 3, 7, 12], device=DEVICE)  # 0: a first token; 12: past the 10 position weights
    positions = torch.randn(1, 10, 1, generator=g).to(DEVICE)
    pe_now, pe_next = (torch.randn(B, D, generator=g).to(DEVICE) for _ in range(2))
    bias = torch.randn(V, generator=g).to(DEVICE) if biased else None
    edge_base = (torch.randn(D, D, generator=g) * 0.5).to(DEVICE) if shared_matrix else None
    at = StepAt(last, pe_now, pe_next, positions.view(-1)[(length - 1).clamp(0, 9)])
    edges, graph = views(weights, biases, indptr, indices, V, bias, edge_base)
    assert graph.keys is None if dense else torch.equal(graph.keys, keys)
    out = {}
    for backend in ("torch", "triton"):
        with torch.no_grad(), kernel_backend(backend):
            out[backend] = ops.decode_step(tokens, mix, at, edges, graph, graph.max_degree)
    close(out["triton"][0], out["torch"][0], "logits")
    for a, b, name in zip(out["triton"][1].tensors(), out["torch"][1].tensors(), ("signal", "sum", "norm", "max")):
        close(a.float(), b.float(), name)
