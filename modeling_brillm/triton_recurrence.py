"""The signal recurrence (`recurrence.signal_scan`) as one Triton scan, a program per batch row, the mix (S, N, M) in
registers. The backward is a reverse scan; with the adjoints ḡx of the signal, ḡS, ḡN, ḡM of the state after column j,

    ḡS' = ḡS + ḡx / N'                ḡN' = ḡN − ⟨ḡx, x⟩ / N'
    ḡp  = e^{p−M'}·(⟨ḡS', c⟩ + ḡN')  ḡc  = e^{p−M'}·ḡS'           (the mix weight and the edge output)
    ḡS ← e^{M−M'}·ḡS'                 ḡN ← e^{M−M'}·ḡN'           ḡM ← e^{M−M'}·(⟨ḡS', S⟩ + ḡN'·N)
    ḡM' = ḡM − ⟨ḡS', S'⟩ − ḡN'·N'     routed through the max as torch.maximum does (ties: half to each side)
    ḡh  = ḡc ⊙ GeLU'(h);  ḡW[r] += x_in ⊗ ḡh;  ḡb[r] += ḡh;  ḡx ← ḡh · W[r]ᵀ

The forward saves x, N and M per column (S = x·N). Design and register counts: docs/gpu.md."""

import torch

from .backend import launch, triton_modules
from .plans import edge_table_grads

MAX_NODE_SIZE = 128  # a row's d×d tile lives in registers; larger d falls back to the torch loop

triton, tl = triton_modules()


def unsupported_reason(weights: torch.Tensor, needs_grad: bool) -> str | None:
    """Why the scan cannot run these weights (None when it can); the caller then runs the torch loop."""
    reasons = ((triton is None, "triton is not importable"),
               (weights.shape[-1] > MAX_NODE_SIZE, f"node_size {weights.shape[-1]} > {MAX_NODE_SIZE}"),
               (weights.dtype not in (torch.float32, torch.bfloat16, torch.float16), f"weights dtype {weights.dtype}"),
               (needs_grad and weights.dtype != torch.float32,
                "training with non-float32 weights (the atomics accumulate float32 gradients)"))
    return next((why for failed, why in reasons if failed), None)


def _meta(d: int) -> dict:
    """Compile-time width and warps of the scan for node size `d`."""
    D = max(16, triton.next_power_of_2(d))
    return dict(D=D, num_warps=1 if D <= 32 else 4 if D <= 64 else 8)


