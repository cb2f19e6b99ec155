"""candidate_energies / exact_log_partition / gather_edges against plain autograd on tiny random graphs.

Values and gradients (x, weights, biases), with dense and sparse gradients, sparse and dense graphs, sources
that repeat (groups of several positions) or not, sources without successors, and the gradient hand-over
between the recurrence's gather and the candidate energies (EdgeGradLink).
"""

import pytest
import torch
import torch.nn.functional as F

from modeling_brillm.energy import (
    EdgeGradLink,
    candidate_energies,
    exact_log_partition,
    gather_edges,
    scatter_logits,
    target_energies,
)
from modeling_brillm.graph import graph_from_edges
from modeling_brillm.plans import make_torch_plan as make_plan

D = 5


def random_graph(V, seed, empty_node=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(V, V, generator=g) < 0.4
    if empty_node:
        mask[V - 1] = False  # a node without real successors
    src, tgt = mask.nonzero(as_tuple=True)
    return graph_from_edges(src, tgt, V)


def setup(V=7, N=11, seed=0, dense=False, repeat=True, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if dense:
        indptr, indices = torch.arange(V + 1) * V, None
        E = V * V
    else:
        graph = random_graph(V, seed)
        indptr, indices = graph.indptr, graph.indices
        E = graph.num_edges
    P = E + 1
    weights = torch.randn(P, D, D, generator=g, dtype=dtype)
    biases = torch.randn(P, 1, D, generator=g, dtype=dtype)
    if repeat:
        sources = torch.randint(0, V, (N,), generator=g)
    else:
        sources = torch.randperm(V, generator=g)[: min(N, V)]
    x = torch.randn(sources.numel(), D, generator=g, dtype=dtype)
    pe = torch.randn(sources.numel(), D, generator=g, dtype=dtype)
    on = [None if t is None else t.to(device) for t in (weights, biases, indptr, indices, sources, x, pe)]
    return (*on, V)


def reference(x, pe, weights, biases, sources, indptr, indices, V):
    """Plain autograd, position by position and candidate by candidate: (N, V) logits."""
    indices = None if indices is None else indices.cpu()  # the row map is built on the CPU
    rows_all = []
    for u in sources.tolist():
        row = torch.zeros(V, dtype=torch.long)
        a, b = int(indptr[u]), int(indptr[u + 1])
        targets = torch.arange(V) if indices is None else indices[a:b]
        row[targets] = torch.arange(a, b) + 1
        rows_all.append(row)
    rows = torch.stack(rows_all)  # (N, V) edge row of every candidate, 0 = shared
    h = torch.einsum("nd,nvde->nve", x, weights[rows]) + biases[rows, 0] + pe[:, None]
    return torch.linalg.vector_norm(F.gelu(h), dim=-1)


def fast_logits(x, pe, weights, biases, sources, indptr, indices, V, sparse_grad, link=None, biases_2d=False):
    plan = make_plan(sources, indptr, indices, V)
    inv = torch.empty_like(plan.order)
    inv[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)
    b = biases.view(-1, D) if biases_2d else biases
    energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, b, plan, sparse_grad, link)
    return scatter_logits(energies, shared, plan, V)[inv], plan, energies, shared


def assert_unique_sorted(grad):
    # autograd's AccumulateGrad keeps our values but drops the coalesced flag; the rows must still be unique
    idx = grad._indices()[0]
    assert bool((idx[1:] > idx[:-1]).all())


def dense_grad(t):
    return None if t.grad is None else (t.grad.to_dense() if t.grad.is_sparse else t.grad)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("repeat", [False, True])
def test_candidate_energies_values_and_gradients(dense, sparse_grad, repeat, device):
    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, repeat=repeat, device=device)
    mine = [t.clone().requires_grad_() for t in (x, weights, biases)]
    ref = [t.clone().requires_grad_() for t in (x, weights, biases)]
    logits, *_ = fast_logits(mine[0], pe, mine[1], mine[2], sources, indptr, indices, V, sparse_grad)
    expected = reference(ref[0], pe, ref[1], ref[2], sources, indptr, indices, V)
    if dense:  # no shared edge: row 0 unused, every candidate is real
        torch.testing.assert_close(logits, expected)
    else:
        torch.testing.assert_close(logits, expected)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=logits.dtype).to(device)
    (logits * w).sum().backward()
    (expected * w).sum().backward()
    for a, b, name in zip(mine, ref, ("x", "weights", "biases")):
        if sparse_grad and name != "x":
            assert a.grad.is_sparse and a.grad.shape == b.shape
            assert_unique_sorted(a.grad)
        torch.testing.assert_close(dense_grad(a), b.grad, msg=name)


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_biases_as_2d_view_get_gradients_of_their_shape(sparse_grad, device):
    weights, biases, indptr, indices, sources, x, pe, V = setup(device=device)
    b2 = biases.view(-1, D).clone().requires_grad_()
    w = weights.clone().requires_grad_()
    logits, *_ = fast_logits(x, pe, w, b2, sources, indptr, indices, V, sparse_grad)
    logits.sum().backward()
    assert b2.grad.shape == b2.shape
    ref_b = biases.clone().requires_grad_()
    reference(x, pe, weights, ref_b, sources, indptr, indices, V).sum().backward()
    torch.testing.assert_close(dense_grad(b2), ref_b.grad.view(-1, D))


