"""Triton kernels for the candidate energies and the one-token successors: energy.py's math, one launch per pass, a
persistent grid over the plan's tiles; the shared edge (row 0) stays in torch. Design: docs/gpu.md."""

import torch

from .backend import launch, triton_modules
from .energy import _energy, _energy_backward, prefilled_logits
from .plans import edge_table_grads

triton, tl = triton_modules()

BLOCK_POSITIONS = 16  # positions per chunk (the dot's M, tl.dot's smallest); docs/gpu.md says why
BLOCK_SUCCESSORS = 4  # successors per sub-tile (the dot's N is BN·D)
DOT_PRECISION = "ieee"  # exact fp32, the 1e-5 target; "tf32x3" is the first thing to try where compute-bound
PROGRAMS_PER_SM = 4  # persistent grid: this many programs per streaming multiprocessor
INTERPRETER_PROGRAMS = 4  # grid size under Triton's CPU interpreter (it runs programs one after the other)
DECODE_TILE_SUCCESSORS = 32  # successors per program of the decode kernel (sub-tiles of BLOCK_SUCCESSORS)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def padded_width(d: int) -> int:
    """Register width of a d-vector: the next power of two, at least 16 (tl.dot's smallest K and N)."""
    return max(16, 1 << (d - 1).bit_length())


