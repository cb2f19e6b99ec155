"""Energies of every candidate edge: the costly part of BriLLM, computed block by block.

For a signal x at a position whose current node is u, every real successor v of u gets the energy
E_v = ‖GeLU(x·W[u→v] + b[u→v] + PE)‖₂, and every other node gets one shared energy from edge row 0 (plus its own
learned offset `non_edge_bias[v]` when the model has `config.non_edge_bias`: the `non_edge_bias` arguments below).
Positions are grouped by source node so each source's block of edge matrices (contiguous, CSR order) is
read once per call; the backward writes gradients for the touched rows only (dense or sparse COO).

Work layout. Entries are the (position, real successor) pairs. The *packed* order (what `candidate_energies`
returns) is position-major: sorted position p owns entries `entry_start[p] .. entry_start[p] + degree[p]`.
Inside the autograd function the entries of a group (the m positions of one source, its n successors) are
computed successor-major, as one (n, m, d) chunk, so a group costs one in-place `baddbmm` forward and two
products backward (outer products x⊗dE/dh into the gradient, and W·dE/dh for dE/dx) over its block of edge
matrices read in place; everything elementwise (bias + PE, GeLU, norms, dE/dh, kept from the forward) runs
once over all entries. Large per-step buffers are reused across steps (`_workspace`). A group's chunk covers the same entry range in both orders (the
positions of a group are consecutive and share one degree), so the two orders differ by a transpose inside
each chunk, and not at all when every source occurs once.

Gradient hand-over with the recurrence (`EdgeGradLink`). The recurrence reads one edge row per token
(`gather_edges`), a subset of the rows this function touches. Two sparse gradients for the same parameter
would make autograd concatenate them (a copy of every touched row) and leave duplicates for the optimizer;
two dense ones cost a second full-size zero tensor and an add. With a link, the candidate backward (which runs
first) allocates the union of both row sets, hands its gradient buffers to the link, and the recurrence's
backward adds its rows into them in place, returning no gradient of its own: one coalesced sparse gradient
(or one dense one) per parameter, bit-for-bit the same sums.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import use_triton


@dataclass
class CandidatePlan:
    """Which rows each position reads, in the order the energies come out (no autograd, built once per call)."""

    order: torch.Tensor  # (N,) positions sorted by source node (stable)
    group_sizes: list[int]  # positions per distinct source, in sorted order
    block_starts: list[int]  # first edge row of each group's block
    block_sizes: list[int]  # real successors of each group's source
    degree: torch.Tensor  # (N,) real successors of each sorted position
    entry_position: torch.Tensor  # (M,) sorted position of every packed energy
    entry_target: torch.Tensor  # (M,) target node of every packed energy
    entry_start: torch.Tensor  # (N,) offset of each sorted position's first packed energy
    has_shared: bool  # sparse graph: non-successors get the shared energy
    # successor-major layout of the computation (see the module docstring); None = same as packed
    grouped_to_packed: torch.Tensor | None = None  # (M,) packed index of every grouped-order entry
    packed_to_grouped: torch.Tensor | None = None  # (M,) grouped index of every packed entry
    grouped_position: torch.Tensor | None = None  # (M,) sorted position of every grouped-order entry
    entry_row: torch.Tensor | None = None  # (M,) edge row of every packed energy

    @property
    def num_entries(self) -> int:
        return self.entry_target.numel()

    def grouped_positions(self) -> torch.Tensor:
        return self.entry_position if self.grouped_position is None else self.grouped_position

    def grouped_rows(self) -> torch.Tensor:
        return self.entry_row if self.grouped_to_packed is None else self.entry_row[self.grouped_to_packed]


# ------------------------------------------------------------------------------------- kernel plan
KERNEL_TILE_SUCCESSORS = 32  # successors per work tile of the Triton kernels (a multiple of their sub-tile, 4)


@dataclass
class KernelPlan:
    """Work tiles of the Triton kernels, built on the device with static shapes (no host synchronisation).

    A tile is (source u, block of `tile_successors` consecutive successors of u); a source present in the batch
    owns ceil(degree(u) / tile_successors) tiles, an absent one none. Tile t belongs to `tile_source[t]` and is its
    (t − tile_first[u])-th; `tile_total` (1,) is their number, read by the kernels on the device (the grid is fixed).
    """

    order: torch.Tensor  # (N,) positions sorted by source node (stable), as CandidatePlan.order
    sources: torch.Tensor  # (N,) the unsorted sources (kept to build the torch plan on a fallback)
    degree: torch.Tensor  # (N,) real successors of each sorted position
    count: torch.Tensor  # (V,) int32 positions of each source
    group_start: torch.Tensor  # (V,) int32 first sorted position of each source
    tile_first: torch.Tensor  # (V,) int32 first tile of each source
    tile_total: torch.Tensor  # (1,) int32 number of tiles
    tile_source: torch.Tensor  # (U,) int32 source of every tile id below U (ids >= tile_total unused)
    indptr: torch.Tensor  # (V+1,) CSR offsets of the real edges (edge row = offset + 1)
    indices: torch.Tensor | None  # (E,) targets, None for a dense graph
    vocab_size: int
    has_shared: bool
    num_tiles: int  # T = ceil(max_degree / tile_successors): tiles of the largest block (static per graph)
    tile_successors: int = KERNEL_TILE_SUCCESSORS
    fallback: CandidatePlan | None = None  # set when the tensors turned out unsupported: the torch plan

    # the last candidate_energies call on this plan (triton_energy.KernelCall): its inputs, which the log Z, target
    # and logits functions reuse, and the gradients they hand to its backward
    call: object | None = None


_MAX_DEGREE: dict = {}


def graph_max_degree(indptr: torch.Tensor) -> int:
    """Largest number of real successors of any node; one host read per graph (cached by tensor and version)."""
    key = (indptr.data_ptr(), indptr._version, indptr.numel(), indptr.device)
    if key not in _MAX_DEGREE:
        if len(_MAX_DEGREE) > 16:
            _MAX_DEGREE.clear()
        _MAX_DEGREE[key] = int((indptr[1:] - indptr[:-1]).max()) if indptr.numel() > 1 else 0
    return _MAX_DEGREE[key]


def make_kernel_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, vocab_size: int,
                     max_degree: int | None = None, tile_successors: int | None = None) -> KernelPlan:
    """`KernelPlan` for positions whose current nodes are `sources` (N,): argsort, counts, cumulative sums and a
    searchsorted, all of sizes known from N and V (so it runs on `device="meta"` and inside a CUDA graph).
    `max_degree` (static per graph) defaults to V for a dense graph and to `graph_max_degree(indptr)` otherwise."""
    device = sources.device
    V = vocab_size
    N = sources.numel()
    tile_successors = tile_successors or KERNEL_TILE_SUCCESSORS
    if max_degree is None:
        max_degree = V if indices is None else graph_max_degree(indptr)
    order = torch.argsort(sources, stable=True)
    count = torch.zeros(V, dtype=torch.int32, device=device)
    count.index_add_(0, sources, torch.ones(N, dtype=torch.int32, device=device))
    group_start = torch.cumsum(count, 0, dtype=torch.int32) - count
    node_degree = indptr[1:] - indptr[:-1]
    tiles = torch.where(count > 0, (node_degree + tile_successors - 1) // tile_successors, 0).to(torch.int32)
    tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    num_tiles = -(-max_degree // tile_successors)
    upper = min(N, V) * num_tiles  # no more tiles than (distinct sources) x (tiles of the largest block)
    tile_source = torch.searchsorted(tile_end, torch.arange(upper, dtype=torch.int32, device=device), right=True)
    return KernelPlan(
        order=order,
        sources=sources,
        degree=node_degree[sources[order]],
        count=count,
        group_start=group_start,
        tile_first=tile_end - tiles,
        tile_total=tile_end[-1:] if V else torch.zeros(1, dtype=torch.int32, device=device),
        tile_source=tile_source.to(torch.int32),
        indptr=indptr,
        indices=indices,
        vocab_size=V,
        has_shared=indices is not None,
        num_tiles=num_tiles,
        tile_successors=tile_successors,
    )


def _kernels():
    """The Triton kernel module, imported on first use (a relative `from .x import` so saved models carry it)."""
    import sys

    from .triton_energy import KernelEnergies

    return sys.modules[KernelEnergies.__module__]


def _runs_kernels(plan, weights=None, x=None) -> bool:
    """Whether `plan` runs the Triton kernels; a kernel plan meeting tensors they do not read falls back for good."""
    if not isinstance(plan, KernelPlan) or plan.fallback is not None:
        return False
    if weights is not None:
        reason = _kernels().unsupported_reason(weights, x)
        if reason is not None:
            plan.fallback = make_torch_plan(plan.sources, plan.indptr, plan.indices, plan.vocab_size)
            return False
    return True


def _torch_plan(plan):
    """The plan the torch path runs: itself, or the fallback a kernel plan switched to."""
    if isinstance(plan, KernelPlan):
        return plan.fallback
    return plan


def make_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, vocab_size: int, *,
              kernels: bool = True, max_degree: int | None = None) -> CandidatePlan | KernelPlan:
    """Plan for positions whose current nodes are `sources` (N,). `indices=None` means a dense graph.

    A `KernelPlan` when the Triton kernels run these tensors (`backend.use_triton`) and `kernels` is True (a caller
    whose options the kernels do not cover passes False), else the torch path's `CandidatePlan`.
    """
    if kernels and use_triton(sources):
        return make_kernel_plan(sources, indptr, indices, vocab_size, max_degree)
    return make_torch_plan(sources, indptr, indices, vocab_size)


def make_torch_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None,
                    vocab_size: int) -> CandidatePlan:
    """The torch path's plan (host-side group sizes: one synchronisation per call on a GPU)."""
    device = sources.device
    order = torch.argsort(sources, stable=True)
    sorted_src = sources[order]
    group_src, group_sizes_t = torch.unique_consecutive(sorted_src, return_counts=True)
    starts, ends = indptr[group_src], indptr[group_src + 1]
    block_sizes_t = ends - starts
    first_row = indptr[sorted_src]
    degree = indptr[sorted_src + 1] - first_row
    entry_start = torch.cumsum(degree, 0) - degree
    total = int(entry_start[-1] + degree[-1]) if degree.numel() else 0
    positions = torch.arange(sources.numel(), device=device)
    entry_position = torch.repeat_interleave(positions, degree, output_size=total)
    within = torch.arange(total, device=device) - entry_start[entry_position]
    edge = first_row[entry_position] + within  # CSR index of every packed energy's edge (its row − 1)
    entry_target = within if indices is None else indices[edge]
    entry_row = edge + 1
    plan = CandidatePlan(
        order=order,
        group_sizes=group_sizes_t.tolist(),
        block_starts=(starts + 1).tolist(),
        block_sizes=block_sizes_t.tolist(),
        degree=degree,
        entry_position=entry_position,
        entry_target=entry_target,
        entry_start=entry_start,
        has_shared=indices is not None,
        entry_row=entry_row,
    )
    if total and int(group_sizes_t.max()) > 1:
        # grouped order: inside a group's chunk, entry (successor s, i-th position) sits at s·m + i
        group_first = torch.cumsum(group_sizes_t, 0) - group_sizes_t  # first sorted position of each group
        group_of = torch.repeat_interleave(torch.arange(group_src.numel(), device=device), group_sizes_t,
                                           output_size=sources.numel())
        m = group_sizes_t[group_of][entry_position]
        i = (entry_position - group_first[group_of][entry_position])
        chunk_start = entry_start[group_first[group_of]][entry_position]
        packed_to_grouped = chunk_start + within * m + i
        grouped_to_packed = torch.empty_like(packed_to_grouped)
        grouped_to_packed[packed_to_grouped] = torch.arange(total, device=device)
        plan.packed_to_grouped = packed_to_grouped
        plan.grouped_to_packed = grouped_to_packed
        plan.grouped_position = entry_position[grouped_to_packed]
    return plan