@pytest.mark.parametrize("dense", [False, True])
def test_exact_log_partition_and_target_energies(dense, device):
    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, N=13, seed=1, device=device)
    xs = x.clone().requires_grad_()
    plan = make_plan(sources, indptr, indices, V)
    energies, shared = candidate_energies(xs[plan.order], pe[plan.order], weights, biases, plan)
    logits = scatter_logits(energies, shared, plan, V)
    torch.testing.assert_close(exact_log_partition(energies, shared, plan, V), torch.logsumexp(logits, 1))
    src = sources[plan.order]
    targets = torch.randint(0, V, src.shape, generator=torch.Generator().manual_seed(5)).to(device)
    key = (src * V + targets)
    if indices is None:
        rows = 1 + key
    else:
        edge_src = torch.repeat_interleave(torch.arange(V, device=device), indptr.diff())
        keys = edge_src * V + indices
        pos = torch.searchsorted(keys, key).clamp_max(keys.numel() - 1)
        rows = torch.where(keys[pos] == key, pos + 1, torch.zeros_like(pos))
    picked = target_energies(energies, shared, plan, targets, rows, indptr[src] + 1)
    torch.testing.assert_close(picked, logits.gather(1, targets[:, None])[:, 0])
    # gradient of the exact loss through the partition equals the full softmax's
    loss = (exact_log_partition(energies, shared, plan, V) - picked).sum()
    g1, = torch.autograd.grad(loss, xs, retain_graph=True)
    loss2 = F.cross_entropy(logits, targets, reduction="sum")
    g2, = torch.autograd.grad(loss2, xs)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("outside", [False, True])
