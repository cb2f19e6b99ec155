"""Which edge rows each position reads (`CandidatePlan` for the torch path, `KernelPlan` for the kernels' tiles), and
the hand-over of the candidate backward's gradient buffers to the recurrence's (`EdgeGradLink`)."""

from dataclasses import dataclass

import torch


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
    # the successor-major (grouped) order the computation runs in; None = the packed order
    grouped_to_packed: torch.Tensor | None = None  # (M,) packed index of every grouped-order entry
    packed_to_grouped: torch.Tensor | None = None  # (M,) grouped index of every packed entry
    grouped_position: torch.Tensor | None = None  # (M,) sorted position of every grouped-order entry
    entry_row: torch.Tensor | None = None  # (M,) edge row of every packed energy

    num_entries = property(lambda self: self.entry_target.numel())  # packed (position, real successor) energies M

    def grouped_positions(self) -> torch.Tensor:
        """Sorted position of every entry in the grouped (successor-major) order."""
        return self.entry_position if self.grouped_position is None else self.grouped_position

    def grouped_rows(self) -> torch.Tensor:
        """Edge row of every entry in the grouped order."""
        return self.entry_row if self.grouped_to_packed is None else self.entry_row[self.grouped_to_packed]


KERNEL_TILE_SUCCESSORS = 32  # successors per work tile of the Triton kernels (a multiple of their sub-tile, 4)


@dataclass
class KernelPlan:
    """Work tiles of the Triton kernels, built on the device with static shapes: a present source u owns ceil(degree /
    tile_successors) tiles of its successors; tile t is the (t − tile_first[u])-th of u = tile_source[t]."""

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
    call: object | None = None  # the last candidate_energies call on this plan (triton_energy.KernelCall)


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
                     max_degree: int | None = None) -> KernelPlan:
    """`KernelPlan` of positions on `sources` (N,), its sizes from N and V alone (runs on "meta", in CUDA graphs)."""
    device, V, N = sources.device, vocab_size, sources.numel()
    tile_successors = KERNEL_TILE_SUCCESSORS  # read at call time (tests shrink it)
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
    return KernelPlan(order=order, sources=sources, degree=node_degree[sources[order]], count=count,
                      group_start=group_start, tile_first=tile_end - tiles,
                      tile_total=tile_end[-1:] if V else torch.zeros(1, dtype=torch.int32, device=device),
                      tile_source=tile_source.to(torch.int32), indptr=indptr, indices=indices, vocab_size=V,
                      has_shared=indices is not None, num_tiles=num_tiles, tile_successors=tile_successors)


def make_torch_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None,
                    vocab_size: int) -> CandidatePlan:
    """The torch path's plan (host-side group sizes: one synchronisation per call on a GPU)."""
    device = sources.device
    order = torch.argsort(sources, stable=True)
    sorted_src = sources[order]
    group_src, group_sizes_t = torch.unique_consecutive(sorted_src, return_counts=True)
    starts = indptr[group_src]
    block_sizes_t = indptr[group_src + 1] - starts
    first_row = indptr[sorted_src]
    degree = indptr[sorted_src + 1] - first_row
    entry_start = torch.cumsum(degree, 0) - degree
    total = int(entry_start[-1] + degree[-1]) if degree.numel() else 0
    entry_position = torch.repeat_interleave(torch.arange(sources.numel(), device=device), degree, output_size=total)
    within = torch.arange(total, device=device) - entry_start[entry_position]
    edge = first_row[entry_position] + within  # CSR index of every packed energy's edge (its row − 1)
    entry_target = within if indices is None else indices[edge]
    plan = CandidatePlan(order=order, group_sizes=group_sizes_t.tolist(), block_starts=(starts + 1).tolist(),
                         block_sizes=block_sizes_t.tolist(), degree=degree, entry_position=entry_position,
                         entry_target=entry_target, entry_start=entry_start, has_shared=indices is not None,
                         entry_row=edge + 1)
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
        plan.packed_to_grouped, plan.grouped_to_packed = packed_to_grouped, grouped_to_packed
        plan.grouped_position = entry_position[grouped_to_packed]
    return plan


@dataclass(eq=False)
class EdgeGradLink:
    """Made per forward call: the recurrence records the rows it read, the candidate backward makes room for them
    in its gradient and publishes its buffers here, the recurrence's backward adds into them and clears."""

    rows: torch.Tensor | None = None  # sorted rows the recurrence read
    grad: tuple | None = None  # (row index or None for dense, weight grad values, bias grad values) of this pass


def edge_table_grads(ctx, index, w_values, b_values, need_w: bool, need_b: bool, link):
    """The edge tables' gradients (sparse COO or dense) from the touched rows' values, published on `link` too."""
    if link is not None:
        link.grad = (index, w_values, b_values)
    if not ctx.sparse_grad:
        return w_values, None if b_values is None else b_values.view(ctx.bias_shape)
    coo = lambda values, shape: torch.sparse_coo_tensor(index.unsqueeze(0), values.view(-1, *shape[1:]), shape,
                                                        is_coalesced=True, check_invariants=False)
    return coo(w_values, ctx.weight_shape) if need_w else None, coo(b_values, ctx.bias_shape) if need_b else None

