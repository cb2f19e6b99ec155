"""Energies of every candidate edge in torch, the costly part of BriLLM (naive.py defines them): grouped by source,
each block of edge matrices (CSR order) is read in place once a call, m positions × n successors one (n, m, d)
`baddbmm` forward, two products backward, the gradients going to the touched rows only (`EdgeGradLink`)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .plans import CandidatePlan, EdgeGradLink, KernelPlan, edge_table_grads


class RowView(torch.autograd.Function):
    """`tensor.view(shape)` keeping the rows, whose backward takes sparse row gradients too (autograd's cannot)."""

    @staticmethod
    def forward(ctx, tensor, shape):
        ctx.shape = tensor.shape
        return tensor.view(shape)

    @staticmethod
    def backward(ctx, grad):
        if grad.is_sparse:  # its rows come from autograd: valid by construction
            values = grad._values().reshape(-1, *ctx.shape[1:])
            return torch.sparse_coo_tensor(grad._indices(), values, ctx.shape, is_coalesced=grad.is_coalesced(),
                                           check_invariants=False), None
        return grad.reshape(ctx.shape), None


def sparse_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`table[rows]` (any row shape) with a sparse row gradient, as nn.Embedding(sparse=True)."""
    flat = F.embedding(rows.reshape(-1), RowView.apply(table, (table.shape[0], -1)), sparse=True)
    return flat.view(*rows.shape, *table.shape[1:])


def _energy(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GeLU(h) and its L2 norm over the last dimension: an edge's output and energy."""
    y = F.gelu(h)
    return y, torch.linalg.vector_norm(y, dim=-1)


def _energy_backward(h: torch.Tensor, y: torch.Tensor, e: torch.Tensor, grad_e: torch.Tensor) -> torch.Tensor:
    """d(‖GeLU(h)‖)/dh times grad_e, for h, y = GeLU(h) (..., d) and e = ‖y‖, grad_e (...)."""
    grad_y = (grad_e / e.clamp_min(torch.finfo(e.dtype).tiny)).unsqueeze(-1) * y
    return torch.ops.aten.gelu_backward(grad_y, h)


_WORKSPACES: dict = {}
_CACHE_MIN_BYTES = 1 << 20  # smaller buffers come from malloc's free lists anyway


def _workspace(name: str, shape, dtype, device) -> torch.Tensor:
    """An uninitialised tensor of `shape` carved from a cached buffer, reused once nothing else holds it: a step's
    gradient buffers are hundreds of MB, and fresh ones page-fault on first write (slower than the arithmetic)."""
    numel = torch.Size(shape).numel()
    key = (name, dtype, device)
    cached = _WORKSPACES.get(key)
    if cached is not None and cached.numel() >= numel:
        try:
            free = torch._C._storage_Use_Count(cached.untyped_storage()._cdata) <= 2
        except Exception:  # private API missing: never reuse
            free = False
        if free:
            return cached[:numel].view(shape)
    big = device.type == "cpu" and numel * dtype.itemsize >= _CACHE_MIN_BYTES
    # headroom, so that steps touching a few more rows than the largest so far do not re-allocate
    buf = torch.empty(max(numel + numel // 4 if big else numel, 1), dtype=dtype, device=device)
    if big:
        _WORKSPACES[key] = buf
    return buf[:numel].view(shape)


def release_workspaces():
    """Drop the cached gradient buffers (they are re-created on the next backward)."""
    _WORKSPACES.clear()


class _GatherEdges(torch.autograd.Function):
    """`weights[rows]`, `biases[rows]` for the scan, gradients sparse (`sparse_grad`) or added into the `link`'s."""

    @staticmethod
    def forward(ctx, weights, biases, rows, sparse_grad: bool = False, link: EdgeGradLink | None = None):
        P = weights.shape[0]
        flat = rows.reshape(-1)
        w = weights.view(P, -1).index_select(0, flat).view(*rows.shape, *weights.shape[1:])
        b = biases.reshape(P, -1).index_select(0, flat).view(*rows.shape, biases.shape[-1])
        if link is not None and link.rows is None:  # (a recomputation under gradient checkpointing runs this
            link.rows = torch.unique(flat)  # again after the candidate backward published: keep what it gave)
            link.grad = None
        ctx.save_for_backward(flat)
        ctx.sparse_grad, ctx.link = sparse_grad, link
        ctx.weight_shape, ctx.bias_shape = weights.shape, biases.shape
        return w, b

    @staticmethod
    def backward(ctx, grad_w, grad_b):
        (flat,) = ctx.saved_tensors
        link, ctx.link = ctx.link, None
        need_w = ctx.needs_input_grad[0] and grad_w is not None
        need_b = ctx.needs_input_grad[1] and grad_b is not None
        gw = grad_w.reshape(flat.numel(), -1) if need_w else None
        gb = grad_b.reshape(flat.numel(), -1) if need_b else None
        published = link.grad if link is not None else None
        if link is not None:
            link.grad = None
        if published is not None:  # the candidate backward's buffers: add into them
            index, w_values, b_values = published
            slot = flat if index is None else torch.searchsorted(index, flat)
            if need_w and w_values is not None:
                w_values.view(w_values.shape[0], -1).index_add_(0, slot, gw.to(w_values.dtype))
                need_w = False
            if need_b and b_values is not None:
                b_values.view(b_values.shape[0], -1).index_add_(0, slot, gb.to(b_values.dtype))
                need_b = False
            if not (need_w or need_b):
                return None, None, None, None, None
        index, slot = torch.unique(flat, return_inverse=True) if ctx.sparse_grad else (None, flat)
        R = ctx.weight_shape[0] if index is None else index.numel()
        w_values = gw.new_zeros(R, gw.shape[1]).index_add_(0, slot, gw).view(R, *ctx.weight_shape[1:]) if need_w \
            else None
        b_values = gb.new_zeros(R, gb.shape[1]).index_add_(0, slot, gb) if need_b else None
        return (*edge_table_grads(ctx, index, w_values, b_values, need_w, need_b, None), None, None, None)


gather_edges = _GatherEdges.apply


class _CandidateEnergies(torch.autograd.Function):
    """Packed real-successor energies (M,) and shared energies (N,) of `x`, `pe` (N, d) in plan order."""

    @staticmethod
    def forward(ctx, x, pe, weights, biases, plan: CandidatePlan, sparse_grad: bool = False,
                link: EdgeGradLink | None = None):
        (N, d), M = x.shape, plan.num_entries
        b2 = biases.reshape(weights.shape[0], d)
        groups = [(i, m, r0, n) for i, (m, r0, n) in
                  enumerate(zip(plan.group_sizes, plan.block_starts, plan.block_sizes)) if n]
        # pre-activations start as bias + PE of every entry, then each group adds x·W over its block in place
        h = torch.index_select(b2, 0, plan.grouped_rows(), out=_workspace("h", (M, d), x.dtype, x.device))
        tmp = _workspace("y", (M, d), x.dtype, x.device)
        if M:
            h += torch.index_select(pe, 0, plan.grouped_positions(), out=tmp)
        xs = x.split(plan.group_sizes)
        hs = h.split([m * n for _, m, _, n in groups]) if groups else []
        for (i, m, r0, n), hg in zip(groups, hs):
            hg.view(n, m, d).baddbmm_(xs[i].expand(n, m, d), weights[r0:r0 + n])
        y = torch.ops.aten.gelu.out(h, out=tmp)
        e = torch.linalg.vector_norm(y, dim=-1)
        v = None
        if any(ctx.needs_input_grad[:4]):  # v = dE/dh, all the backward needs of the pre-activations
            y /= e.clamp_min(torch.finfo(e.dtype).tiny).unsqueeze(-1)
            v = torch.ops.aten.gelu_backward.grad_input(y, h, grad_input=_workspace("v", (M, d), x.dtype, x.device))
        h = y = tmp = None
        energies = e if plan.packed_to_grouped is None else e[plan.packed_to_grouped]
        if plan.has_shared:
            h_shared = torch.addmm(b2[0] + pe, x, weights[0]) if N else pe.clone()
            y_shared, shared = _energy(h_shared)
        else:
            h_shared, y_shared, shared = None, None, x.new_zeros(N)
        ctx.plan, ctx.groups, ctx.sparse_grad, ctx.link = plan, groups, sparse_grad, link
        ctx.weight_shape, ctx.bias_shape = weights.shape, biases.shape
        ctx.save_for_backward(x, weights, v, h_shared, y_shared, shared)
        return energies, shared

    @staticmethod
    def backward(ctx, grad_energies, grad_shared):
        x, weights, v, h_shared, y_shared, shared = ctx.saved_tensors
        plan, groups, link = ctx.plan, ctx.groups, ctx.link
        ctx.link = None
        (N, d), P, M, device, dtype = x.shape, weights.shape[0], plan.num_entries, x.device, x.dtype
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        need_params = need_w or need_b
        # gradient of every pre-activation, grouped order (M, d), and of the shared one (N, d)
        gh = gh_shared = None
        if M and grad_energies is not None:
            g = grad_energies if plan.grouped_to_packed is None else grad_energies[plan.grouped_to_packed]
            gh = torch.mul(v, g.to(dtype).unsqueeze(1), out=_workspace("gh", (M, d), dtype, device))
        if plan.has_shared and grad_shared is not None and N:
            gh_shared = _energy_backward(h_shared, y_shared, shared, grad_shared.to(dtype))
        index = w_values = b_values = None
        first_slots = [r0 for _, _, r0, _ in groups]
        if need_params and ctx.sparse_grad:  # the shared row (when present) is the first slot
            index, w_values, b_values, first_slots = _sparse_layout(
                ctx, plan, groups, link, need_w, need_b, gh is None, gh_shared, dtype, device)
        elif need_params:
            w_values = weights.new_zeros(ctx.weight_shape) if need_w else None
            b_values = weights.new_zeros(P, d) if need_b else None
        grad_x = torch.zeros_like(x) if need_x else None
        if gh is not None and (need_x or need_w or need_b):
            _block_grads(plan, groups, x, weights, gh, first_slots, w_values, b_values, grad_x, need_w, need_b)
        if gh_shared is not None:
            if need_w:
                torch.mm(x.t(), gh_shared, out=w_values[0])
            if need_b:
                b_values[0] += gh_shared.sum(0)
            if need_x:
                grad_x.addmm_(gh_shared, weights[0].t())
        grad_pe = None
        if ctx.needs_input_grad[1]:  # PE enters every pre-activation of its position (a caller may fold x·W into it)
            grad_pe = _position_sums(plan, groups, gh, x)
            if gh_shared is not None:
                grad_pe += gh_shared
        grad_w, grad_b = edge_table_grads(ctx, index, w_values, b_values, need_w, need_b, link) if need_params \
            else (None, None)
        return grad_x, grad_pe, grad_w, grad_b, None, None, None


def _position_sums(plan, groups, gh, x) -> torch.Tensor:
    """(N, d): every sorted position's sum of dE/dh over its candidates (one reduction per group)."""
    out = torch.zeros_like(x)
    if gh is None:
        return out
    per_group = out.split(plan.group_sizes)
    for (i, m, _, n), ghg in zip(groups, gh.split([m * n for _, m, _, n in groups])):
        torch.sum(ghg.view(n, m, -1), 0, out=per_group[i])
    return out


def _sparse_layout(ctx, plan, groups, link, need_w: bool, need_b: bool, no_block_grad: bool, gh_shared, dtype, device):
    """(index, w_values, b_values, first_slots) of a sparse gradient, `index` the sorted rows (workspace buffers)."""
    base, ns = int(plan.has_shared), [n for *_, n in groups]
    n_t, r0_t = torch.tensor(ns, dtype=torch.long), torch.tensor([r0 for _, _, r0, _ in groups], dtype=torch.long)
    slots_t = base + torch.cumsum(n_t, 0) - n_t  # each block's first slot
    end = base + int(n_t.sum())
    index = torch.cat([torch.zeros(base, dtype=torch.long), torch.arange(base, end)
                       + torch.repeat_interleave(r0_t - slots_t, n_t, output_size=end - base)]).to(device)
    first_slots, covered_by_blocks = slots_t.tolist(), True
    extra = link.rows if link is not None else None
    if extra is not None and extra.numel():
        merged = torch.unique(torch.cat([index, extra.to(device)]))
        if merged.numel() != index.numel():  # the recurrence read rows outside the candidate blocks
            index, covered_by_blocks = merged, False
            first_slots = torch.searchsorted(index, r0_t.to(device)).tolist()
    R = index.numel()
    w_values = b_values = None
    if need_w:  # zero the rows no product below writes: outside the blocks (the shared row without its gradient)
        w_values = _workspace("grad_w", (R, *ctx.weight_shape[1:]), dtype, device)
        zero_outside = not covered_by_blocks or (plan.has_shared and gh_shared is None)
        if zero_outside or no_block_grad:
            in_block = torch.zeros(R, dtype=torch.bool, device=device)
            for s, n in zip(first_slots, ns):
                in_block[s:s + n] = True
            w_values[(in_block & no_block_grad) | (~in_block & zero_outside)] = 0
    if need_b:
        b_values = _workspace("grad_b", (R, ctx.weight_shape[-1]), dtype, device).zero_()
    return index, w_values, b_values, first_slots


def _block_grads(plan, groups, x, weights, gh, first_slots, w_values, b_values, grad_x, need_w: bool, need_b: bool):
    """The blocks' share of the backward (weight rows, dE/dx, bias rows): one product per group, its block in place."""
    d, M = x.shape[1], gh.shape[0]
    ms, ns = [m for _, m, _, _ in groups], [n for *_, n in groups]
    sizes = [m * n for m, n in zip(ms, ns)]
    ghs = gh.split(sizes)
    if need_w:
        xs = x.split(plan.group_sizes)
        for (i, m, _, n), ghg, slot in zip(groups, ghs, first_slots):
            if m == 1:  # outer products x ⊗ gh_r: a broadcast multiply beats a K=1 bmm
                torch.mul(xs[i].view(1, d, 1), ghg.view(n, 1, d), out=w_values[slot:slot + n])
            else:
                torch.bmm(xs[i].t().expand(n, d, m), ghg.view(n, m, d), out=w_values[slot:slot + n])
    if grad_x is not None:  # dE/dx = W·(dE/dh), summed over the successors of each position
        gx = _workspace("gx", (M, d), x.dtype, x.device)
        for (_, m, r0, n), ghg, gxg in zip(groups, ghs, gx.split(sizes)):
            torch.bmm(ghg.view(n, m, d), weights[r0:r0 + n].transpose(1, 2), out=gxg.view(n, m, d))
        grad_x.index_add_(0, plan.grouped_positions(), gx)
    if need_b:
        # every entry adds into its edge row: slot = first slot of its block + its successor index
        n_t = torch.tensor(ns, dtype=torch.long)
        block_first_entry = torch.cumsum(n_t, 0) - n_t
        total = int(n_t.sum())
        row_slot = (torch.repeat_interleave(torch.tensor(first_slots, dtype=torch.long) - block_first_entry, n_t,
                                            output_size=total) + torch.arange(total))
        if plan.grouped_position is not None:
            row_slot = torch.repeat_interleave(row_slot, torch.repeat_interleave(torch.tensor(ms), n_t), output_size=M)
        b_values.index_add_(0, row_slot.to(x.device), gh)


candidate_energies = _CandidateEnergies.apply


def scatter_logits(energies, shared, plan: CandidatePlan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """Full (N, V) logits in sorted order: the shared energy (+ `non_edge_bias[v]`), real successors' on top."""
    return prefilled_logits(shared, vocab_size, non_edge_bias).index_put((plan.entry_position, plan.entry_target),
                                                                         energies)


def prefilled_logits(shared, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """(N, V) logits (shared's dtype) holding every position's shared energy (+ `non_edge_bias[v]`)."""
    if non_edge_bias is None:
        return shared.unsqueeze(1).expand(shared.shape[0], vocab_size).contiguous()
    return shared.unsqueeze(1) + non_edge_bias.to(shared.dtype).unsqueeze(0)


def successor_logits(x, pe, edges, sources, graph, width: int | None) -> torch.Tensor:
    """(N, V) energies (float32 for 16-bit tables) of every node as each position's successor, inference only. `width`:
    the largest degree fixes the shapes (no host read); None reads each row's degree (one row: `row_energies`)."""
    N, d = x.shape
    if N == 1 and not _capturing(x):
        return row_energies(x, pe, RowTables.of(edges), graph, int(sources))[0]
    V, weights, indices = graph.vocab_size, edges.weights, graph.indices
    ct = torch.promote_types(weights.dtype, torch.float32)  # bfloat16 and float16 tables: float32 math
    x, pe, b2 = x.to(ct), pe.to(ct), edges.biases.reshape(weights.shape[0], d)
    logits = x.new_zeros(N, V + 1)  # a dense graph: every column is a real successor
    if indices is not None:  # every other node gets the shared edge's energy (+ its own offset)
        shared = _energy(torch.addmm(b2[0].to(ct) + pe, x, weights[0].to(ct)))[1]
        logits = shared.unsqueeze(1).expand(N, V + 1).contiguous()
        if edges.non_edge_bias is not None:
            logits[:, :V] += edges.non_edge_bias.to(ct)
    first = graph.indptr[sources]
    degree = graph.indptr[sources + 1] - first
    if width is None:
        width = int(degree.max()) if N else 0
    if width == 0:
        return logits[:, :V]
    j = torch.arange(width, device=x.device)
    real = j < degree.unsqueeze(1)  # (N, width)
    edge = torch.where(real, first.unsqueeze(1) + j, torch.zeros_like(j))  # CSR index; 0 where not real
    h = torch.matmul(x[:, None, None, :], weights[edge + 1].to(ct)).squeeze(2) + b2[edge + 1].to(ct)
    energies = _energy(h + pe.unsqueeze(1))[1]  # (N, width)
    target = j.expand(N, width) if indices is None else indices[edge]
    return logits.scatter(1, torch.where(real, target, V), energies)[:, :V]


def row_energies(x, pe, tables, graph, u: int):
    """`successor_logits` of one position on node `u` (host int), its block read in place, with the edge outputs the
    next step crosses one of: (logits (1, V), (successors' (n, d), shared (1, d) or None, first entry))."""
    a, e = graph.block(u)
    W, b = tables.weights[a + 1:e + 1], tables.biases[a + 1:e + 1]
    if W.dtype != tables.dtype:
        W, b = W.to(tables.dtype), b.to(tables.dtype)
    outputs, energies = _energy(torch.baddbmm(b + pe, x.expand(e - a, 1, x.shape[1]), W).squeeze(1))
    if graph.indices is None:
        return energies.unsqueeze(0), (outputs, None, a)
    shared, energy = _energy(torch.addmm(tables.shared_bias + pe, x, tables.shared_weight))
    logits = energy.expand(1, graph.vocab_size).clone()
    if tables.non_edge_bias is not None:
        logits += tables.non_edge_bias
    return logits.index_copy_(1, graph.indices[a:e], energies.unsqueeze(0)), (outputs, shared, a)


@dataclass
class RowTables:
    """The edge tables as one row's step on the CPU reads them, its float32 (or float64) parts made once per loop."""

    weights: torch.Tensor  # (P, d, d) as stored
    biases: torch.Tensor  # (P, 1, d) as stored
    dtype: torch.dtype  # what the step computes in: float32 for tables of 16 bits
    shared_weight: torch.Tensor  # (d, d) row 0 in `dtype`
    shared_bias: torch.Tensor  # (1, d)
    non_edge_bias: torch.Tensor | None  # (V,)

    @classmethod
    def of(cls, edges) -> "RowTables":
        ct = torch.promote_types(edges.weights.dtype, torch.float32)
        bias = None if edges.non_edge_bias is None else edges.non_edge_bias.to(ct)
        return cls(edges.weights, edges.biases, ct, edges.weights[0].to(ct), edges.biases[0].to(ct), bias)


def _capturing(x: torch.Tensor) -> bool:
    """Whether `x` lives where no host read may happen: a CUDA graph being recorded, or the meta device."""
    return x.device.type == "meta" or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def non_edge_log_mass(non_edge_bias, plan: CandidatePlan | KernelPlan) -> torch.Tensor:
    """log Σ exp(non_edge_bias[v]) over each sorted position's non-successors (N,), in float64."""
    b = non_edge_bias.double()
    top = b.max().detach()
    w = torch.exp(b - top)
    if isinstance(plan, KernelPlan):
        V = plan.vocab_size
        if plan.indices is None:  # dense: every node is a successor
            node_succ = w.sum().expand(V)
        else:
            E = plan.indices.numel()
            edge_source = torch.repeat_interleave(torch.arange(V, device=w.device), plan.indptr.diff(), output_size=E)
            node_succ = w.new_zeros(V).index_add(0, edge_source, w[plan.indices])
        node_mass = torch.log((w.sum() - node_succ).clamp_min(1e-300)) + top
        return node_mass[plan.sources[plan.order]]
    succ = w.new_zeros(plan.degree.numel())
    if plan.num_entries:
        succ = succ.index_add(0, plan.entry_position, w[plan.entry_target])
    return torch.log((w.sum() - succ).clamp_min(1e-300)) + top


def exact_log_partition(energies, shared, plan: CandidatePlan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """log Σ_v exp(E_v) over all V nodes per position, the non-successors one shared term: O(real successors)."""
    has_shared = plan.degree < vocab_size
    if non_edge_bias is not None and plan.has_shared:  # the non-successors' total weight, in log
        shared = shared + non_edge_log_mass(non_edge_bias, plan).to(shared.dtype)
    else:
        shared = shared + torch.log((vocab_size - plan.degree).to(shared.dtype))
    peak = torch.where(has_shared, shared, torch.full_like(shared, float("-inf")))
    if plan.num_entries:
        peak = peak.scatter_reduce(0, plan.entry_position, energies, "amax", include_self=True)
    peak = peak.detach()
    total = torch.where(has_shared, torch.exp(shared - peak), torch.zeros_like(shared))
    if plan.num_entries:
        total = total.index_add(0, plan.entry_position, torch.exp(energies - peak[plan.entry_position]))
    return peak + torch.log(total)


def target_energies(energies, shared, plan: CandidatePlan, targets: torch.Tensor, target_rows, block_first_row,
                    non_edge_bias=None):
    """Each sorted position's energy of its target: its real edge's (`target_rows` > 0) or the shared one (+ bias)."""
    real = target_rows > 0
    entry = plan.entry_start + (target_rows - block_first_row).clamp_min(0)
    picked = energies[entry.clamp_max(max(plan.num_entries - 1, 0))] if plan.num_entries else shared
    if non_edge_bias is not None:
        shared = shared + non_edge_bias.to(shared.dtype)[targets]
    return torch.where(real, picked, shared)
