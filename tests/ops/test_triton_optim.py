"""SparseAdamW's fused Triton row update (triton_optim.py) against its torch path, under Triton's interpreter.

The semantics are SparseAdamW's (lazy AdamW, duplicates summed, explicit zero rows touched); the kernel must give
the torch path's parameters and moments within 1e-6 relative over several steps (bias correction), with weight
decay, for sorted unique rows, unsorted rows with duplicates, 2-D and 3-D parameters and F.embedding's
uncoalesced gradient; and the step count read inside the kernel (the `fused=True` layout on a GPU).
"""

import pytest
import torch
import torch.nn.functional as F

from modeling_brillm.backend import HAVE_TRITON, kernel_backend
from modeling_brillm.optimization import SparseAdamW

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install .[gpu])")

TOL = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU: Triton's interpreter on CPU tensors


def assert_rel(actual, expected, name):
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= TOL * scale, f"{name}: max error {float(err):.3g} vs scale {float(scale):.3g}"


def sparse_grad(shape, rows, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(len(rows), *shape[1:], generator=g)
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, shape, check_invariants=True).to(DEVICE)


GRADIENTS = {
    "sorted unique": [[0, 1, 2, 5, 9], [3, 4, 5], [0, 9]],
    "unsorted with duplicates": [[5, 1, 5, 0, 9, 1, 1], [9, 9, 2], [7, 3, 7, 3]],
}


