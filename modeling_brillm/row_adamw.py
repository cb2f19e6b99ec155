"""SparseAdamW's update of listed rows in torch, the reference of the fused Triton pass (triton_optim.py); the
semantics are optimization.py's. Contiguous runs of rows go through torch's fused AdamW over views (no copies),
scattered rows are gathered, updated and written back in bounded chunks."""

import torch

_MIN_RUN = 8  # contiguous rows below this are updated through the gather path
_GATHER_CHUNK_ELEMS = 1 << 22  # elements per chunk of the gather path (16 MB of float32 per tensor)


def _rows_adamw(params, grads, exp_avgs, exp_avg_sqs, step, hyper):
    """AdamW in place on row ranges sharing one step: torch's fused kernel, or where it cannot run its arithmetic."""
    lr, beta1, beta2, eps, weight_decay = hyper
    step = step.to(params[0].device)  # the fused kernel wants the step where the parameters are
    try:
        return torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), lr=lr,
                                   beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                                   maximize=False)
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):
        pass
    t = float(step)
    bc1, bc2_sqrt = 1 - beta1 ** t, (1 - beta2 ** t) ** 0.5
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors of uint32 values (low 32 bits kept, as the kernel's uint32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def rounding_bits(rows: torch.Tensor, columns: torch.Tensor, step: int, moment: int) -> torch.Tensor:
    """(len(rows), len(columns)) random 16-bit values (int32) at `step` for moment 0 (exp_avg) or 1 (exp_avg_sq): a
    hash of the row xor a hash of the column, the function of `triton_optim._round_bf16`."""
    key = int(_fmix32(torch.tensor((step * 0x9E3779B1) ^ (moment * 0x7F4A7C15)) & 0xFFFFFFFF))
    row_bits = _fmix32((rows & 0xFFFFFFFF) ^ _fmix32(((rows >> 32) + key) & 0xFFFFFFFF))
    column_bits = _fmix32((columns.to(torch.int64) + (key ^ 0x5BD1E995)) & 0xFFFFFFFF)
    return ((row_bits >> 16).to(torch.int32).unsqueeze(1) ^ (column_bits >> 16).to(torch.int32).unsqueeze(0))


def stochastic_round_bf16(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 rounding up with probability (the dropped 16 bits)/2^16: unbiased. `bits` in [0, 65536)."""
    raw = values.contiguous().view(torch.int32)
    return ((raw + bits.to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


def update_entries(P2, M2, V2, rows, values, positions, step, hyper):
    """Update rows[e] with values[e] for the entries e in `positions` (ascending; None = all), rows unique."""
    r, e = (rows, None) if positions is None else (rows[positions], positions)
    n = r.numel()
    if n == 0:
        return
    if M2.dtype != P2.dtype:  # bfloat16 moments, or a half-precision parameter's float32 ones
        _update_rows_rounded(P2, M2, V2, r, values if e is None else values[e], step, hyper)
        return
    # runs: consecutive entries that are also consecutive rows → views of p, m, v and of the values
    breaks = r[1:] != r[:-1] + 1
    if e is not None:
        breaks |= e[1:] != e[:-1] + 1
    run_starts = torch.cat([r.new_zeros(1), breaks.nonzero().squeeze(1) + 1])
    run_lengths = torch.diff(run_starts, append=r.new_tensor([n]))
    long_runs = run_lengths >= _MIN_RUN
    if bool(long_runs.any()):
        starts = run_starts[long_runs]
        runs = zip(r[starts].tolist(), (starts if e is None else e[starts]).tolist(), run_lengths[long_runs].tolist())
        ps, gs, ms, vs = zip(*[(P2[a:a + k], values[b:b + k], M2[a:a + k], V2[a:a + k]) for a, b, k in runs])
        _rows_adamw(list(ps), list(gs), list(ms), list(vs), step, hyper)
    if bool(long_runs.all()):
        return
    sel = torch.repeat_interleave(~long_runs, run_lengths, output_size=n).nonzero().squeeze(1)
    rows_s, ent_s = r[sel], sel if e is None else e[sel]
    chunk = max(1, _GATHER_CHUNK_ELEMS // max(P2.shape[1], 1))
    for c in range(0, rows_s.numel(), chunk):  # short runs: gather, update, scatter back
        rr, ee = rows_s[c:c + chunk], ent_s[c:c + chunk]
        gathered = [t.index_select(0, rr) for t in (P2, M2, V2)]
        _rows_adamw(gathered[:1], [values.index_select(0, ee)], gathered[1:2], gathered[2:], step, hyper)
        for t, g in zip((P2, M2, V2), gathered):
            t.index_copy_(0, rr, g)


def _update_rows_rounded(P2, M2, V2, rows, grads, step, hyper):
    """AdamW on `rows` (unique) in float32 from moments of another dtype than the parameter, written back in each
    one's dtype (bfloat16 moments stochastically rounded): the kernel's arithmetic."""
    lr, beta1, beta2, eps, wd = hyper
    t = float(step)
    step_size, bc2_sqrt = lr / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5
    width = P2.shape[1]
    columns = torch.arange(width, device=P2.device)
    chunk = max(1, (1 << 18) // max(width, 1))  # 1 MB a temporary: the dozen passes stay in cache
    for c in range(0, rows.numel(), chunk):
        rr = rows[c:c + chunk]
        g = grads[c:c + chunk].float()
        p = P2.index_select(0, rr).float() * (1 - lr * wd)
        m = M2.index_select(0, rr).float() * beta1 + g * (1 - beta1)
        v = V2.index_select(0, rr).float() * beta2 + g * g * (1 - beta2)
        p = p - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        P2.index_copy_(0, rr, p.to(P2.dtype))
        if M2.dtype == torch.bfloat16:
            m, v = (stochastic_round_bf16(x, rounding_bits(rr, columns, int(t), k)) for k, x in enumerate((m, v)))
        M2.index_copy_(0, rr, m.to(M2.dtype))
        V2.index_copy_(0, rr, v.to(V2.dtype))


def coalesce_rows(rows: torch.Tensor, values: torch.Tensor):
    """(rows, values) with duplicate rows summed and rows sorted; unchanged (no copy) when already increasing."""
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        uniq, inverse = torch.unique(rows, return_inverse=True)
        rows, values = uniq, values.new_zeros(uniq.numel(), values.shape[1]).index_add_(0, inverse, values)
    return rows, values


def adamw_rows(P2, M2, V2, rows, values, step, hyper, unique: bool = False, first_row_scale: float = 1.0):
    """Lazy AdamW on `rows` of the (n_rows, W) views `P2`, `M2`, `V2`, in place; `values[e]` is entry e's gradient
    row (duplicates summed unless `unique`), `hyper` = (lr, beta1, beta2, eps, weight_decay)."""
    if rows.numel() == 0:
        return
    if first_row_scale != 1.0:
        if not unique:  # the split below needs unique rows
            rows, values = coalesce_rows(rows, values)
        if bool((rows == 0).any()):
            scaled = (hyper[0] * first_row_scale, *hyper[1:4], hyper[4] / first_row_scale)
            update_entries(P2, M2, V2, rows, values, (rows == 0).nonzero().squeeze(1), step, scaled)
            update_entries(P2, M2, V2, rows, values, (rows != 0).nonzero().squeeze(1), step, hyper)
            return
        unique = True
    if not unique and rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        _update_duplicated(P2, M2, V2, rows, values, step, hyper)
        return
    update_entries(P2, M2, V2, rows, values, None, step, hyper)


def _update_duplicated(P2, M2, V2, rows, values, step, hyper):
    """Unsorted or duplicated rows: only the duplicated entries are summed (into a buffer), the others read in place."""
    uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
    dup_entry = counts[inverse] > 1
    if not bool(dup_entry.any()):
        update_entries(P2, M2, V2, rows, values, None, step, hyper)
        return
    dup_rows, dup_pos = uniq[counts > 1], dup_entry.nonzero().squeeze(1)
    slot = torch.searchsorted(dup_rows, rows[dup_pos])
    merged = values.new_zeros(dup_rows.numel(), values.shape[1]).index_add_(0, slot, values[dup_pos])
    update_entries(P2, M2, V2, rows, values, (~dup_entry).nonzero().squeeze(1), step, hyper)
    update_entries(P2, M2, V2, dup_rows, merged, None, step, hyper)