def _energy(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = F.gelu(h)
    return y, torch.linalg.vector_norm(y, dim=-1)


def _energy_backward(h: torch.Tensor, y: torch.Tensor, e: torch.Tensor, grad_e: torch.Tensor) -> torch.Tensor:
    """d(‖GeLU(h)‖)/dh times grad_e, for h, y = GeLU(h) (..., d) and e = ‖y‖, grad_e (...)."""
    grad_y = (grad_e / e.clamp_min(torch.finfo(e.dtype).tiny)).unsqueeze(-1) * y
    return torch.ops.aten.gelu_backward(grad_y, h)


# ------------------------------------------------------------------------------------- buffer reuse
_WORKSPACES: dict = {}
_CACHE_MIN_BYTES = 1 << 20  # smaller buffers come from malloc's free lists anyway


def _workspace(name: str, shape, dtype, device) -> torch.Tensor:
    """An uninitialised tensor of `shape` carved from a cached buffer, reused once nothing else holds it.

    The gradient buffers of a step are hundreds of MB and the per-entry temporaries tens of MB; freshly
    allocated, every page faults in on first write (glibc maps such blocks anew, or trims them back to the
    OS after use), which on a VM costs more than the arithmetic (~1-5 GB/s). A buffer is reused only when its
    storage has no other reference (the optimizer step and `zero_grad()` have released the sparse gradient
    that lent it out; the backward has released the saved tensors); otherwise a new one is made and cached.
    """
    numel = 1
    for s in shape:
        numel *= s
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


# ------------------------------------------------------------------------------------- gradient link
class EdgeGradLink:
    """Hands the candidate backward's gradient buffers to the recurrence's `gather_edges` backward.

    Made per forward call; `gather_edges` records which rows it read, `candidate_energies` makes room for
    them in its gradient and publishes its buffers here; the gather's backward adds into them and clears.
    """

    def __init__(self):
        self.rows = None  # sorted unique rows the recurrence read
        self.grad = None  # (row index or None for dense, weight grad values, bias grad values) of this pass


class _GatherEdges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights, biases, rows, sparse_grad: bool, link):
        P = weights.shape[0]
        flat = rows.reshape(-1)
        w = weights.view(P, -1).index_select(0, flat).view(*rows.shape, *weights.shape[1:])
        b = biases.reshape(P, -1).index_select(0, flat).view(*rows.shape, biases.shape[-1])
        if link is not None:
            link.rows = torch.unique(flat)
            link.grad = None
        ctx.save_for_backward(flat)
        ctx.sparse_grad, ctx.link = sparse_grad, link
        ctx.w_shape, ctx.b_shape = weights.shape, biases.shape
        return w, b

    @staticmethod
    def backward(ctx, grad_w, grad_b):
        (flat,) = ctx.saved_tensors
        link, ctx.link = ctx.link, None
        P = ctx.w_shape[0]
        need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gw = None if grad_w is None else grad_w.reshape(flat.numel(), -1)
        gb = None if grad_b is None else grad_b.reshape(flat.numel(), -1)
        published = link.grad if link is not None else None
        if link is not None:
            link.grad = None
        if published is not None:
            index, w_values, b_values = published
            slot = flat if index is None else torch.searchsorted(index, flat)
            if need_w and gw is not None and w_values is not None:
                w_values.view(w_values.shape[0], -1).index_add_(0, slot, gw.to(w_values.dtype))
                need_w = False
            if need_b and gb is not None and b_values is not None:
                b_values.view(b_values.shape[0], -1).index_add_(0, slot, gb.to(b_values.dtype))
                need_b = False
            if not (need_w or need_b):
                return None, None, None, None, None
        out_w = out_b = None
        if ctx.sparse_grad:
            uniq, inverse = torch.unique(flat, return_inverse=True)
            index = uniq.unsqueeze(0)
            if need_w and gw is not None:
                vals = gw.new_zeros(uniq.numel(), gw.shape[1]).index_add_(0, inverse, gw)
                out_w = torch.sparse_coo_tensor(index, vals.view(-1, *ctx.w_shape[1:]), ctx.w_shape,
                                                is_coalesced=True, check_invariants=False)
            if need_b and gb is not None:
                vals = gb.new_zeros(uniq.numel(), gb.shape[1]).index_add_(0, inverse, gb)
                out_b = torch.sparse_coo_tensor(index, vals.view(-1, *ctx.b_shape[1:]), ctx.b_shape,
                                                is_coalesced=True, check_invariants=False)
        else:
            if need_w and gw is not None:
                out_w = gw.new_zeros(P, gw.shape[1]).index_add_(0, flat, gw).view(ctx.w_shape)
            if need_b and gb is not None:
                out_b = gb.new_zeros(P, gb.shape[1]).index_add_(0, flat, gb).view(ctx.b_shape)
        return out_w, out_b, None, None, None