@pytest.mark.parametrize("kind", list(GRADIENTS))
@pytest.mark.parametrize("shape", [(10, 6), (10, 3, 4)])
def test_fused_rows_equal_the_torch_path(kind, shape):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=g).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        p = torch.nn.Parameter(start.clone())
        opt = SparseAdamW([p], lr=0.05, weight_decay=0.1, betas=(0.8, 0.95))
        with kernel_backend(backend):
            for step, rows in enumerate(GRADIENTS[kind]):
                p.grad = sparse_grad(shape, rows, seed=step)
                if step == 1:
                    p.grad = p.grad * 0  # explicit zero rows still count as touched (momentum moves them)
                opt.step()
        state = opt.state[p]
        results.append((p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
    (p0, m0, v0), (p1, m1, v1) = results
    for name, a, b in (("param", p1, p0), ("exp_avg", m1, m0), ("exp_avg_sq", v1, v0)):
        assert_rel(a, b, name)
    untouched = torch.ones(shape[0], dtype=torch.bool, device=DEVICE)
    untouched[sorted({r for rows in GRADIENTS[kind] for r in rows})] = False
    assert torch.equal(p1[untouched], start[untouched])  # rows never touched never move


def test_embedding_gradient_and_a_dense_parameter_in_one_group():
    """node_bias's gradient from F.embedding(sparse=True) is uncoalesced with repeated rows; a dense parameter in
    the same group keeps torch's AdamW."""
    g = torch.Generator().manual_seed(1)
    table, dense = torch.randn(12, 5, generator=g).to(DEVICE), torch.randn(4, generator=g).to(DEVICE)
    ids = torch.tensor([3, 7, 3, 3, 0, 11, 7], device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        emb, vec = torch.nn.Parameter(table.clone()), torch.nn.Parameter(dense.clone())
        opt = SparseAdamW([emb, vec], lr=0.1, weight_decay=0.01)
        with kernel_backend(backend):
            for step in range(3):
                out = F.embedding(ids[step:], emb, sparse=True)
                (out.sin().sum() * (step + 1) + (vec * out.sum()).sum()).backward()
                assert emb.grad.is_sparse and not emb.grad.is_coalesced()
                opt.step()
                opt.zero_grad(set_to_none=True)
        results.append((emb.detach().clone(), vec.detach().clone()))
    assert_rel(results[1][0], results[0][0], "embedding")
    assert_rel(results[1][1], results[0][1], "dense parameter")


def test_entries_and_the_step_read_inside_the_kernel():
    """The call `row_adamw.update_entries` makes (rows picked by an entry index) and the step count read by the kernel
    (where it lives on the device, as with fused=True)."""
    from modeling_brillm.triton_optim import sparse_adamw_rows

    g = torch.Generator().manual_seed(2)
    P, W = 8, 7
    start = [torch.randn(P, W, generator=g), torch.randn(P, W, generator=g), torch.rand(P, W, generator=g)]
    values = torch.randn(6, W, generator=g)
    rows, entries = torch.tensor([6, 1, 4]), torch.tensor([5, 0, 2])
    start = [t.to(DEVICE) for t in start]
    values, rows, entries = values.to(DEVICE), rows.to(DEVICE), entries.to(DEVICE)
    step = torch.tensor(3.0)
    hyper = (0.01, 0.9, 0.999, 1e-8, 0.05)
    # reference: AdamW's arithmetic on the picked rows
    p, m, v = (t[rows].clone() for t in start)
    grad = values[entries]
    lr, b1, b2, eps, wd = hyper
    p *= 1 - lr * wd
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    p -= lr / (1 - b1 ** 3) * m / (v.sqrt() / (1 - b2 ** 3) ** 0.5 + eps)
    for step_in_kernel in (False, True):
        got = [t.clone() for t in start]
        with kernel_backend("triton"):
            sparse_adamw_rows(*got, rows, values, step.to(DEVICE) if step_in_kernel else step, hyper, entries=entries,
                              unique=True, step_in_kernel=step_in_kernel)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, (p, m, v)):
            assert_rel(a[rows], b, f"{name} (step in kernel: {step_in_kernel})")
        others = torch.ones(P, dtype=torch.bool, device=DEVICE)
        others[rows] = False
        assert all(torch.equal(a[others], s[others]) for a, s in zip(got, start))


def test_a_model_trains_the_same_with_both_backends():
    """Two SparseAdamW steps of a tiny model (the recurrence scan too under triton): same parameters."""
    from modeling_brillm import BriLLMForCausalLM, graph_from_edges

    g = torch.Generator().manual_seed(3)
    V, d = 8, 4
    mask = torch.rand(V, V, generator=g) < 0.5
    src, tgt = mask.nonzero(as_tuple=True)
    ids = torch.randint(0, V, (3, 5), generator=g).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = BriLLMForCausalLM.from_graph(graph_from_edges(src, tgt, V), node_size=d).to(DEVICE)
        model.sparse_gradients = True
        opt = SparseAdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        with kernel_backend(backend):
            for _ in range(2):
                model(input_ids=ids, labels=ids, return_logits=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("lazy", [False, True])
def test_first_row_lr_scale_equals_the_torch_path(lazy):
    """`first_row_lr_scale` (row 0, BriLLM's shared edge, at its own learning rate) inside the kernel: the torch
    path's parameters and moments within 1e-6 over steps where row 0 is duplicated, absent and present; with lazy
    weight decay the pending decay stays the torch pre-pass and the rows then go through the kernel."""
    shape = (10, 3, 4)
    steps = [[0, 3, 0, 5], [2, 9], [9, 0, 1]]
    start = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    results = {}
    for backend, scale in (("torch", 0.3), ("triton", 0.3), ("triton", 1.0)):
        p = torch.nn.Parameter(start.clone())
        opt = SparseAdamW([p], lr=0.05, weight_decay=0.1, betas=(0.8, 0.95), lazy_weight_decay=lazy,
                          first_row_lr_scale=scale)
        with kernel_backend(backend):
            for step, rows in enumerate(steps):
                p.grad = sparse_grad(shape, rows, seed=step)
                opt.step()
            if lazy:
                opt.apply_pending_weight_decay()
        state = opt.state[p]
        results[backend, scale] = (p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), results["triton", 0.3], results["torch", 0.3]):
        assert_rel(a, b, name)
    scaled, plain = results["triton", 0.3][0], results["triton", 1.0][0]
    assert not torch.allclose(scaled[0], plain[0]) and torch.equal(scaled[1:], plain[1:])  # row 0 alone moved less


def test_first_row_lr_scale_adds_no_host_reads():
    """Without lazy decay the Triton path reads nothing back from the device for the first-row rate (the torch path
    coalesced the rows with torch.unique and asked `(rows == 0).any()`): the same operations as with scale 1."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    shape = (10, 6)
    seen = {}
    for scale in (1.0, 0.3):
        p = torch.nn.Parameter(torch.zeros(shape, device=DEVICE))
        opt = SparseAdamW([p], lr=0.05, first_row_lr_scale=scale)
        p.grad = sparse_grad(shape, [5, 0, 5, 2], seed=0)
        with kernel_backend("triton"), Record() as record:
            opt.step()
        seen[scale] = record.ops
    assert seen[0.3] == seen[1.0]
    assert not any("unique" in op or "nonzero" in op for op in seen[0.3])


@pytest.mark.parametrize("kind", list(GRADIENTS))
def test_bfloat16_moments_equal_the_torch_path(kind):
    """moment_dtype="bfloat16": the kernel draws the torch path's rounding bits, so the stored moments are the same
    bfloat16 values (bit for bit in the interpreter), with the step count read on the host or inside the kernel; the
    float32 parameters agree within 1e-6 (operation order)."""
    from modeling_brillm.triton_optim import sparse_adamw_rows

    shape = (10, 3, 4)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        p = torch.nn.Parameter(start.clone())
        opt = SparseAdamW([p], lr=0.05, weight_decay=0.1, betas=(0.8, 0.95), moment_dtype="bfloat16")
        with kernel_backend(backend):
            for step, rows in enumerate(GRADIENTS[kind]):
                p.grad = sparse_grad(shape, rows, seed=step)
                opt.step()
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        results.append((p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
    (p0, m0, v0), (p1, m1, v1) = results
    for a, b in ((m1, m0), (v1, v0)):  # the same bits; a compiled kernel's FMAs may move a value across a rounding
        same = (a == b).float().mean()  # boundary (odds 2^-16 an element): then one bfloat16 step apart
        assert same > 0.99 and torch.allclose(a.float(), b.float(), rtol=2**-7, atol=0), float(same)
    assert_rel(p1, p0, "param")

    # one more step straight through the kernel: the step count read inside it draws the same bits
    P2, M2, V2 = p1.view(10, -1), m1.view(10, -1), v1.view(10, -1)
    rows = torch.tensor(GRADIENTS[kind][0], device=DEVICE)
    values = torch.randn(rows.numel(), 12, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = []
    for step_in_kernel in (False, True):
        state = [P2.clone(), M2.clone(), V2.clone()]
        step = torch.tensor(4.0)
        with kernel_backend("triton"):
            sparse_adamw_rows(*state, rows, values, step.to(DEVICE) if step_in_kernel else step,
                              (0.05, 0.8, 0.95, 1e-8, 0.1), step_in_kernel=step_in_kernel)
        got.append(state)
    assert not torch.equal(got[0][1], M2)
    assert torch.equal(got[1][1], got[0][1]) and torch.equal(got[1][2], got[0][2])
    assert_rel(got[1][0], got[0][0], "param (step in kernel)")  # the bias correction is computed in float32 there


def test_bfloat16_moments_of_a_dense_gradient_take_the_kernel():
    """A dense gradient (BriLLM's positions) with bfloat16 moments: every row through the fused kernel, the same
    stored moments as the torch path."""
    start = torch.randn(7, 5, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grads = [torch.randn(7, 5, generator=torch.Generator().manual_seed(k)).to(DEVICE) for k in range(3)]
    results = []
    for backend in ("torch", "triton"):
        p = torch.nn.Parameter(start.clone())
        opt = SparseAdamW([p], lr=0.05, weight_decay=0.1, moment_dtype="bfloat16")
        with kernel_backend(backend):
            for g in grads:
                p.grad = g.clone()
                opt.step()
        results.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()))
    (p0, m0, v0), (p1, m1, v1) = results
    assert (m1 == m0).float().mean() > 0.99 and (v1 == v0).float().mean() > 0.99
    assert_rel(p1, p0, "param")
