"""SparseAdamW: AdamW for dense gradients, lazy AdamW for sparse COO row gradients."""

import copy

import pytest
import torch

from modeling_brillm.optimization import SparseAdamW

HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def sparse_rows(rows, values, shape):
    rows = torch.as_tensor(rows, dtype=torch.long)
    return torch.sparse_coo_tensor(rows[None], values, shape, check_invariants=True)


def test_dense_gradients_equal_adamw_exactly():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(7, 3, 3)), torch.nn.Parameter(torch.randn(5))]
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    opt_a, opt_b = SparseAdamW(a, **HYPER), torch.optim.AdamW(b, **HYPER)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])


@pytest.mark.parametrize("sparse", [False, True])
def test_float64_parameters_keep_float64_moments_and_follow_adamw(sparse):
    """As torch.optim.AdamW: a float64 parameter's moments are float64 (float32 ones made the step crash), also after
    a reload. The same rows every step and no decay: lazy AdamW is AdamW."""
    torch.manual_seed(3)
    rows, shape, hyper = [1, 4, 5], (6, 2, 2), {**HYPER, "weight_decay": 0.0}
    p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = SparseAdamW([p], **hyper), torch.optim.AdamW([q], **hyper)
    for _ in range(3):
        values = torch.randn(len(rows), 2, 2, dtype=torch.float64)
        dense = torch.zeros(shape, dtype=torch.float64)
        dense[rows] = values
        p.grad, q.grad = sparse_rows(rows, values, shape) if sparse else dense.clone(), dense
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q)
    reloaded = SparseAdamW([p], **hyper)
    reloaded.load_state_dict(opt.state_dict())
    for state in (opt.state[p], reloaded.state[p]):
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_parameters_step_in_float32_from_float32_moments(dtype):
    """A model loaded in bfloat16 or float16 trains with float32 moments (the default; the step crashed): each step
    is the float32 step from the stored values, rounded once into the parameter's dtype."""
    torch.manual_seed(3)
    rows, shape = [1, 4, 5], (6, 2, 2)
    p = torch.nn.Parameter(torch.randn(shape).to(dtype))
    q = torch.nn.Parameter(p.detach().float())
    opt, ref = SparseAdamW([p], **HYPER), SparseAdamW([q], **HYPER)
    values = torch.randn(len(rows), 2, 2).to(dtype)
    p.grad, q.grad = sparse_rows(rows, values, shape), sparse_rows(rows, values.float(), shape)
    opt.step()
    ref.step()
    assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach(), q.detach().to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 25, 30], [3, 17, 4, 29]])
def test_first_sparse_step_equals_adamw_on_touched_rows(rows):
    torch.manual_seed(1)
    shape = (32, 4, 4)
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(p.detach().clone())
    values = torch.randn(len(rows), 4, 4)
    p.grad = sparse_rows(rows, values, shape)
    dense = torch.zeros(shape)
    dense[rows] = values
    q.grad = dense
    before = p.detach().clone()
    SparseAdamW([p], **HYPER).step()
    torch.optim.AdamW([q], **HYPER).step()
    touched = torch.zeros(32, dtype=torch.bool)
    touched[rows] = True
    torch.testing.assert_close(p[touched], q[touched])
    # untouched rows: AdamW applies weight decay to them, SparseAdamW leaves them alone
    assert torch.equal(p.detach()[~touched], before[~touched])
    assert not torch.equal(q.detach()[~touched], before[~touched])


def lazy_reference(param, exp_avg, exp_avg_sq, step, rows, grad_rows, lr, betas, eps, weight_decay):
    """The documented lazy semantics, row by row."""
    b1, b2 = betas
    for r, g in zip(rows, grad_rows):
        param[r] *= 1 - lr * weight_decay
        exp_avg[r] = b1 * exp_avg[r] + (1 - b1) * g
        exp_avg_sq[r] = b2 * exp_avg_sq[r] + (1 - b2) * g * g
        denom = (exp_avg_sq[r] / (1 - b2 ** step)).sqrt() + eps
        param[r] -= lr * exp_avg[r] / (1 - b1 ** step) / denom