if triton is not None:

    @triton.jit
    def _gelu(h):
        """Exact (erf) GeLU, as torch's default."""
        return 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(h):
        """Derivative of the exact GeLU: Φ(h) + h·φ(h)."""
        return 0.5 * (1.0 + tl.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)

    @triton.jit
    def _bvec(v, cond):
        """`cond` as a boolean vector like `v` (block & scalar is an int32 mask, which the interpreter refuses)."""
        return (v * 0 + cond.to(tl.int32)) != 0

    @triton.jit
    def _load_base(base_ptr, d: tl.constexpr, i, k, mi, mk, D: tl.constexpr, HAS_BASE: tl.constexpr):
        """The matrix every edge adds to its own (config.edge_backoff); zeros the compiler drops without it."""
        E = tl.zeros([D, D], dtype=tl.float32)
        if HAS_BASE:
            E += tl.load(base_ptr + i[:, None] * d + k[None, :], mask=mi[:, None] & mk[None, :],
                         other=0.0).to(tl.float32)
        return E

    @triton.jit
    def _load_keep(keep_ptr, at, d: tl.constexpr, i, mi, D: tl.constexpr, HAS_DROP: tl.constexpr):
        """Column `at`'s dropout mask on the signal entering its edge; ones the compiler drops without HAS_DROP."""
        if HAS_DROP:
            return tl.load(keep_ptr + at * d + i, mask=mi, other=0.0)
        return tl.full([D], 1.0, dtype=tl.float32)

    @triton.jit
    def _load_step(w_ptr, b_ptr, pe_ptr, mixw_ptr, edge_ptr, rows_ptr, keep_ptr, node_ptr, base, j, L,
                   d: tl.constexpr, i, k, mi, mk, E, D: tl.constexpr, HAS_BASE: tl.constexpr, HAS_DROP: tl.constexpr,
                   HAS_NODE: tl.constexpr):
        """What column j of the row at `base` (= row·L) reads that does not depend on the signal: W[r] (+ E, off
        the signal's chain of dependencies), bias + PE, the mix logit, the edge flag, the mask, the node's vector."""
        inside = j < L
        at = base + j
        r = tl.load(rows_ptr + at, mask=inside, other=0)
        e = tl.load(edge_ptr + at, mask=inside, other=0) != 0
        mk_in = mk & _bvec(k, inside)
        W = tl.load(w_ptr + r * d * d + i[:, None] * d + k[None, :], mask=mi[:, None] & mk_in[None, :],
                    other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + r * d + k, mask=mk_in, other=0.0).to(tl.float32)
        pe = tl.load(pe_ptr + at * d + k, mask=mk_in, other=0.0).to(tl.float32)
        p = tl.load(mixw_ptr + at, mask=inside, other=0.0)
        if HAS_BASE:
            W += E
        keep = _load_keep(keep_ptr, at, d, i, mi & _bvec(i, inside), D, HAS_DROP)
        node = tl.zeros([D], dtype=tl.float32)
        if HAS_NODE:
            node += tl.load(node_ptr + at * d + k, mask=mk_in, other=0.0).to(tl.float32)
        return W, bias + pe, p, e, keep, node

    @triton.jit
    def _scan_forward_kernel(
        x0_ptr, s0_ptr, n0_ptr, m0_ptr,  # incoming signal (B, d), mix sum (B, d), norm (B,), max (B,)
        w_ptr, b_ptr, rows_ptr, edge_ptr, pe_ptr, mixw_ptr,  # (P, d, d), (P, d), (B, L) ×2, (B, L, d), (B, L)
        base_ptr, keep_ptr, node_ptr,  # (d, d) shared matrix, (B, L, d) dropout mask, (B, L, d) node vectors
        sig_ptr, nsave_ptr, msave_ptr,  # out: signals (B, L, d); norm and max after every column (B, L)
        sfin_ptr, nfin_ptr, mfin_ptr,  # out: final mix sum (B, d), norm (B,), max (B,)
        L, d: tl.constexpr,
        D: tl.constexpr, SAVE: tl.constexpr, HAS_BASE: tl.constexpr, HAS_DROP: tl.constexpr, HAS_NODE: tl.constexpr,
    ):
        """One batch row's columns in order: edge output, softmax mix, signal."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, D)  # input index of W (its rows)
        k = tl.arange(0, D)  # output index of W (its columns)
        mi, mk = i < d, k < d
        base = row * L
        x = tl.load(x0_ptr + row * d + i, mask=mi, other=0.0)
        S = tl.load(s0_ptr + row * d + k, mask=mk, other=0.0)
        N = tl.load(n0_ptr + row)
        M = tl.load(m0_ptr + row)
        E = _load_base(base_ptr, d, i, k, mi, mk, D, HAS_BASE)
        W, add, p, e, keep, node = _load_step(w_ptr, b_ptr, pe_ptr, mixw_ptr, edge_ptr, rows_ptr, keep_ptr, node_ptr,
                                              base, 0, L, d, i, k, mi, mk, E, D, HAS_BASE, HAS_DROP, HAS_NODE)
        j = 0
        while j < L:  # not range(): the interpreter cannot take a runtime bound; next column's loads go out first
            Wn, addn, pn, en, keepn, noden = _load_step(w_ptr, b_ptr, pe_ptr, mixw_ptr, edge_ptr, rows_ptr, keep_ptr,
                                                        node_ptr, base, j + 1, L, d, i, k, mi, mk, E, D, HAS_BASE,
                                                        HAS_DROP, HAS_NODE)
            out = _gelu(tl.sum((x * keep)[:, None] * W, axis=0) + add) + node
            M_new = tl.maximum(M, p)
            decay = tl.exp(M - M_new)
            weight = tl.exp(p - M_new)
            S = tl.where(e, S * decay + weight * out, S)
            N = tl.where(e, N * decay + weight, N)
            M = tl.where(e, M_new, M)
            x_new = S / tl.maximum(N, 1e-30)
            x = tl.where(e & mi, x_new, x)
            tl.store(sig_ptr + (base + j) * d + i, x, mask=mi)
            if SAVE:
                tl.store(nsave_ptr + base + j, N)
                tl.store(msave_ptr + base + j, M)
            W, add, p, e, keep, node = Wn, addn, pn, en, keepn, noden
            j += 1
        tl.store(sfin_ptr + row * d + k, S, mask=mk)
        tl.store(nfin_ptr + row, N)
        tl.store(mfin_ptr + row, M)

    @triton.jit
    def _scan_backward_kernel(
        x0_ptr, s0_ptr, n0_ptr, m0_ptr,
        w_ptr, b_ptr, rows_ptr, slot_ptr, edge_ptr, pe_ptr, mixw_ptr, base_ptr, keep_ptr, node_ptr,
        sig_ptr, nsave_ptr, msave_ptr,  # saved by the forward
        gsig_ptr, gsfin_ptr, gnfin_ptr, gmfin_ptr,  # incoming gradients (zeros where none)
        gx0_ptr, gs0_ptr, gn0_ptr, gm0_ptr, gmixw_ptr,  # out: gradients of the inputs
        gw_ptr, gb_ptr, gbase_ptr, gnode_ptr,  # edge rows' (at slot_ptr's slots), (B, d, d) per batch row, (B, L, d)
        L, d: tl.constexpr, D: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr, HAS_BASE: tl.constexpr,
        NEED_BASE: tl.constexpr, HAS_DROP: tl.constexpr, HAS_NODE: tl.constexpr,
    ):
        """One batch row's columns in reverse: the exact reverse mode of the forward's update."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, D)
        k = tl.arange(0, D)
        mi, mk = i < d, k < d
        base = row * L
        gx = tl.zeros([D], dtype=tl.float32)
        gS = tl.load(gsfin_ptr + row * d + k, mask=mk, other=0.0)
        gN = tl.load(gnfin_ptr + row)
        gM = tl.load(gmfin_ptr + row)
        E = _load_base(base_ptr, d, i, k, mi, mk, D, HAS_BASE)
        gE = tl.zeros([D, D], dtype=tl.float32)
        j = L - 1
        while j >= 0:
            at = base + j
            gx += tl.load(gsig_ptr + at * d + k, mask=mk, other=0.0)
            e = tl.load(edge_ptr + at) != 0
            r = tl.load(rows_ptr + at)
            mk_e = mk & _bvec(k, e)
            W = tl.load(w_ptr + r * d * d + i[:, None] * d + k[None, :], mask=mi[:, None] & mk_e[None, :],
                        other=0.0).to(tl.float32)
            if HAS_BASE:
                W += E
            add = tl.load(b_ptr + r * d + k, mask=mk_e, other=0.0).to(tl.float32)
            add += tl.load(pe_ptr + at * d + k, mask=mk_e, other=0.0).to(tl.float32)
            p = tl.load(mixw_ptr + at)
            # the signal entering the edge and the state before the column: column j−1's, or the incoming ones
            first = j == 0
            x_in = tl.load(sig_ptr + (at - 1) * d + i, mask=mi & _bvec(i, j > 0), other=0.0) \
                + tl.load(x0_ptr + row * d + i, mask=mi & _bvec(i, first), other=0.0)
            keep = _load_keep(keep_ptr, at, d, i, mi, D, HAS_DROP)
            x_in = x_in * keep  # what the edge read (the mix's state is the undropped one's)
            N_in = tl.load(nsave_ptr + at - 1, mask=j > 0, other=0.0) + tl.load(n0_ptr + row, mask=first, other=0.0)
            M_in = tl.where(first, tl.load(m0_ptr + row), tl.load(msave_ptr + at - 1, mask=j > 0, other=0.0))
            S_in = tl.where(first, tl.load(s0_ptr + row * d + k, mask=mk, other=0.0),
                            tl.load(sig_ptr + (at - 1) * d + k, mask=mk & _bvec(k, j > 0), other=0.0) * N_in)
            x_out = tl.load(sig_ptr + at * d + k, mask=mk, other=0.0)
            N_out = tl.load(nsave_ptr + at)
            M_out = tl.load(msave_ptr + at)
            S_out = x_out * N_out

            h = tl.sum(x_in[:, None] * W, axis=0) + add
            out = _gelu(h)
            if HAS_NODE:
                out += tl.load(node_ptr + at * d + k, mask=mk_e, other=0.0).to(tl.float32)
            # columns without an edge change nothing below; neutral values keep their arithmetic finite
            M_out = tl.where(e, M_out, 0.0)
            M_in = tl.where(e, M_in, 0.0)
            decay = tl.exp(M_in - M_out)
            weight = tl.exp(p - M_out)
            Nc = tl.where(e, tl.maximum(N_out, 1e-30), 1.0)
            gS1 = gS + gx / Nc
            gN1 = gN - tl.where(N_out > 1e-30, tl.sum(gx * x_out, axis=0) / Nc, 0.0)  # clamp_min's backward
            g_max = gM - tl.sum(gS1 * S_out, axis=0) - gN1 * N_out
            gp = weight * (tl.sum(gS1 * out, axis=0) + gN1)
            gM_in = decay * (tl.sum(gS1 * S_in, axis=0) + gN1 * N_in)
            # torch.maximum's backward: all to the larger input, half to each on a tie
            gp += tl.where(p > M_in, g_max, tl.where(p == M_in, 0.5 * g_max, 0.0))
            gM_in += tl.where(M_in > p, g_max, tl.where(p == M_in, 0.5 * g_max, 0.0))
            if HAS_NODE:  # added to the edge output: the output's gradient
                tl.store(gnode_ptr + at * d + k, tl.where(mk_e, weight * gS1, 0.0), mask=mk)
            gh = weight * gS1 * _gelu_grad(h)
            gh = tl.where(mk, gh, 0.0)
            gx_in = tl.sum(W * gh[None, :], axis=1) * keep
            s = tl.load(slot_ptr + at)
            if NEED_W:
                tl.atomic_add(gw_ptr + s * d * d + i[:, None] * d + k[None, :], x_in[:, None] * gh[None, :],
                              mask=mi[:, None] & mk_e[None, :], sem="relaxed")
            if NEED_B:
                tl.atomic_add(gb_ptr + s * d + k, gh, mask=mk_e, sem="relaxed")
            if NEED_BASE:  # every edge's matrix holds E: the sum of the edges' gradients
                gE += x_in[:, None] * tl.where(mk_e, gh, 0.0)[None, :]
            tl.store(gmixw_ptr + at, tl.where(e, gp, 0.0))
            gx = tl.where(mk_e, gx_in, gx)
            gS = tl.where(e, gS1 * decay, gS)
            gN = tl.where(e, gN1 * decay, gN)
            gM = tl.where(e, gM_in, gM)
            j -= 1
        tl.store(gx0_ptr + row * d + k, gx, mask=mk)
        tl.store(gs0_ptr + row * d + k, gS, mask=mk)
        tl.store(gn0_ptr + row, gN)
        tl.store(gm0_ptr + row, gM)
        if NEED_BASE:  # one tile a batch row, summed in torch: no atomics all rows would contend for
            tl.store(gbase_ptr + row * d * d + i[:, None] * d + k[None, :], gE, mask=mi[:, None] & mk[None, :])


