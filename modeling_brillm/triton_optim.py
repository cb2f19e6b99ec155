"""SparseAdamW's update of the touched rows as one fused Triton pass (chosen by optimization.adamw_rows), with
optimization.py's semantics: a program updates a tile of rows × columns, reading p, m, v and the gradient values
once and writing p, m, v once; the first entry of each run of equal rows (sorted on the device) sums the run's
values inside the kernel, and nothing is read back to the host (docs/gpu.md)."""

import math

import torch

from .backend import launch, triton_modules

triton, tl = triton_modules()

_TILE = 2048  # floats per program (rows × columns)


if triton is not None:

    @triton.jit
    def _fmix32(x):
        """MurmurHash3's 32-bit finaliser (uint32 in, uint32 out; products wrap)."""
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        return x

    @triton.jit
    def _round_bf16(values, row, column, t, MOMENT: tl.constexpr):
        """float32 → bfloat16, stochastically: row_adamw.rounding_bits and stochastic_round_bf16, the same
        function (a hash of the row, (BLOCK_R, 1) int64, xor a hash of the column, (1, BLOCK_W))."""
        key = _fmix32(t * 0x9E3779B1 ^ (MOMENT * 0x7F4A7C15))
        row_bits = _fmix32((row & 0xFFFFFFFF).to(tl.uint32) ^ _fmix32((row >> 32).to(tl.uint32) + key))
        column_bits = _fmix32(column.to(tl.uint32) + (key ^ 0x5BD1E995))
        bits = (row_bits >> 16) ^ (column_bits >> 16)
        raw = values.to(tl.uint32, bitcast=True)
        return ((raw + bits) & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _sparse_adamw_kernel(p_ptr, m_ptr, v_ptr, g_ptr, rows_ptr, entries_ptr, step_ptr, nnz, W: tl.constexpr,
                             lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, log_beta1, log_beta2, first_row_scale,
                             step_host, HAS_ENTRIES: tl.constexpr, UNIQUE: tl.constexpr, STEP_ON_DEVICE: tl.constexpr,
                             ROUNDED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        """AdamW on a tile of rows × columns of p, m, v (n_rows, W) from g (entries, W): `rows_ptr` (nnz,) the row of
        every entry (sorted unless UNIQUE), `entries_ptr` its values row, `step_ptr` the step count on the device.
        Per-row quantities are (BLOCK_R, 1), per-column ones (1, BLOCK_W)."""
        k = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
        in_k = k < nnz
        cm = c < W
        row = tl.load(rows_ptr + k, mask=in_k, other=-1)
        if UNIQUE:
            lead = in_k
        else:  # only the first entry of a run of equal rows updates the row, with the run's summed values
            prev = tl.load(rows_ptr + k - 1, mask=in_k & (k > 0), other=-1)
            lead = in_k & (row != prev)
        lead = lead & (row >= 0)
        if HAS_ENTRIES:
            ent = tl.load(entries_ptr + k, mask=lead, other=0)
        else:
            ent = k.to(tl.int64)
        tile = lead & cm
        g = tl.load(g_ptr + ent * W + c, mask=tile, other=0.0).to(tl.float32)
        if not UNIQUE:
            nk = k + 1
            same = lead & (tl.load(rows_ptr + nk, mask=lead & (nk < nnz), other=-1) == row)
            while tl.max(tl.max(same.to(tl.int32), axis=1), axis=0) > 0:
                if HAS_ENTRIES:
                    ent_n = tl.load(entries_ptr + nk, mask=same, other=0)
                else:
                    ent_n = nk.to(tl.int64)
                g += tl.load(g_ptr + ent_n * W + c, mask=same & cm, other=0.0).to(tl.float32)
                nk += 1
                same = same & (tl.load(rows_ptr + nk, mask=same & (nk < nnz), other=-1) == row)
        if STEP_ON_DEVICE:
            t = tl.load(step_ptr).to(tl.float32)
            step_size = lr / (1.0 - tl.exp(t * log_beta1))
            bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2))
            t_int = t.to(tl.uint32)
        else:
            # tl.cast, not .to: Triton's launcher passes an int argument equal to 1 (the first step) as a constant
            t_int = tl.cast(step_host, tl.uint32)
        at = row.to(tl.int64) * W + c
        p = tl.load(p_ptr + at, mask=tile, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + at, mask=tile, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + at, mask=tile, other=0.0).to(tl.float32)
        step_size = tl.where(row == 0, step_size * first_row_scale, step_size)  # (BLOCK_R, 1)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + at, p.to(p_ptr.dtype.element_ty), mask=tile)
        if ROUNDED:  # bfloat16 moments, stochastically rounded (SparseAdamW's moment_dtype="bfloat16")
            tl.store(m_ptr + at, _round_bf16(m, row.to(tl.int64), c, t_int, 0), mask=tile)
            tl.store(v_ptr + at, _round_bf16(v, row.to(tl.int64), c, t_int, 1), mask=tile)
        else:
            tl.store(m_ptr + at, m.to(m_ptr.dtype.element_ty), mask=tile)
            tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=tile)


def sparse_adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, entries=None, unique: bool = False,
                      step_in_kernel: bool | None = None, first_row_scale: float = 1.0):
    """`row_adamw.adamw_rows` in one kernel launch (plus an index sort unless `unique`). Entry e's gradient row is
    `values[entries[e]]` (`entries` None: `values[e]`); `step` (already incremented) is read inside the kernel when
    `step_in_kernel` (default: when it is not on the CPU, as with fused=True), else here, without a device read."""
    lr, beta1, beta2, eps, wd = (float(h) for h in hyper)
    n = rows.numel()
    if n == 0:
        return
    W = param.shape[1]
    values = values.to(param.dtype).contiguous()
    rows = rows.to(device=param.device, dtype=torch.int64)
    if not unique and n > 1:
        rows, order = torch.sort(rows, stable=True)
        entries = order if entries is None else entries[order]
    if entries is not None:
        entries = entries.to(device=param.device, dtype=torch.int64).contiguous()
    on_device = step.device.type != "cpu" if step_in_kernel is None else step_in_kernel
    t = 0 if on_device else float(step)
    step_size, bc2_sqrt = (1.0, 1.0) if on_device else (lr / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5)
    log_beta1, log_beta2 = (math.log(beta) if beta > 0 else float("-inf") for beta in (beta1, beta2))
    BLOCK_W = min(triton.next_power_of_2(W), _TILE)
    BLOCK_R = max(1, _TILE // BLOCK_W)
    grid = (triton.cdiv(n, BLOCK_R), triton.cdiv(W, BLOCK_W))
    launch(_sparse_adamw_kernel, grid, param, exp_avg, exp_avg_sq, values, rows,
           entries if entries is not None else rows, step if on_device else rows, n, W,
           lr, beta1, beta2, eps, 1.0 - lr * wd, step_size, bc2_sqrt, log_beta1, log_beta2, float(first_row_scale),
           int(t), HAS_ENTRIES=entries is not None, UNIQUE=unique or n == 1, STEP_ON_DEVICE=on_device,
           ROUNDED=exp_avg.dtype == torch.bfloat16 and param.dtype != torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W,
           num_warps=4)