def test_later_sparse_steps_follow_the_lazy_semantics():
    torch.manual_seed(2)
    shape = (40, 3)
    p = torch.nn.Parameter(torch.randn(shape))
    ref = p.detach().clone().double()
    m, v = torch.zeros(shape, dtype=torch.double), torch.zeros(shape, dtype=torch.double)
    opt = SparseAdamW([p], **HYPER)
    for step in range(1, 7):
        # contiguous runs (view path) and scattered rows (gather path); row sets change between steps
        rows = sorted(set(torch.randint(0, 40, (6,)).tolist()) | set(range(10 + step, 22 + step)))
        g = torch.randn(len(rows), 3)
        p.grad = sparse_rows(rows, g, shape)
        untouched = p.detach().clone()
        opt.step()
        lazy_reference(ref, m, v, step, rows, g.double(), HYPER["lr"], HYPER["betas"], HYPER["eps"],
                       HYPER["weight_decay"])
        torch.testing.assert_close(p.detach(), ref.float(), atol=1e-5, rtol=1e-5)
        others = torch.ones(40, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(p.detach()[others], untouched[others])
    assert float(opt.state[p]["step"]) == 6


@pytest.mark.parametrize("order", ["sorted_blocks", "shuffled"])
def test_uncoalesced_duplicates_are_merged(order):
    torch.manual_seed(3)
    shape = (300, 2, 2)
    # a block of contiguous rows (like the candidate gradient) plus scattered repeats (like the recurrence's)
    block = torch.arange(50, 250)
    extra = torch.tensor([60, 60, 61, 249, 7, 7, 299])
    rows = torch.cat([block, extra])
    values = torch.randn(rows.numel(), 2, 2)
    if order == "shuffled":
        perm = torch.randperm(rows.numel())
        rows, values = rows[perm], values[perm]
    grad = torch.sparse_coo_tensor(rows[None], values, shape, check_invariants=True)
    assert not grad.is_coalesced()
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = grad
    q.grad = grad.coalesce()
    opt_p, opt_q = SparseAdamW([p], **HYPER), SparseAdamW([q], **HYPER)
    for _ in range(2):
        opt_p.step()
        opt_q.step()
    torch.testing.assert_close(p, q)
    torch.testing.assert_close(opt_p.state[p]["exp_avg"], opt_q.state[q]["exp_avg"])
    torch.testing.assert_close(opt_p.state[p]["exp_avg_sq"], opt_q.state[q]["exp_avg_sq"])
    # and the merged step is AdamW's first step on the summed rows
    r = torch.nn.Parameter(torch.randn(shape))
    s = torch.nn.Parameter(r.detach().clone())
    r.grad = grad
    s.grad = grad.to_dense()
    SparseAdamW([r], **HYPER).step()
    torch.optim.AdamW([s], **HYPER).step()
    touched = torch.unique(rows)
    torch.testing.assert_close(r[touched], s[touched])


def test_mixed_sparse_and_dense_parameters_and_groups():
    torch.manual_seed(4)
    table = torch.nn.Parameter(torch.randn(20, 4))
    bias = torch.nn.Parameter(torch.randn(4))
    opt = SparseAdamW([{"params": [table]}, {"params": [bias], "lr": 0.01, "weight_decay": 0.0}], **HYPER)
    emb = torch.nn.functional.embedding(torch.tensor([1, 5, 5, 9]), table, sparse=True)
    (emb * bias).sum().backward()
    assert table.grad.is_sparse and not bias.grad.is_sparse
    bias_ref = torch.nn.Parameter(bias.detach().clone())
    bias_ref.grad = bias.grad.clone()
    opt.step()
    torch.optim.AdamW([bias_ref], lr=0.01, betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=0.0).step()
    assert torch.equal(bias, bias_ref)


def test_state_dict_round_trip_resumes_identically():
    torch.manual_seed(5)
    shape = (64, 3, 3)

    def grads(k):
        g = torch.Generator().manual_seed(100 + k)
        rows = torch.unique(torch.randint(0, 64, (20,), generator=g))
        return sparse_rows(rows, torch.randn(rows.numel(), 3, 3, generator=g), shape), torch.randn(5, generator=g)

    w = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(torch.randn(5))
    opt = SparseAdamW([w, b], **HYPER)
    for k in range(3):
        w.grad, b.grad = grads(k)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = SparseAdamW([w2, b2], lr=1.0)  # hyper-parameters come back from the state dict
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    for k in range(3, 6):
        for params, o in (((w, b), opt), ((w2, b2), opt2)):
            params[0].grad, params[1].grad = grads(k)
            o.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[w][key], opt2.state[w2][key])