def gather_edges(weights, biases, rows, sparse_grad: bool = False, link: EdgeGradLink | None = None):
    """`weights[rows]` (..., d, d) and `biases[rows]` (..., d) for the recurrence, with gradients of the shape of
    `weights` / `biases` (sparse COO over the distinct rows when `sparse_grad`, like `nn.Embedding(sparse=True)`).

    With a `link` also passed to `candidate_energies` of the same forward, these rows' gradients are added into
    the candidate gradient instead of forming a second tensor (see the module docstring).
    """
    return _GatherEdges.apply(weights, biases, rows, sparse_grad, link)


# ------------------------------------------------------------------------------------- candidate energies
def edge_table_grads(ctx, index, w_values, b_values, need_w: bool, need_b: bool, link):
    """The edge tables' gradients from the values of the touched rows `index` (sorted, unique): handed to `link`
    (see `gather_edges`), then returned as sparse COO tensors (`ctx.sparse_grad`) or as the dense values. Shared by
    the torch and the Triton backward."""
    if link is not None:
        link.grad = (index, w_values, b_values)
    if not ctx.sparse_grad:
        return w_values, None if b_values is None else b_values.view(ctx.bias_shape)
    idx = index.unsqueeze(0)
    grad_w = grad_b = None
    if need_w:
        grad_w = torch.sparse_coo_tensor(idx, w_values, ctx.weight_shape, is_coalesced=True, check_invariants=False)
    if need_b:
        grad_b = torch.sparse_coo_tensor(idx, b_values.view(-1, *ctx.bias_shape[1:]), ctx.bias_shape,
                                         is_coalesced=True, check_invariants=False)
    return grad_w, grad_b