def _edge_gradient_buffers(ctx, need_w: bool, need_b: bool, rows: torch.Tensor):
    """(w_buffer, b_buffer, slots, own): the buffers the candidate backward published on the link, else fresh
    float32 ones of our own, returned with their (index, w, b) as `own` (dense, or sparse over the rows read)."""
    link, ctx.link = ctx.link, None
    published = None if link is None else link.grad
    if link is not None:
        link.grad = None
    if published is not None:
        index, w_values, b_values = published
        if (not need_w or w_values is not None) and (not need_b or b_values is not None):
            slot = rows if index is None else torch.searchsorted(index, rows)
            return (w_values if need_w else None), (b_values if need_b else None), slot, None
    if ctx.sparse_grad:
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        slot, R = inverse.view(rows.shape), uniq.numel()
    else:
        uniq, slot, R = None, rows, ctx.weight_shape[0]
    w_buf = torch.zeros(R, *ctx.weight_shape[1:], dtype=torch.float32, device=rows.device) if need_w else None
    b_buf = torch.zeros(R, ctx.weight_shape[-1], dtype=torch.float32, device=rows.device) if need_b else None
    return w_buf, b_buf, slot, (uniq, w_buf, b_buf)


class _SignalScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0, s0, n0, m0, mix_weight, weights, biases, rows, has_edge, pe, sparse_grad: bool, link,
                edge_base=None, keep=None, node_add=None):
        B, L = rows.shape
        P, d = weights.shape[0], weights.shape[-1]
        f32 = dict(dtype=torch.float32, device=x0.device)
        x0, s0, n0, m0, mix_weight = (t.float().contiguous() for t in (x0, s0, n0, m0, mix_weight))
        rows, pe, w = rows.contiguous(), pe.contiguous(), weights.contiguous()
        edge = has_edge.contiguous().view(torch.uint8)
        b2 = biases.reshape(P, d).contiguous()
        has_base, has_drop, has_node = edge_base is not None, keep is not None, node_add is not None
        base = edge_base.contiguous() if has_base else b2  # b2 where a flag is off: any tensor, not read
        keep = keep.float().contiguous() if has_drop else b2
        node = node_add.contiguous() if has_node else b2
        training = any(ctx.needs_input_grad[:7]) or ctx.needs_input_grad[12] or ctx.needs_input_grad[14]
        signals, s_fin = torch.empty(B, L, d, **f32), torch.empty(B, d, **f32)
        n_save, m_save = (torch.empty(B, L, **f32) if training else signals for _ in range(2))
        n_fin, m_fin = (torch.empty(B, **f32) for _ in range(2))
        if B and L:
            launch(_scan_forward_kernel, (B,), x0, s0, n0, m0, w, b2, rows, edge, pe, mix_weight, base, keep, node,
                   signals, n_save, m_save, s_fin, n_fin, m_fin, L, d, SAVE=training, HAS_BASE=has_base,
                   HAS_DROP=has_drop, HAS_NODE=has_node, **_meta(d))
        else:
            s_fin.copy_(s0), n_fin.copy_(n0), m_fin.copy_(m0)
        if link is not None and link.rows is None:  # not again when gradient checkpointing recomputes the scan
            # the rows read, for the candidate backward to make room for (sorted, may repeat: no host read)
            link.rows = torch.sort(rows.reshape(-1)).values
            link.grad = None
        if training:
            ctx.save_for_backward(x0, s0, n0, m0, mix_weight, w, b2, rows, edge, pe, signals, n_save, m_save, base,
                                  keep, node)
        ctx.sparse_grad, ctx.link, ctx.has_base, ctx.has_drop = sparse_grad, link, has_base, has_drop
        ctx.has_node, ctx.node_dtype = has_node, node.dtype
        ctx.weight_shape, ctx.bias_shape, ctx.weight_dtype = weights.shape, biases.shape, weights.dtype
        return signals, s_fin, n_fin, m_fin

    @staticmethod
    def backward(ctx, g_signals, g_sum, g_norm, g_max):
        x0, s0, n0, m0, mix_weight, w, b2, rows, edge, pe, signals, n_save, m_save, base, keep, node = ctx.saved_tensors
        (B, L), d = rows.shape, w.shape[-1]
        need_w, need_b, need_base = ctx.needs_input_grad[5], ctx.needs_input_grad[6], ctx.needs_input_grad[12]
        f32 = dict(dtype=torch.float32, device=x0.device)
        # an unused output's gradient comes as zeros (autograd materialises it)
        g_signals, g_sum, g_norm, g_max = (g.float().contiguous() for g in (g_signals, g_sum, g_norm, g_max))
        w_buf, b_buf, slot, own = _edge_gradient_buffers(ctx, need_w, need_b, rows)
        g_x0, g_s0, g_n0, g_m0, g_mix = (torch.empty(*shape, **f32) for shape in ((B, d), (B, d), (B,), (B,), (B, L)))
        g_base = torch.zeros(B, d, d, **f32) if need_base else None
        g_node = torch.empty(B, L, d, **f32) if ctx.has_node else None
        if B and L:
            launch(_scan_backward_kernel, (B,),
                   x0, s0, n0, m0, w, b2, rows, slot.contiguous(), edge, pe, mix_weight, base, keep, node, signals,
                   n_save, m_save, g_signals, g_sum, g_norm, g_max, g_x0, g_s0, g_n0, g_m0, g_mix,
                   *(g_x0 if t is None else t for t in (w_buf, b_buf, g_base, g_node)), L, d,  # g_x0: not read
                   NEED_W=need_w, NEED_B=need_b, HAS_BASE=ctx.has_base, NEED_BASE=need_base, HAS_DROP=ctx.has_drop,
                   HAS_NODE=ctx.has_node, **_meta(d))
        else:
            g_x0.zero_(), g_mix.zero_()
            if g_node is not None:
                g_node.zero_()
            g_s0.copy_(g_sum), g_n0.copy_(g_norm), g_m0.copy_(g_max)
        grad_w = grad_b = None
        if own is not None:
            uniq, w_own, b_own = own
            w_own, b_own = (None if t is None else t.to(ctx.weight_dtype) for t in (w_own, b_own))
            grad_w, grad_b = edge_table_grads(ctx, uniq, w_own, b_own, need_w, need_b, None)
        g_base = None if g_base is None else g_base.sum(0).to(base.dtype)
        g_node = None if g_node is None else g_node.to(ctx.node_dtype)
        return g_x0, g_s0, g_n0, g_m0, g_mix, grad_w, grad_b, None, None, None, None, None, g_base, None, g_node


def signal_scan(mix, columns, edges, link=None):
    """`recurrence.signal_scan` by the kernel (it drops out each edge's input; the candidates' mask is applied here)."""
    keep = columns.keep
    signals, *rest = _SignalScan.apply(*mix.tensors(), columns.weight, edges.weights, edges.biases, columns.rows,
                                       columns.has_edge, columns.pe, edges.sparse_grad, link, edges.edge_base,
                                       None if keep is None else keep[:, :-1], columns.node_add)
    final = signals[:, -1] if signals.shape[1] else mix.signal.float()
    return (signals if keep is None else signals * keep[:, 1:]), type(mix)(final, *rest)