def test_lr_scheduler_and_zero_grad_work():
    p = torch.nn.Parameter(torch.randn(10, 2))
    opt = SparseAdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    p.grad = sparse_rows([2, 3], torch.ones(2, 2), (10, 2))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.zero_grad()
    assert p.grad is None


def test_model_sparse_training_step_matches_dense_adamw_on_first_step():
    """A BriLLM step with sparse gradients + SparseAdamW equals dense gradients + AdamW on the touched rows."""
    from modeling_brillm import BriLLMForCausalLM

    torch.manual_seed(6)
    seqs = [torch.randint(0, 9, (8,)) for _ in range(5)]
    a = BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=9, node_size=4)
    b = copy.deepcopy(a)
    a.sparse_gradients = True
    ids = torch.stack(seqs)
    a(ids, labels=ids, return_logits=False).loss.backward()
    b(ids, labels=ids, return_logits=False).loss.backward()
    touched = a.base_model.weights.grad.coalesce()._indices()[0]
    SparseAdamW(a.parameters(), **HYPER).step()
    torch.optim.AdamW(b.parameters(), **HYPER).step()
    torch.testing.assert_close(a.base_model.weights[touched], b.base_model.weights[touched])
    torch.testing.assert_close(a.base_model.biases[touched], b.base_model.biases[touched])
    torch.testing.assert_close(a.base_model.positions, b.base_model.positions)


def test_portable_fallback_matches_fused_kernel(monkeypatch):
    torch.manual_seed(7)
    shape = (50, 6)
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = SparseAdamW([p], **HYPER), SparseAdamW([q], **HYPER)
    rows = list(range(5, 30)) + [33, 41]
    for _ in range(3):
        g = torch.randn(len(rows), 6)
        p.grad = sparse_rows(rows, g, shape)
        q.grad = sparse_rows(rows, g.clone(), shape)
        opt_p.step()
        with monkeypatch.context() as mp:
            def broken(*args, **kwargs):
                raise RuntimeError("no fused kernel")
            mp.setattr(torch, "_fused_adamw_", broken)
            opt_q.step()
    torch.testing.assert_close(p, q)


def test_accelerate_prepare_step_and_checkpoint_resume(tmp_path):
    """Through accelerate (CPU): prepare, step, save_state, load_state into fresh objects, identical next steps."""
    accelerate = pytest.importorskip("accelerate")
    from modeling_brillm import BriLLMForCausalLM

    torch.manual_seed(8)
    seqs = [torch.randint(0, 9, (8,)) for _ in range(4)]
    ids = torch.stack(seqs)

    def build():
        model = BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=9, node_size=4)
        model.sparse_gradients = True
        return model

    def train_step(acc, model, opt):
        loss = model(ids, labels=ids, return_logits=False).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    acc = accelerate.Accelerator(cpu=True)
    model = build()
    opt = SparseAdamW(model.parameters(), **HYPER)
    model, opt = acc.prepare(model, opt)
    train_step(acc, model, opt)
    acc.save_state(str(tmp_path / "ckpt"))
    train_step(acc, model, opt)

    acc2 = accelerate.Accelerator(cpu=True)
    model2 = build()
    opt2 = SparseAdamW(model2.parameters(), lr=1.0)
    model2, opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(str(tmp_path / "ckpt"))
    train_step(acc2, model2, opt2)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_dense_fused_option_equals_adamw_fused():
    torch.manual_seed(9)
    a = torch.nn.Parameter(torch.randn(6, 4))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = SparseAdamW([a], fused=True, **HYPER), torch.optim.AdamW([b], fused=True, **HYPER)
    for _ in range(3):
        g = torch.randn(6, 4)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------- bfloat16 moments