class _CandidateEnergies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pe, weights, biases, plan: CandidatePlan, sparse_grad: bool, link):
        # x, pe: (N, d) in sorted order. Returns packed real-successor energies (M,) and shared energies (N,).
        N, d = x.shape
        P = weights.shape[0]
        b2 = biases.reshape(P, d)
        M = plan.num_entries
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
            h_shared = y_shared = None
            shared = x.new_zeros(N)
        ctx.plan, ctx.groups, ctx.sparse_grad, ctx.link = plan, groups, sparse_grad, link
        ctx.weight_shape, ctx.bias_shape = weights.shape, biases.shape
        ctx.save_for_backward(x, weights, v, h_shared, y_shared, shared)
        return energies, shared

    @staticmethod
    def backward(ctx, grad_energies, grad_shared):
        x, weights, v, h_shared, y_shared, shared = ctx.saved_tensors
        plan, groups, link = ctx.plan, ctx.groups, ctx.link
        ctx.link = None
        N, d = x.shape
        P = weights.shape[0]
        M = plan.num_entries
        device, dtype = x.device, x.dtype
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_params = need_w or need_b

        # gradient of every pre-activation, grouped order (M, d), and of the shared one (N, d)
        gh = gh_shared = None
        if M and grad_energies is not None:
            g = grad_energies if plan.grouped_to_packed is None else grad_energies[plan.grouped_to_packed]
            gh = torch.mul(v, g.to(dtype).unsqueeze(1), out=_workspace("gh", (M, d), dtype, device))
        if plan.has_shared and grad_shared is not None and N:
            gh_shared = _energy_backward(h_shared, y_shared, shared, grad_shared.to(dtype))

        ms = [m for _, m, _, _ in groups]
        ns = [n for _, _, _, n in groups]
        r0s = [r0 for _, _, r0, _ in groups]
        # where each block's rows go in the gradient: `first_slots[g]` (row of the values buffer, or of the
        # full gradient when dense); `index` the sorted edge rows of the sparse values buffer
        index = w_values = b_values = None
        first_slots, shared_slot = r0s, 0
        if need_params and ctx.sparse_grad:
            off = 1 if plan.has_shared else 0
            first_slots = []
            for n in ns:
                first_slots.append(off)
                off += n
            cand_rows = [torch.zeros(1, dtype=torch.long)] if plan.has_shared else []
            if groups:
                r0_t, n_t = torch.tensor(r0s), torch.tensor(ns)
                slots_t = torch.tensor(first_slots)
                cand_rows.append(torch.repeat_interleave(r0_t - slots_t, n_t, output_size=off - (1 if plan.has_shared else 0))
                                 + torch.arange(1 if plan.has_shared else 0, off))
            index = (torch.cat(cand_rows) if cand_rows else torch.zeros(0, dtype=torch.long)).to(device)
            covered_by_blocks = True
            extra = link.rows if link is not None else None
            if extra is not None and extra.numel():
                merged = torch.unique(torch.cat([index, extra.to(device)]))
                if merged.numel() != index.numel():  # the recurrence read rows outside the candidate blocks
                    index = merged
                    first_slots = torch.searchsorted(index, torch.tensor(r0s, dtype=torch.long, device=device)).tolist()
                    shared_slot = 0
                    covered_by_blocks = False
            R = index.numel()
            if need_w:
                w_values = _workspace("grad_w", (R, *ctx.weight_shape[1:]), dtype, device)
                if not covered_by_blocks:
                    covered = torch.zeros(R, dtype=torch.bool, device=device)
                    for s, n in zip(first_slots, ns):
                        covered[s:s + n] = True
                    w_values[~covered] = 0
                elif plan.has_shared and gh_shared is None:
                    w_values[0].zero_()
                if gh is None:
                    for s, n in zip(first_slots, ns):
                        w_values[s:s + n].zero_()
            if need_b:
                b_values = _workspace("grad_b", (R, d), dtype, device).zero_()
        elif need_params:
            w_values = weights.new_zeros(ctx.weight_shape) if need_w else None
            b_values = weights.new_zeros(P, d) if need_b else None

        grad_x = torch.zeros_like(x) if need_x else None
        if gh is not None and (need_x or need_w or need_b):
            sizes = [m * n for m, n in zip(ms, ns)]
            ghs = gh.split(sizes)
            if need_w:
                xs = x.split(plan.group_sizes)
                for (i, m, r0, n), ghg, slot in zip(groups, ghs, first_slots):
                    if m == 1:  # outer products x ⊗ gh_r: a broadcast multiply beats a K=1 bmm
                        torch.mul(xs[i].view(1, d, 1), ghg.view(n, 1, d), out=w_values[slot:slot + n])
                    else:
                        torch.bmm(xs[i].t().expand(n, d, m), ghg.view(n, m, d), out=w_values[slot:slot + n])
            if need_x:  # dE/dx = W·(dE/dh), summed over the successors of each position
                gx = _workspace("gx", (M, d), dtype, device)
                for (i, m, r0, n), ghg, gxg in zip(groups, ghs, gx.split(sizes)):
                    torch.bmm(ghg.view(n, m, d), weights[r0:r0 + n].transpose(1, 2), out=gxg.view(n, m, d))
                grad_x.index_add_(0, plan.grouped_positions(), gx)
            if need_b:
                # every entry adds into its edge row: slot = first slot of its block + its successor index
                n_t = torch.tensor(ns, dtype=torch.long)
                block_first_entry = torch.cumsum(n_t, 0) - n_t
                row_slot = (torch.repeat_interleave(torch.tensor(first_slots, dtype=torch.long) - block_first_entry, n_t,
                                                    output_size=int(n_t.sum())) + torch.arange(int(n_t.sum())))
                if plan.grouped_position is not None:
                    row_slot = torch.repeat_interleave(row_slot, torch.repeat_interleave(torch.tensor(ms), n_t), output_size=M)
                b_values.index_add_(0, row_slot.to(device), gh)

        if gh_shared is not None:
            if need_w:
                torch.mm(x.t(), gh_shared, out=w_values[shared_slot])
            if need_b:
                b_values[shared_slot] += gh_shared.sum(0)
            if need_x:
                grad_x.addmm_(gh_shared, weights[0].t())

        grad_w = grad_b = None
        if need_params:
            grad_w, grad_b = edge_table_grads(ctx, index, w_values, b_values, need_w, need_b, link)
        return grad_x, None, grad_w, grad_b, None, None, None