def test_gather_link_merges_recurrence_gradients(sparse_grad, outside, device):
    """A recurrence-like gather plus candidate energies on one link: the same gradients as plain autograd, and
    one (coalesced) gradient tensor per parameter."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(N=9, seed=2, device=device)
    g = torch.Generator().manual_seed(7)
    # rows the "recurrence" reads: real edges of the candidate sources, row 0, and maybe rows outside
    cand = torch.cat([torch.arange(int(indptr[u]), int(indptr[u + 1])) + 1 for u in sources.tolist()])
    rows = cand[torch.randint(0, cand.numel(), (3, 4), generator=g)]
    rows[0, 0] = 0
    rows[1, 1] = rows[1, 2]  # a duplicate
    if outside:
        others = torch.tensor(sorted(set(range(weights.shape[0])) - set(cand.tolist()) - {0}))
        rows[2, :2] = others[:2]
    signal = torch.randn(3, 4, D, generator=g, dtype=x.dtype).to(device)
    rows = rows.to(device)

    def run(w, b, fast):
        if fast:
            link = EdgeGradLink()
            ws, bs = gather_edges(w, b, rows, sparse_grad, link)
        else:
            link = None
            ws, bs = w[rows], b[rows, 0]
        out = F.gelu(torch.einsum("bld,blde->ble", signal, ws) + bs)
        xx = x + out.sum((0, 1)) * 0.1  # the candidates' signals depend on the gathered rows
        if fast:
            logits, *_ = fast_logits(xx, pe, w, b, sources, indptr, indices, V, sparse_grad, link)
        else:
            logits = reference(xx, pe, w, b, sources, indptr, indices, V)
        wts = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11), dtype=x.dtype).to(device)
        return (logits * wts).sum() + (out ** 2).sum()

    mine = [t.clone().requires_grad_() for t in (weights, biases)]
    ref = [t.clone().requires_grad_() for t in (weights, biases)]
    run(*mine, True).backward()
    run(*ref, False).backward()
    for a, b, name in zip(mine, ref, ("weights", "biases")):
        if sparse_grad:
            assert a.grad.is_sparse
            # everything was handed over: one gradient without duplicate rows
            assert_unique_sorted(a.grad)
        torch.testing.assert_close(dense_grad(a), b.grad, msg=name)


def test_gather_without_link_and_without_candidates(device):
    weights, biases, *_ = setup(device=device)
    rows = torch.tensor([[1, 3, 3], [0, 2, 1]], device=device)
    for sparse_grad in (False, True):
        w, b = weights.clone().requires_grad_(), biases.clone().requires_grad_()
        ws, bs = gather_edges(w, b, rows, sparse_grad, EdgeGradLink())  # a link nobody publishes to
        (ws.sum() + (bs ** 2).sum()).backward()
        w2, b2 = weights.clone().requires_grad_(), biases.clone().requires_grad_()
        (w2[rows].sum() + (b2[rows, 0] ** 2).sum()).backward()
        torch.testing.assert_close(dense_grad(w), w2.grad)
        torch.testing.assert_close(dense_grad(b), b2.grad)


def test_float32_matches_float64_and_repeated_calls_reuse_buffers(cache_everything, device):
    weights, biases, indptr, indices, sources, x, pe, V = setup(V=9, N=40, seed=4, device=device)
    grads = []
    for _ in range(3):  # buffer reuse across steps must not change results
        w = weights.float().requires_grad_()
        logits, *_ = fast_logits(x.float(), pe.float(), w, biases.float(), sources, indptr, indices, V, True)
        logits.sum().backward()
        grads.append(w.grad.to_dense())
        del w, logits
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0])
    w64 = weights.clone().requires_grad_()
    fast_logits(x, pe, w64, biases, sources, indptr, indices, V, True)[0].sum().backward()
    torch.testing.assert_close(grads[0], w64.grad.to_dense().float(), atol=1e-4, rtol=1e-4)


def test_large_groups_and_empty_input(device):
    weights, biases, indptr, indices, _, _, _, V = setup(V=6, seed=6, device=device)
    sources = torch.tensor([2] * 20 + [0] * 3 + [5], device=device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sources.numel(), D, generator=g, dtype=torch.float64).to(device)
    pe = torch.randn(sources.numel(), D, generator=g, dtype=torch.float64).to(device)
    xs = x.clone().requires_grad_()
    logits, *_ = fast_logits(xs, pe, weights, biases, sources, indptr, indices, V, True)
    xr = x.clone().requires_grad_()
    expected = reference(xr, pe, weights, biases, sources, indptr, indices, V)
    torch.testing.assert_close(logits, expected)
    logits.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    plan = make_plan(empty, indptr, indices, V)
    e, s = candidate_energies(x[:0], pe[:0], weights, biases, plan)
    assert e.numel() == 0 and s.numel() == 0


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("n", [1, 6])
def test_successor_logits_equals_the_grouped_path(dense, n, device):
    from modeling_brillm.energy import successor_logits
    from modeling_brillm.graph import edge_keys
    from modeling_brillm.tables import EdgeTable, GraphView

    weights, biases, indptr, indices, sources, x, pe, V = setup(dense=dense, N=n, seed=8, device=device)
    graph = GraphView(indptr, indices, None if dense else edge_keys(indptr, indices, V), V)
    edges = EdgeTable(weights, biases)
    expected = reference(x, pe, weights, biases, sources, indptr, indices, V)
    for width in (None, graph.max_degree):  # each row's own degree, read from the host; the fixed shape
        torch.testing.assert_close(successor_logits(x, pe, edges, sources, graph, width), expected)
    if not dense:  # a source without real successors: every node gets the shared energy
        empty = torch.tensor([V - 1], device=device)
        got = successor_logits(x[:1], pe[:1], edges, empty, graph, None)
        torch.testing.assert_close(got, reference(x[:1], pe[:1], weights, biases, empty, indptr, indices, V))


@pytest.fixture
def cache_everything(monkeypatch):
    """Make every buffer a cached, reusable workspace (normally only those of 1 MB and more)."""
    from modeling_brillm import energy

    monkeypatch.setattr(energy, "_CACHE_MIN_BYTES", 0)
    energy.release_workspaces()
    yield
    energy.release_workspaces()


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_gradient_accumulation_and_two_graphs_in_flight(sparse_grad, cache_everything, device):
    """Reused buffers must never be shared by two live gradients or two un-backwarded graphs."""
    weights, biases, indptr, indices, sources, x, pe, V = setup(V=9, N=30, seed=10, dtype=torch.float32, device=device)
    w = weights.clone().requires_grad_()
    b = biases.clone().requires_grad_()
    ref_w, ref_b = weights.clone().requires_grad_(), biases.clone().requires_grad_()
    g = torch.Generator().manual_seed(1)
    halves = [sources[:15], sources[15:]]
    xs = [x[:15], x[15:]]
    pes = [pe[:15], pe[15:]]
    wts = [torch.randn(15, V, generator=g).to(device) for _ in range(2)]
    # two forwards, then two backwards, without zero_grad in between
    outs = [fast_logits(xx, pp, w, b, ss, indptr, indices, V, sparse_grad)[0] for xx, pp, ss in zip(xs, pes, halves)]
    for out, wt in zip(outs, wts):
        (out * wt).sum().backward()
    for xx, pp, ss, wt in zip(xs, pes, halves, wts):
        (reference(xx, pp, ref_w, ref_b, ss, indptr, indices, V) * wt).sum().backward()
    torch.testing.assert_close(dense_grad(w), ref_w.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dense_grad(b), ref_b.grad, atol=1e-5, rtol=1e-4)


def test_edge_rows_from_keys_is_the_row_of_every_pair():
    """graph.edge_rows_from_keys: the j-th real edge (CSR order) has row j + 1, every other pair row 0; dense: every
    pair real, row 1 + s·V + t; an edgeless graph maps everything to the shared row."""
    from modeling_brillm.graph import edge_keys, edge_rows_from_keys

    V = 5
    graph = graph_from_edges(torch.tensor([3, 0, 0, 2]), torch.tensor([1, 4, 2, 2]), V)
    keys = edge_keys(graph.indptr, graph.indices, V)
    src, tgt = torch.arange(V).repeat_interleave(V), torch.arange(V).repeat(V)
    rows = edge_rows_from_keys(keys, src, tgt, V).view(V, V)
    expected = torch.zeros(V, V, dtype=torch.long)
    for j, (s, t) in enumerate([(0, 2), (0, 4), (2, 2), (3, 1)]):
        expected[s, t] = j + 1
    assert torch.equal(rows, expected)
    assert torch.equal(edge_rows_from_keys(None, src, tgt, V), 1 + src * V + tgt)
    assert torch.equal(edge_rows_from_keys(keys[:0], src, tgt, V), torch.zeros_like(src))