def test_stochastic_rounding_is_unbiased_and_keeps_representable_values():
    from modeling_brillm.row_adamw import rounding_bits, stochastic_round_bf16

    rows, columns = torch.arange(400), torch.arange(250)
    for value in (1.0 + 2**-10, -3.3e-5, 7.1e3):
        x = torch.full((400, 250), value)
        got = stochastic_round_bf16(x, rounding_bits(rows, columns, step=3, moment=1))
        neighbours = set(got.float().unique().tolist())
        assert len(neighbours) == 2 and value not in neighbours
        spread = max(neighbours) - min(neighbours)
        assert abs(got.float().double().mean().item() - value) < 0.01 * spread, value
    exact = torch.randn(400, 250).bfloat16().float()  # already bfloat16: never moved
    assert torch.equal(stochastic_round_bf16(exact, rounding_bits(rows, columns, 1, 0)).float(), exact)
    # other steps and the other moment draw other bits, uniform over [0, 65536)
    bits = rounding_bits(rows, columns, 3, 0)
    assert (bits != rounding_bits(rows, columns, 3, 1)).float().mean() > 0.99
    assert (bits != rounding_bits(rows, columns, 4, 0)).float().mean() > 0.99
    assert bits.min() >= 0 and bits.max() < 65536 and abs(bits.double().mean().item() / 32768 - 1) < 0.01


def test_bfloat16_moments_keep_decaying_where_nearest_rounding_freezes():
    """v ← 0.999·v moves v by 0.1%, below bfloat16's 0.4% resolution: round-to-nearest would keep v = 1 forever."""
    n, steps = 4000, 200
    p = torch.nn.Parameter(torch.zeros(n, 1))
    opt = SparseAdamW([p], lr=1e-3, moment_dtype="bfloat16")
    opt.state[p]["step"] = torch.zeros((), dtype=torch.float32)
    opt.state[p]["exp_avg"] = torch.zeros(n, 1, dtype=torch.bfloat16)
    opt.state[p]["exp_avg_sq"] = torch.ones(n, 1, dtype=torch.bfloat16)
    for _ in range(steps):
        p.grad = sparse_rows(torch.arange(n), torch.zeros(n, 1), (n, 1))
        opt.step()
    v = opt.state[p]["exp_avg_sq"].float()
    assert abs(v.mean().item() / 0.999**steps - 1) < 0.01
    assert torch.tensor(0.999).bfloat16() == 1.0  # what round-to-nearest would store, every step


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_bfloat16_moments_follow_float32_adamw(sparse):
    shape = (40, 3, 3)
    results = {}
    for dtype in ("float32", "bfloat16"):
        w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
        start = w.detach().clone()
        opt = SparseAdamW([w], **HYPER, moment_dtype=dtype)
        for k in range(6):
            g = torch.Generator().manual_seed(10 + k)
            rows = torch.unique(torch.randint(0, 40, (25,), generator=g))
            values = torch.randn(rows.numel(), 3, 3, generator=g)
            w.grad = sparse_rows(rows, values, shape) if sparse else torch.randn(shape, generator=g)
            opt.step()
        assert opt.state[w]["exp_avg"].dtype == opt.state[w]["exp_avg_sq"].dtype == getattr(torch, dtype)
        results[dtype] = w.detach() - start
    moved = results["float32"]
    assert moved.abs().max() > 0.05
    assert (results["bfloat16"] - moved).abs().max() < 0.02 * moved.abs().max()


def test_bfloat16_moments_resume_exactly_and_bad_options_are_refused():
    shape = (30, 4)

    def grad(k):
        g = torch.Generator().manual_seed(k)
        rows = torch.unique(torch.randint(0, 30, (12,), generator=g))
        return sparse_rows(rows, torch.randn(rows.numel(), 4, generator=g), shape), torch.randn(4, generator=g)

    w, b = torch.nn.Parameter(torch.randn(shape)), torch.nn.Parameter(torch.randn(4))
    opt = SparseAdamW([w, b], **HYPER, moment_dtype="bfloat16")
    for k in range(3):
        w.grad, b.grad = grad(k)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    opt2 = SparseAdamW([w2, b2], lr=1.0, moment_dtype="bfloat16")
    opt2.load_state_dict(saved)  # Optimizer.load_state_dict casts the moments to float32: they come back bfloat16
    assert opt2.state[w2]["exp_avg"].dtype == torch.bfloat16
    for k in range(3, 6):
        for (pw, pb), o in (((w, b), opt), ((w2, b2), opt2)):
            pw.grad, pb.grad = grad(k)
            o.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[w][key], opt2.state[w2][key])
        assert torch.equal(opt.state[b][key], opt2.state[b2][key])
    with pytest.raises(ValueError, match="moment_dtype"):
        SparseAdamW([torch.nn.Parameter(torch.zeros(2))], moment_dtype="float16")
    with pytest.raises(ValueError, match="float32 parameters"):
        SparseAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], moment_dtype="bfloat16")