def candidate_energies(x, pe, weights, biases, plan: CandidatePlan, sparse_grad: bool = False,
                       link: EdgeGradLink | None = None, non_edge_bias=None):
    """Energies of every real successor (packed, see `CandidatePlan`) and the shared energy of every position.

    `x` and `pe` are (N, d) in the plan's sorted order; `biases` is (P, d) or (P, 1, d). With `sparse_grad`, the
    gradients of `weights` and `biases` are sparse COO tensors over the touched rows (coalesced), as
    `nn.Embedding(sparse=True)` gives. `link`: see `gather_edges`. With a `KernelPlan` the first result is the (N, T)
    tile log-sum-exps instead (see the module docstring); pass it on to the functions below unchanged.
    `non_edge_bias`: the model's (V,) offsets when it has them, the same tensor later given to `scatter_logits`: on
    the kernel path the logits' gradient reaches it through this call's backward (the torch path ignores it here).
    """
    if _runs_kernels(plan, weights, x):
        return _kernels().KernelEnergies.apply(x, pe, weights, biases, plan, sparse_grad, link, non_edge_bias)
    return _CandidateEnergies.apply(x, pe, weights, biases, _torch_plan(plan), sparse_grad, link)


def scatter_logits(energies, shared, plan: CandidatePlan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """Full (N, V) logits in sorted order: the shared energy everywhere (plus `non_edge_bias[v]` (V,) when the
    model has one), real successors' energies on top."""
    if _runs_kernels(plan):
        return _kernels().scatter_logits(energies, shared, plan, non_edge_bias)
    plan = _torch_plan(plan)
    n = shared.shape[0]
    if non_edge_bias is None:
        logits = shared.unsqueeze(1).expand(n, vocab_size).contiguous()
    else:
        logits = shared.unsqueeze(1) + non_edge_bias.to(shared.dtype).unsqueeze(0)
    return logits.index_put((plan.entry_position, plan.entry_target), energies)


def successor_logits(x, pe, weights, biases, sources, indptr, indices, vocab_size: int,
                     non_edge_bias=None, *, kernels: bool = True) -> torch.Tensor:
    """(N, V) energies of every node as the successor of each position, in the given order; inference only.

    The decoding hot path: no plan or autograd for a single position (one `baddbmm` over its source's block,
    written into a row of shared energies); several positions go through the grouped path. `x`, `pe` (N, d);
    `sources` (N,) current nodes; `indices=None` means a dense graph. Equals `scatter_logits` of
    `candidate_energies` (un-sorted). With the Triton backend: one kernel launch (`kernels=False` keeps torch).
    """
    with torch.no_grad():
        N, d = x.shape
        P = weights.shape[0]
        b2 = biases.reshape(P, d)
        if kernels and use_triton(x) and _kernels().unsupported_reason(weights, x) is None:
            max_degree = vocab_size if indices is None else graph_max_degree(indptr)
            return _kernels().successor_logits(x, pe, weights, b2, sources, indptr, indices, vocab_size, max_degree,
                                               non_edge_bias)
        if N == 1:
            u = int(sources[0])
            a, b = int(indptr[u]), int(indptr[u + 1])
            if indices is None:
                logits = x.new_empty(1, vocab_size)
            else:
                shared = _energy(torch.addmm(b2[0] + pe, x, weights[0]))[1]
                logits = shared.expand(1, vocab_size).clone()
                if non_edge_bias is not None:
                    logits += non_edge_bias.to(logits.dtype)
            if b > a:
                n = b - a
                h = torch.baddbmm(b2[a + 1:b + 1].unsqueeze(1), x.expand(n, 1, d), weights[a + 1:b + 1]).view(n, d)
                h += pe
                energies = _energy(h)[1]
                if indices is None:
                    logits[0, :n] = energies
                else:
                    logits[0].index_copy_(0, indices[a:b], energies)
            return logits
        plan = make_plan(sources, indptr, indices, vocab_size, kernels=kernels)
        energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan)
        logits = torch.empty(N, vocab_size, dtype=energies.dtype, device=x.device)
        logits[plan.order] = scatter_logits(energies, shared, plan, vocab_size, non_edge_bias)
        return logits