def unsupported_reason(weights: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why the kernels cannot run these tensors (None when they can); the caller then takes the torch path."""
    reasons = ((triton is None, "triton is not installed"),
               (weights.dtype not in SUPPORTED_DTYPES,
                f"edge tables of dtype {weights.dtype} (the kernels read float32, bfloat16 or float16 rows)"),
               (x.dtype not in SUPPORTED_DTYPES, f"signals of dtype {x.dtype}"),
               (weights.dim() != 3 or weights.shape[1] != weights.shape[2],
                f"edge table of shape {tuple(weights.shape)}"),
               (not weights.is_contiguous(), "a non-contiguous edge table"))
    return next((why for failed, why in reasons if failed), None)


if triton is not None:

    @triton.jit
    def _tile(t, tile_source_ptr, tile_first_ptr, count_ptr, group_start_ptr, indptr_ptr):
        """Tile t: its source u, index s among u's tiles, u's positions (count, first), rows e0 + 1 … e0 + degree."""
        u = tl.load(tile_source_ptr + t)
        s = t - tl.load(tile_first_ptr + u)
        count = tl.load(count_ptr + u)
        first = tl.load(group_start_ptr + u)
        e0 = tl.load(indptr_ptr + u).to(tl.int64)
        degree = (tl.load(indptr_ptr + u + 1) - e0).to(tl.int32)
        return u, s, count, first, e0, degree

    @triton.jit
    def _columns(BN: tl.constexpr, D: tl.constexpr):
        """Of every column of a (·, BN·D) sub-tile: its successor within the sub-tile and its output unit; the lanes."""
        cols = tl.arange(0, BN * D)
        return cols // D, cols % D, tl.arange(0, BN)

    @triton.jit
    def _load_block(w_ptr, b_ptr, e0, vs, degree, col_succ, col_j, k, d):
        """Successors vs … vs + BN − 1: their edge matrices as one (D, BN·D) operand, biases, rows and live columns."""
        col_v = vs + col_succ
        col_ok = (col_v < degree) & (col_j < d)
        row = e0 + 1 + col_v.to(tl.int64)
        w = tl.load(w_ptr + row[None, :] * d * d + k[:, None] * d + col_j[None, :],
                    mask=(k[:, None] < d) & col_ok[None, :], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + row * d + col_j, mask=col_ok, other=0.0).to(tl.float32)
        return w, bias, row, col_ok

    @triton.jit
    def _targets(indices_ptr, e0, v, vmask, HAS_INDICES: tl.constexpr):
        """The target nodes of successors v (CSR indices; v itself in a dense graph)."""
        if HAS_INDICES:
            return tl.load(indices_ptr + e0 + v, mask=vmask, other=0).to(tl.int64)
        return v.to(tl.int64)

    @triton.jit
    def _energy_forward_kernel(
        x_ptr, pe_ptr, w_ptr, b_ptr,
        tile_source_ptr, tile_first_ptr, tile_total_ptr, count_ptr, group_start_ptr, indptr_ptr, indices_ptr,
        part_ptr, out_ptr, out_row_ptr, d, T, V,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, GRID: tl.constexpr,
        LSE: tl.constexpr, LOGITS: tl.constexpr, HAS_INDICES: tl.constexpr, OUT_ROWS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Energies of every (position, successor) tile: their partials (LSE) and/or logits (LOGITS)."""
        total = tl.load(tile_total_ptr)
        k = tl.arange(0, D)
        col_succ, col_j, lanes = _columns(BN, D)
        rows_in_chunk = tl.arange(0, BM)
        t = tl.program_id(0)
        while t < total:
            u, s, count, first, e0, degree = _tile(t, tile_source_ptr, tile_first_ptr, count_ptr, group_start_ptr,
                                                    indptr_ptr)
            v0 = s * (NSUB * BN)
            c = 0
            while c < count:
                p = first + c + rows_in_chunk
                pmask = (c + rows_in_chunk) < count
                p64 = p.to(tl.int64)
                x = tl.load(x_ptr + p64[:, None] * d + k[None, :], mask=pmask[:, None] & (k[None, :] < d),
                            other=0.0).to(tl.float32)
                pe = tl.load(pe_ptr + p64[:, None] * d + k[None, :], mask=pmask[:, None] & (k[None, :] < d),
                             other=0.0).to(tl.float32)
                pe_wide = tl.reshape(tl.broadcast_to(pe[:, None, :], (BM, BN, D)), (BM, BN * D))
                run_max = tl.full((BM,), float("-inf"), tl.float32)
                run_sum = tl.zeros((BM,), tl.float32)
                if OUT_ROWS:
                    out_row = tl.load(out_row_ptr + p, mask=pmask, other=0).to(tl.int64)
                else:
                    out_row = p64
                for sub in range(NSUB):  # not static_range: unrolled, the sub-tiles' loads spilled 2 KB on sm_90
                    vs = v0 + sub * BN
                    if vs < degree:
                        w, bias, row, col_ok = _load_block(w_ptr, b_ptr, e0, vs, degree, col_succ, col_j, k, d)
                        h = tl.dot(x, w, input_precision=PRECISION) + bias[None, :] + pe_wide
                        y = h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
                        energy = tl.sqrt(tl.sum(tl.reshape(y * y, (BM, BN, D)), axis=2))  # (BM, BN)
                        v = vs + lanes
                        vmask = v < degree
                        if LSE:
                            masked = tl.where(vmask[None, :], energy, float("-inf"))
                            new_max = tl.maximum(run_max, tl.max(masked, axis=1))
                            run_sum = (run_sum * tl.exp(run_max - new_max)
                                       + tl.sum(tl.exp(masked - new_max[:, None]), axis=1))
                            run_max = new_max
                        if LOGITS:
                            target = _targets(indices_ptr, e0, v, vmask, HAS_INDICES)
                            tl.store(out_ptr + out_row[:, None] * V + target[None, :], energy,
                                     mask=pmask[:, None] & vmask[None, :])
                if LSE:
                    tl.store(part_ptr + (p64 * T + s) * 2, run_max, mask=pmask)
                    tl.store(part_ptr + (p64 * T + s) * 2 + 1, run_sum, mask=pmask)
                c += BM
            t += GRID

    @triton.jit
    def _energy_backward_kernel(
        x_ptr, pe_ptr, w_ptr, b_ptr,
        tile_source_ptr, tile_first_ptr, tile_total_ptr, count_ptr, group_start_ptr, indptr_ptr, indices_ptr,
        peak_ptr, lse_scale_ptr, grad_target_ptr, target_within_ptr, grad_logits_ptr, logit_row_ptr,
        slot_ptr, grad_w_ptr, grad_b_ptr, grad_x_ptr, grad_pe_ptr, d, T, V,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, GRID: tl.constexpr,
        LSE: tl.constexpr, TARGET: tl.constexpr, LOGITS: tl.constexpr, LOGIT_ROWS: tl.constexpr,
        HAS_INDICES: tl.constexpr, CLEAR_SUCCESSORS: tl.constexpr, SLOTS: tl.constexpr,
        NEED_W: tl.constexpr, NEED_B: tl.constexpr, NEED_X: tl.constexpr, NEED_PE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Recompute a tile's energies and add their gradients into x, PE, the edge rows and biases."""
        total = tl.load(tile_total_ptr)
        k = tl.arange(0, D)
        col_succ, col_j, lanes = _columns(BN, D)
        rows_in_chunk = tl.arange(0, BM)
        t = tl.program_id(0)
        while t < total:
            u, s, count, first, e0, degree = _tile(t, tile_source_ptr, tile_first_ptr, count_ptr, group_start_ptr,
                                                    indptr_ptr)
            v0 = s * (NSUB * BN)
            for sub in tl.static_range(NSUB):
                vs = v0 + sub * BN
                if vs < degree:
                    w, bias, row, col_ok = _load_block(w_ptr, b_ptr, e0, vs, degree, col_succ, col_j, k, d)
                    v = vs + lanes
                    vmask = v < degree
                    if LOGITS:
                        target = _targets(indices_ptr, e0, v, vmask, HAS_INDICES)
                    acc_w = tl.zeros((D, BN * D), tl.float32)
                    acc_b = tl.zeros((BN * D,), tl.float32)
                    c = 0
                    while c < count:
                        p = first + c + rows_in_chunk
                        pmask = (c + rows_in_chunk) < count
                        p64 = p.to(tl.int64)
                        x = tl.load(x_ptr + p64[:, None] * d + k[None, :], mask=pmask[:, None] & (k[None, :] < d),
                                    other=0.0).to(tl.float32)
                        pe = tl.load(pe_ptr + p64[:, None] * d + k[None, :], mask=pmask[:, None] & (k[None, :] < d),
                                     other=0.0).to(tl.float32)
                        pe_wide = tl.reshape(tl.broadcast_to(pe[:, None, :], (BM, BN, D)), (BM, BN * D))
                        h = tl.dot(x, w, input_precision=PRECISION) + bias[None, :] + pe_wide
                        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
                        y = h * cdf
                        slope = cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327
                        energy = tl.sqrt(tl.sum(tl.reshape(y * y, (BM, BN, D)), axis=2))  # (BM, BN)
                        live = pmask[:, None] & vmask[None, :]
                        grad_e = tl.zeros((BM, BN), tl.float32)
                        if LSE:  # d log Z / dE_v = exp(E_v − peak) / total; lse_scale = dL/dlog Z / total
                            peak = tl.load(peak_ptr + p64, mask=pmask, other=0.0)
                            lse_scale = tl.load(lse_scale_ptr + p64, mask=pmask, other=0.0)
                            grad_e += lse_scale[:, None] * tl.exp(tl.where(live, energy - peak[:, None], float("-inf")))
                        if TARGET:  # the target's energy, picked from this tile
                            within = tl.load(target_within_ptr + p, mask=pmask, other=-1)
                            gt = tl.load(grad_target_ptr + p, mask=pmask, other=0.0)
                            grad_e += tl.where(within[:, None] == v[None, :], gt[:, None], 0.0)
                        if LOGITS:
                            if LOGIT_ROWS:
                                lrow = tl.load(logit_row_ptr + p, mask=pmask, other=0).to(tl.int64)
                            else:
                                lrow = p64
                            gl = tl.load(grad_logits_ptr + lrow[:, None] * V + target[None, :], mask=live, other=0.0)
                            grad_e += gl
                            if CLEAR_SUCCESSORS:  # what remains of the row is the shared energy's gradient
                                # every warp holds a copy of the tile: all read before any zeroes it
                                tl.debug_barrier()
                                tl.store(grad_logits_ptr + lrow[:, None] * V + target[None, :], tl.zeros_like(gl),
                                         mask=live)
                        grad_e = tl.where(live, grad_e, 0.0)
                        scale = grad_e / tl.maximum(energy, 1.1754943508222875e-38)
                        gh = tl.reshape(tl.broadcast_to(scale[:, :, None], (BM, BN, D)), (BM, BN * D)) * y * slope
                        if NEED_W:
                            acc_w += tl.dot(tl.trans(x), gh, input_precision=PRECISION)
                        if NEED_B:
                            acc_b += tl.sum(gh, axis=0)
                        if NEED_X:
                            gx = tl.dot(gh, tl.trans(w), input_precision=PRECISION)
                            tl.atomic_add(grad_x_ptr + p64[:, None] * d + k[None, :], gx,
                                          mask=pmask[:, None] & (k[None, :] < d))
                        if NEED_PE:  # dL/dPE = Σ_v dL/dh_v
                            gpe = tl.sum(tl.reshape(gh, (BM, BN, D)), axis=1)
                            tl.atomic_add(grad_pe_ptr + p64[:, None] * d + k[None, :], gpe,
                                          mask=pmask[:, None] & (k[None, :] < d))
                        c += BM
                    if SLOTS:
                        slot = tl.load(slot_ptr + row, mask=col_ok, other=0).to(tl.int64)
                    else:
                        slot = row
                    if NEED_W:
                        tl.store(grad_w_ptr + slot[None, :] * d * d + k[:, None] * d + col_j[None, :],
                                 acc_w.to(grad_w_ptr.dtype.element_ty), mask=(k[:, None] < d) & col_ok[None, :])
                    if NEED_B:
                        tl.store(grad_b_ptr + slot * d + col_j, acc_b.to(grad_b_ptr.dtype.element_ty), mask=col_ok)
            t += GRID

    @triton.jit
    def _decode_successors_kernel(
        x_ptr, pe_ptr, w_ptr, b_ptr, sources_ptr, indptr_ptr, indices_ptr, out_ptr, d, V,
        D: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, HAS_INDICES: tl.constexpr,
    ):
        """Energies of position program_id(0)'s successors in tile program_id(1), written into its row of logits."""
        r = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        k = tl.arange(0, D)
        col_succ, col_j, lanes = _columns(BN, D)
        u = tl.load(sources_ptr + r)
        e0 = tl.load(indptr_ptr + u)
        degree = (tl.load(indptr_ptr + u + 1) - e0).to(tl.int32)
        x = tl.load(x_ptr + r * d + k, mask=k < d, other=0.0).to(tl.float32)
        pe = tl.load(pe_ptr + r * d + col_j, mask=col_j < d, other=0.0).to(tl.float32)
        for sub in tl.static_range(NSUB):
            vs = s * (NSUB * BN) + sub * BN
            if vs < degree:
                w, bias, row, col_ok = _load_block(w_ptr, b_ptr, e0, vs, degree, col_succ, col_j, k, d)
                h = tl.sum(x[:, None] * w, axis=0) + bias
                h += pe
                y = h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
                energy = tl.sqrt(tl.sum(tl.reshape(y * y, (BN, D)), axis=1))
                v = vs + lanes
                vmask = v < degree
                tl.store(out_ptr + r * V + _targets(indices_ptr, e0, v, vmask, HAS_INDICES), energy, mask=vmask)


def _common_args(plan):
    """The plan's tensors every energy kernel takes, in their argument order."""
    indices = plan.indices if plan.indices is not None else plan.indptr  # any valid pointer when dense
    return (plan.tile_source, plan.tile_first, plan.tile_total, plan.count, plan.group_start, plan.indptr, indices)


def _meta(plan, d):
    """Compile-time sizes of the energy kernels for node size `d`, and the persistent grid on the plan's device."""
    device = plan.count.device
    grid = (torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM if device.type == "cuda"
            else INTERPRETER_PROGRAMS)
    return dict(D=padded_width(d), BM=BLOCK_POSITIONS, BN=BLOCK_SUCCESSORS, GRID=grid, PRECISION=DOT_PRECISION,
                NSUB=plan.tile_successors // BLOCK_SUCCESSORS, HAS_INDICES=plan.indices is not None)


def _forward(x, pe, weights, b2, plan, out, lse: bool):
    """The forward kernel: with `lse`, per (sorted position, successor tile) the largest energy and Σ exp(E − it)
    into `out` (N, T, 2) ((−inf, 0) past a position's degree); else every real successor's energy into `out` (N, V)."""
    N, d = x.shape
    if lse:
        out[..., 0], out[..., 1] = float("-inf"), 0.0
    if N and plan.num_tiles:
        meta = _meta(plan, d)
        launch(_energy_forward_kernel, (meta["GRID"],), x, pe, weights, b2, *_common_args(plan), out, out, plan.count,
               d, plan.num_tiles, plan.vocab_size, LSE=lse, LOGITS=not lse, OUT_ROWS=False, **meta, num_warps=4)
    return out


def _shared_energy(x, pe, w0, b0):
    """The shared edge's (row 0) pre-activation, output and energy of every position, in torch."""
    h = torch.addmm(b0 + pe, x, w0)
    return (h, *_energy(h))


def _gradient_rows(plan, P: int, link, device):
    """The sorted touched rows `index` (R,), each row's slot (P,), and the slots of rows only the recurrence touched
    (zeroed here, filled by its backward). One host synchronisation: R, the size of the sparse gradient."""
    V = plan.vocab_size
    present = (plan.count > 0).to(torch.int32)
    # every row of every present source's block: +1 at its first row, −1 past its last, then a running sum
    mark = torch.zeros(P + 1, dtype=torch.int32, device=device)
    mark.index_add_(0, plan.indptr[:V] + 1, present)
    mark.index_add_(0, plan.indptr[1:V + 1] + 1, -present)
    in_block = torch.cumsum(mark[:P], 0) > 0
    touched = in_block.clone()
    if plan.has_shared:
        touched[0] = True
    if link is not None and link.rows is not None and link.rows.numel():
        touched.index_fill_(0, link.rows.to(device), True)
    extra = touched & ~in_block
    if plan.has_shared:
        extra[0] = False  # the shared row is written by the torch part
    R, X = torch.stack([touched.sum(), extra.sum()]).tolist()  # the one synchronisation (sizes of the gradient)
    slot = torch.cumsum(touched, 0, dtype=torch.int64) - 1
    index = torch.nonzero_static(touched, size=R).view(-1)
    return index, slot, slot[torch.nonzero_static(extra, size=X).view(-1)]


def _row_gradients(ctx, plan, weights, link, need_w: bool, need_b: bool):
    """(index, slot, w_values, b_values) of the edge tables' gradient, sparse over touched rows (dense: index None)."""
    if not (need_w or need_b):
        return None, None, None, None
    P, d = weights.shape[0], weights.shape[-1]
    like = dict(dtype=weights.dtype, device=weights.device)
    if not ctx.sparse_grad:
        return (None, None, torch.zeros(ctx.weight_shape, **like) if need_w else None,
                torch.zeros(P, d, **like) if need_b else None)
    index, slot, extra_slots = _gradient_rows(plan, P, link, weights.device)
    R = index.numel()
    w_values = torch.empty(R, *ctx.weight_shape[1:], **like).index_fill_(0, extra_slots, 0) if need_w else None
    b_values = torch.empty(R, d, **like).index_fill_(0, extra_slots, 0) if need_b else None
    return index, slot, w_values, b_values


def _shared_row_backward(x, weights, saved, g, grad_logits, bias_dtype, w_values, b_values, grad_x, grad_pe):
    """The shared edge's (row 0) share of every gradient, in torch; with `bias_dtype`, returns non_edge_bias's."""
    h, y, e = saved
    grad_bias = None
    if grad_logits is not None:  # the shared energy fills every non-successor column of the logits
        g = g + grad_logits.sum(1)
        if bias_dtype is not None:  # logits[p, v] = shared[p] + bias[v] in those columns
            grad_bias = grad_logits.sum(0).to(bias_dtype)
    for values in (w_values, b_values):
        if values is not None:
            values[0].zero_()
    if x.shape[0]:
        gh = _energy_backward(h, y, e, g.float())
        if w_values is not None:
            w_values[0] = (x.float().t() @ gh).to(w_values.dtype)
        if b_values is not None:
            b_values[0] = gh.sum(0).to(b_values.dtype)
        if grad_x is not None:
            grad_x.addmm_(gh, weights[0].t().float())
        if grad_pe is not None:
            grad_pe += gh
    return grad_bias


class KernelCall:
    """One `candidate_energies` call on a `KernelPlan` (`plan.call`): its inputs, the gradients for its backward."""

    def __init__(self, inputs, partials_filled: bool, non_edge_bias=None):
        self.inputs = inputs
        self.partials_filled = partials_filled
        self.non_edge_bias = non_edge_bias  # the offsets whose logits gradient this call's backward returns
        self.pending = {}  # name -> the gradient handed over (summed where a loss uses a quantity twice)


class KernelEnergies(torch.autograd.Function):
    """Triton twin of `energy._CandidateEnergies`: (N, T, 2) tile partials and (N,) shared energies. The functions below
    take `shared` (so their backward runs first) and hand their gradients here via `plan.call`, for one kernel pass."""

    @staticmethod
    def forward(ctx, x, pe, weights, biases, plan, sparse_grad: bool, link, non_edge_bias=None):
        N, d = x.shape
        b2 = biases.reshape(weights.shape[0], d)
        x, pe = x.contiguous(), pe.contiguous()
        part = torch.empty(N, plan.num_tiles, 2, dtype=torch.float32, device=x.device)
        training = any(ctx.needs_input_grad[:4])
        if training:  # else the first log_partition call fills them (logits alone never read them)
            _forward(x, pe, weights, b2, plan, part, lse=True)
        plan.call = KernelCall((x, pe, weights, b2), training, non_edge_bias)
        if plan.has_shared:  # float32 math whatever the tables' dtype, as inside the kernels
            h_shared, y_shared, shared = _shared_energy(x.float(), pe.float(), weights[0].float(), b2[0].float())
        else:
            h_shared, y_shared, shared = None, None, torch.zeros(N, dtype=torch.float32, device=x.device)
        ctx.mark_non_differentiable(part)
        ctx.plan, ctx.call, ctx.sparse_grad, ctx.link = plan, plan.call, sparse_grad, link
        ctx.weight_shape, ctx.bias_shape = weights.shape, biases.shape
        ctx.non_edge_dtype = None if non_edge_bias is None else non_edge_bias.dtype
        ctx.save_for_backward(x, pe, weights, b2, h_shared, y_shared, shared)
        return part, shared

    @staticmethod
    def backward(ctx, _grad_part, grad_shared):
        x, pe, weights, b2, h_shared, y_shared, shared = ctx.saved_tensors
        plan, call, link = ctx.plan, ctx.call, ctx.link
        pending, call.pending = call.pending, {}
        ctx.link = ctx.call = call.inputs = None
        N, d = x.shape
        need_x, need_pe, need_w, need_b = ctx.needs_input_grad[:4]
        need_bias = any(ctx.needs_input_grad[7:])
        lse = pending.get("lse")  # (peak, dL/dlog Z / total) per position
        target = pending.get("target")  # (dL/dE_target, index of the target within the block or −1)
        grad_logits = pending.get("logits")  # (N, V)
        grad_x, grad_pe = (torch.zeros(N, d, dtype=torch.float32, device=x.device) if need else None
                           for need in (need_x, need_pe))
        index, slot, w_values, b_values = _row_gradients(ctx, plan, weights, link, need_w, need_b)
        clear = grad_logits is not None and plan.has_shared
        if clear:  # the kernel reads the successors' columns and zeroes them: the rest sums to the shared gradient
            grad_logits = grad_logits.clone()
        live = lse is not None or target is not None or grad_logits is not None
        if not (N and plan.num_tiles and live and (need_x or need_pe or need_w or need_b or clear)):
            for values in (w_values, b_values):  # nothing reaches the candidate energies: zero gradients
                if values is not None:
                    values.zero_()
        else:
            meta = _meta(plan, d)
            ptr = lambda t, dummy=shared: dummy if t is None else t  # shared: any float32 tensor, not read
            peak, lse_scale = lse if lse is not None else (shared, shared)
            gt, within = target if target is not None else (shared, plan.count)
            launch(_energy_backward_kernel, (meta["GRID"],), x, pe, weights, b2, *_common_args(plan),
                   peak, lse_scale, gt, within, ptr(grad_logits), plan.count, ptr(slot, plan.count),
                   ptr(w_values), ptr(b_values), ptr(grad_x), ptr(grad_pe), d, plan.num_tiles, plan.vocab_size,
                   LSE=lse is not None, TARGET=target is not None, LOGITS=grad_logits is not None, LOGIT_ROWS=False,
                   CLEAR_SUCCESSORS=clear, SLOTS=slot is not None,
                   NEED_W=need_w, NEED_B=need_b, NEED_X=need_x, NEED_PE=need_pe, **meta, num_warps=8)
        grad_bias = None
        if plan.has_shared:
            grad_bias = _shared_row_backward(x, weights, (h_shared, y_shared, shared), grad_shared.float(), grad_logits,
                                             ctx.non_edge_dtype if need_bias else None, w_values, b_values, grad_x,
                                             grad_pe)
        grad_w, grad_b = edge_table_grads(ctx, index, w_values, b_values, need_w, need_b, link) if need_w or need_b \
            else (None, None)
        grad_x = None if grad_x is None else grad_x.to(x.dtype)
        grad_pe = None if grad_pe is None else grad_pe.to(pe.dtype)
        return grad_x, grad_pe, grad_w, grad_b, None, None, None, grad_bias


class KernelLogPartition(torch.autograd.Function):
    """log Z per sorted position from the tile partials and the shared term (as energy.exact_log_partition)."""

    @staticmethod
    def forward(ctx, part, shared, plan, vocab_size: int, log_mass=None):
        has_shared = plan.degree < vocab_size
        shared32 = shared.float()
        if log_mass is None:
            weight, term = (vocab_size - plan.degree).to(torch.float32), shared32
        else:
            weight, term = has_shared.to(torch.float32), shared32 + log_mass.float()
        term_or_none = torch.where(has_shared, term, torch.full_like(term, float("-inf")))
        peak = torch.maximum(part[..., 0].amax(1) if part.shape[1] else term_or_none, term_or_none)
        total = (part[..., 1] * torch.exp(part[..., 0] - peak.unsqueeze(1))).sum(1)
        total = total + torch.where(has_shared, weight * torch.exp(term - peak), torch.zeros_like(total))
        ctx.call, ctx.shared_dtype = plan.call, shared.dtype
        ctx.save_for_backward(peak, total, weight, term, has_shared)
        ctx.mass_dtype = None if log_mass is None else log_mass.dtype
        return (peak + torch.log(total)).to(shared.dtype)

    @staticmethod
    def backward(ctx, grad):
        peak, total, weight, term, has_shared = ctx.saved_tensors
        scale = grad.float() / total
        call = ctx.call
        if "lse" in call.pending:  # log Z used twice: the same peaks
            old_peak, old_scale = call.pending["lse"]
            scale = scale + old_scale * torch.exp(old_peak - peak)
        call.pending["lse"] = (peak, scale)
        grad_term = torch.where(has_shared, scale * weight * torch.exp(term - peak), torch.zeros_like(scale))
        grad_mass = None if ctx.mass_dtype is None else grad_term.to(ctx.mass_dtype)
        return None, grad_term.to(ctx.shared_dtype), None, None, grad_mass


def log_partition(part, shared, plan, vocab_size: int, log_mass=None) -> torch.Tensor:
    """log Σ_v exp(E_v) per sorted position; `log_mass` (N,) in place of log(V − degree): energy.non_edge_log_mass."""
    call = plan.call
    if not call.partials_filled:  # inference: the forward left them for here
        _forward(*call.inputs, plan, part, lse=True)
        call.partials_filled = True
    return KernelLogPartition.apply(part, shared, plan, vocab_size, log_mass)


class KernelTarget(torch.autograd.Function):
    """Each sorted position's energy of its real-successor target, in torch; the candidate kernel takes its gradient."""

    @staticmethod
    def forward(ctx, shared, target_rows, within, plan):
        x, pe, weights, b2 = plan.call.inputs
        rows = target_rows.clamp_min(0)
        h = torch.bmm(x.float().unsqueeze(1), weights[rows].float()).squeeze(1) + b2[rows].float() + pe.float()
        ctx.call = plan.call
        ctx.save_for_backward(within)
        return _energy(h)[1]

    @staticmethod
    def backward(ctx, grad):
        (within,) = ctx.saved_tensors
        call = ctx.call
        grad = grad.float().contiguous()
        if "target" in call.pending:
            old, w = call.pending["target"]
            if w is not within and not torch.equal(w, within):
                raise NotImplementedError("two different target selections on one kernel plan: build one plan per "
                                          "loss (make_plan) or use BRILLM_BACKEND=torch.")
            grad = grad + old
        call.pending["target"] = (grad, within)
        return None, None, None, None


def target_energies(part, shared, plan, target_rows, block_first_row) -> torch.Tensor:
    """Energy each sorted position gives its target: the real edge's (from the kernel plan) or `shared`."""
    real = target_rows > 0
    within = torch.where(real, target_rows - block_first_row, torch.full_like(target_rows, -1)).to(torch.int32)
    picked = KernelTarget.apply(shared, target_rows, within.contiguous(), plan)
    return torch.where(real, picked.to(shared.dtype), shared)


class KernelLogits(torch.autograd.Function):
    """(N, V) sorted logits: the shared energy (+ `non_edge_bias`), the real successors' written by the kernel."""

    @staticmethod
    def forward(ctx, shared, plan, non_edge_bias=None):
        out = prefilled_logits(shared.float(), plan.vocab_size, non_edge_bias)
        _forward(*plan.call.inputs, plan, out, lse=False)
        ctx.call = plan.call
        return out

    @staticmethod
    def backward(ctx, grad):
        pending, grad = ctx.call.pending, grad.float().contiguous()
        pending["logits"] = pending["logits"] + grad if "logits" in pending else grad
        return None, None, None


def scatter_logits(part, shared, plan, non_edge_bias=None) -> torch.Tensor:
    """(N, V) logits on a kernel plan; `non_edge_bias` must be the tensor the energies call got."""
    if (non_edge_bias is not None and torch.is_grad_enabled() and non_edge_bias.requires_grad
            and plan.call.non_edge_bias is not non_edge_bias):
        raise ValueError("scatter_logits got a non_edge_bias that the candidate_energies call did not: pass the same "
                         "tensor to candidate_energies(..., non_edge_bias=...), whose backward returns its gradient "
                         "from the logits.")
    return KernelLogits.apply(shared, plan, non_edge_bias)


@torch.no_grad()
def successor_logits(x, pe, edges, sources, graph, width: int) -> torch.Tensor:
    """(N, V) logits in the positions' order (inference): the real successors' by one launch of a static grid."""
    N, d = x.shape
    V, weights, indices = graph.vocab_size, edges.weights, graph.indices
    b2 = edges.biases.reshape(weights.shape[0], d)
    if indices is not None:
        shared = _shared_energy(x.float(), pe.float(), weights[0].float(), b2[0].float())[2]
        out = prefilled_logits(shared, V, edges.non_edge_bias)
    else:
        out = torch.empty(N, V, dtype=torch.float32, device=x.device)  # every column is a successor
    tiles = -(-width // DECODE_TILE_SUCCESSORS)
    if N and tiles:
        launch(_decode_successors_kernel, (N, tiles), x.contiguous(), pe.contiguous(), weights, b2, sources,
               graph.indptr, graph.indptr if indices is None else indices, out, d, V, D=padded_width(d),
               BN=BLOCK_SUCCESSORS, NSUB=DECODE_TILE_SUCCESSORS // BLOCK_SUCCESSORS, HAS_INDICES=indices is not None,
               num_warps=4)
    return out