def successor_logits_static(x, pe, weights, biases, sources, indptr, indices, vocab_size: int,
                            max_degree: int, non_edge_bias=None) -> torch.Tensor:
    """`successor_logits` with no host synchronisation and shapes fixed by (N, max_degree): the decode step that
    `decode_capture` records into a CUDA graph (and that runs on `device="meta"`). `max_degree` is the graph's largest
    number of real successors (`graph_max_degree`, V for a dense graph); `non_edge_bias` (V,) is added to the
    non-successors' shared energy when given.

    Triton: one kernel launch over a static (N, tiles) grid. Torch: every position gathers `max_degree` edge rows
    from the start of its block (rows past its degree are computed and dropped into a spare column), so it reads
    N · max_degree · d² weights: meant for small batches, the meta check and GPUs without Triton.
    """
    with torch.no_grad():
        N, d = x.shape
        P = weights.shape[0]
        b2 = biases.reshape(P, d)
        if use_triton(x) and _kernels().unsupported_reason(weights, x) is None:
            return _kernels().successor_logits(x, pe, weights, b2, sources, indptr, indices, vocab_size, max_degree,
                                               non_edge_bias)
        if indices is None:
            logits = x.new_zeros(N, vocab_size + 1)  # every column is a real successor
        else:
            shared = _energy(torch.addmm(b2[0] + pe, x, weights[0]))[1]
            logits = shared.unsqueeze(1).expand(N, vocab_size + 1).contiguous()
            if non_edge_bias is not None:
                logits[:, :vocab_size] += non_edge_bias.to(logits.dtype)
        if max_degree and P > 1:
            first = indptr[sources]
            j = torch.arange(max_degree, device=x.device)
            real = j < (indptr[sources + 1] - first).unsqueeze(1)  # (N, K)
            edge = torch.where(real, first.unsqueeze(1) + j, torch.zeros_like(j))  # CSR index; 0 where not real
            h = torch.matmul(x[:, None, None, :], weights[edge + 1]).squeeze(2) + b2[edge + 1] + pe.unsqueeze(1)
            energies = _energy(h)[1]  # (N, K)
            target = j.expand(N, max_degree) if indices is None else indices[edge]
            logits.scatter_(1, torch.where(real, target, vocab_size), energies)
        return logits[:, :vocab_size]


def non_edge_log_mass(non_edge_bias, plan: CandidatePlan | KernelPlan) -> torch.Tensor:
    """log Σ_{v not a real successor} exp(non_edge_bias[v]) per sorted position (N,): all nodes' sum minus the
    position's real successors', in float64 (the subtraction keeps ~1e-16 of the total); -inf-like where every
    node is a successor.

    A `KernelPlan` has no per-entry tensors (their number is data-dependent): the sum is taken per node over the
    CSR (E edges, sizes known from the graph, no host read) and gathered by each position's source; the same terms
    in the same (CSR) order as the torch plan's per-position sum."""
    b = non_edge_bias.double()
    top = b.max().detach()
    w = torch.exp(b - top)
    if isinstance(plan, KernelPlan):
        V = plan.vocab_size
        node_degree = plan.indptr[1:] - plan.indptr[:-1]
        if plan.indices is None:  # dense: every node is a successor
            node_succ = w.sum().expand(V)
        else:
            E = plan.indices.numel()
            edge_source = torch.repeat_interleave(torch.arange(V, device=w.device), node_degree, output_size=E)
            node_succ = w.new_zeros(V).index_add(0, edge_source, w[plan.indices])
        node_mass = torch.log((w.sum() - node_succ).clamp_min(1e-300)) + top
        return node_mass[plan.sources[plan.order]]
    succ = w.new_zeros(plan.degree.numel())
    if plan.num_entries:
        succ = succ.index_add(0, plan.entry_position, w[plan.entry_target])
    return torch.log((w.sum() - succ).clamp_min(1e-300)) + top


def exact_log_partition(energies, shared, plan: CandidatePlan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """log Σ_v exp(E_v) over all V nodes per position, with the V − degree non-successors sharing one energy
    (each plus its own `non_edge_bias[v]` when given).

    Cost follows the real successors (M packed energies), not N·V.
    """
    if _runs_kernels(plan):
        log_mass = None
        if non_edge_bias is not None and plan.has_shared:  # the non-successors' weight, log(V − degree) without it
            log_mass = non_edge_log_mass(non_edge_bias, plan).to(torch.float32)
        return _kernels().log_partition(energies, shared, plan, vocab_size, log_mass)
    plan = _torch_plan(plan)
    if non_edge_bias is not None and plan.has_shared:
        has_shared = plan.degree < vocab_size
        shared_term = shared + non_edge_log_mass(non_edge_bias, plan).to(shared.dtype)
        peak = torch.where(has_shared, shared_term, torch.full_like(shared, float("-inf")))
        if plan.num_entries:
            peak = peak.scatter_reduce(0, plan.entry_position, energies, "amax", include_self=True)
        peak = peak.detach()
        total = torch.where(has_shared, torch.exp(shared_term - peak), torch.zeros_like(shared))
        if plan.num_entries:
            total = total.index_add(0, plan.entry_position, torch.exp(energies - peak[plan.entry_position]))
        return peak + torch.log(total)
    num_shared = (vocab_size - plan.degree).to(shared.dtype)
    has_shared = num_shared > 0
    peak = torch.where(has_shared, shared, torch.full_like(shared, float("-inf")))
    if plan.num_entries:
        peak = peak.scatter_reduce(0, plan.entry_position, energies, "amax", include_self=True)
    peak = peak.detach()
    total = torch.where(has_shared, num_shared * torch.exp(shared - peak), torch.zeros_like(shared))
    if plan.num_entries:
        total = total.index_add(0, plan.entry_position, torch.exp(energies - peak[plan.entry_position]))
    return peak + torch.log(total)


def target_energies(energies, shared, plan: CandidatePlan, targets: torch.Tensor, target_rows, block_first_row,
                    non_edge_bias=None):
    """Energy each sorted position gives its target node: the real edge's, or the shared one (plus
    `non_edge_bias[target]` when given).

    `target_rows` (N,) are the edge rows of source→target (0 = shared); `block_first_row` (N,) the first row of
    each position's block.
    """
    if _runs_kernels(plan):
        if non_edge_bias is not None:  # a non-edge target's energy; autograd takes the bias's gradient from here
            shared = shared + non_edge_bias.to(shared.dtype)[targets]
        return _kernels().target_energies(energies, shared, plan, target_rows, block_first_row)
    plan = _torch_plan(plan)
    real = target_rows > 0
    entry = plan.entry_start + (target_rows - block_first_row).clamp_min(0)
    picked = energies[entry.clamp_max(max(plan.num_entries - 1, 0))] if plan.num_entries else shared
    if non_edge_bias is not None:
        shared = shared + non_edge_bias.to(shared.dtype)[targets]
    return torch.where(real, picked, shared)


__all__ = [
    "CandidatePlan",
    "KernelPlan",
    "make_kernel_plan",
    "make_torch_plan",
    "graph_max_degree",
    "EdgeGradLink",
    "make_plan",
    "candidate_energies",
    "gather_edges",
    "scatter_logits",
    "successor_logits",
    "successor_logits_static",
    "exact_log_partition",
    "non_edge_log_mass",
    "target_energies",
    "release_workspaces",
]
