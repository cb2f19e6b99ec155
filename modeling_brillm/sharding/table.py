"""What each process holds: the owner of every source (balanced by expected work) and its bytes, the local table of
the row-indexed parameters (row 0, then owned sources' rows at global row + `local_offset[source]`), the transport."""

import heapq
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..energy import sparse_rows
from ..ops import gather_edges


def graph_csr(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indptr, indices) of the model's graph on the CPU (works while the edge table is on the meta device)."""
    V = model.config.vocab_size
    if model.config.graph == "dense":
        return torch.arange(V + 1) * V, None
    return model.base_model.graph_indptr.cpu(), model.base_model.graph_indices.cpu()


def source_costs(model) -> torch.Tensor:
    """Expected work of every source node, float64 (V,): (bigram count + 1) x (real successors + 1)."""
    V, degree = model.config.vocab_size, graph_csr(model)[0].diff()
    uses = torch.zeros(V, dtype=torch.float64)
    if model.config.graph == "sparse":
        src = torch.repeat_interleave(torch.arange(V), degree)
        uses.index_add_(0, src, model.base_model.graph_counts.cpu().double())
    return (uses + 1) * (degree.double() + 1)


def balance_sources(costs: torch.Tensor, num_shards: int, degree: torch.Tensor) -> torch.Tensor:
    """Owner (V,) of every source: longest-processing-time greedy, the sources without successors spread last."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    order, has_rows = torch.argsort(costs, descending=True, stable=True).tolist(), (degree > 0).tolist()
    order = [u for u in order if has_rows[u]] + [u for u in order if not has_rows[u]]  # rows for every shard
    owners, cost = torch.empty(costs.numel(), dtype=torch.long), costs.tolist()
    heap = [(0.0, shard) for shard in range(num_shards)]
    for u in order:
        load, shard = heapq.heappop(heap)
        owners[u] = shard
        heapq.heappush(heap, (load + cost[u], shard))
    return owners


def check_assignment(owners: torch.Tensor, degree: torch.Tensor, world_size: int):
    """A clear error when `owners` does not fit this graph and process count, the same on every process (none waits)."""
    V = degree.numel()
    if owners.shape != (V,):
        raise ValueError(f"the source assignment has shape {tuple(owners.shape)}, expected ({V},) "
                         "(one owner per node).")
    if owners.numel() and (int(owners.min()) < 0 or int(owners.max()) >= world_size):
        raise ValueError(f"the source assignment names processes outside 0..{world_size - 1}.")
    rows = torch.zeros(world_size, dtype=torch.long).index_add_(0, owners.cpu(), degree.cpu())
    if empty := (rows == 0).nonzero().flatten().tolist():
        sources = int((degree > 0).sum())
        raise ValueError(f"with {world_size} processes, process(es) {empty} would own no edge rows: only {sources} "
                         f"source nodes have real successors. Use at most {sources} processes (or a larger graph).")


def sharded_memory(config, world_size: int, global_tokens: int = 8192, moment_bytes: int = 8) -> dict:
    """Bytes per process in fp32, by part, for the busiest one (its positions: `global_tokens` / world size x 1.25);
    `moment_bytes`: the two AdamW moments per parameter (8 in float32, 4 in bfloat16)."""
    V, d, P, sparse = config.vocab_size, config.node_size, config.num_edge_rows, config.graph == "sparse"
    row, degree = 4 * (d * d + d), V if not sparse else max(1, (P - 1) // max(V, 1))
    rows, scored = (P - 1 + world_size - 1) // world_size + degree, math.ceil(global_tokens / world_size * 1.25)
    every_node = config.node_readout or config.count_prior
    extra = (V * (config.non_edge_bias and sparse) + V * d * config.node_readout + d * d * config.edge_backoff
             + V * d * config.node_embedding)
    parts = {"edge rows (weights + biases)": rows * row, "AdamW moments": moment_bytes * rows * row // 4,
             "row gradients (touched rows, at most the share)": rows * row,
             "candidate workspace": 5 * 4 * scored * degree * d + (2 * 4 * scored * V if every_node else 0),
             "fetched rows + their gradients": 2 * math.ceil(global_tokens / world_size) * row,
             "replicated (node_bias, positions, shared edge, extensions) + moments": (4 + moment_bytes) * (
                 V * d + config.max_position_embeddings + d * d + d + extra)}
    if config.count_prior:  # fixed tables: V node values, K bigrams (index + value)
        parts["count prior"] = 4 * V + 12 * config.count_prior_bigrams
    parts["total"] = sum(parts.values())
    return parts


def replicated_parameters(base_model, row_names) -> list[tuple[str, nn.Parameter]]:  # all but the row-indexed ones
    return [(n, p) for n, p in base_model.named_parameters() if n not in row_names]


def global_rows_of(sources: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """The global edge rows (> 0) of the blocks of `sources`, in the given order."""
    starts, sizes = indptr[sources] + 1, indptr[sources + 1] - indptr[sources]
    total = int(sizes.sum())
    first = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
    return first + torch.arange(total)


class Transport:
    """The collectives (none with one process), counting the bytes sent to others."""

    def __init__(self):
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.bytes_sent = 0

    def _count(self, send_counts: list[int], row_bytes: int):
        self.bytes_sent += row_bytes * (sum(send_counts) - send_counts[self.rank])

    def route(self, dest: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The order grouping items bound for processes `dest` by destination, the counts sent to and from each."""
        order, send = torch.argsort(dest, stable=True), torch.bincount(dest, minlength=self.world)
        recv = send if self.world == 1 else torch.empty_like(send)
        if self.world > 1:
            dist.all_to_all_single(recv, send)
            self._count([1] * self.world, send.element_size())
        return order, send.tolist(), recv.tolist()

    def exchange(self, tensor: torch.Tensor, send: list[int], recv: list[int], differentiable: bool) -> torch.Tensor:
        """Rows `tensor[sum(send[:r]):...]` go to process r; the rows received, by sending process. Differentiable:
        the backward sends the received rows' gradients back."""
        if self.world == 1:
            return tensor
        row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
        self._count(send, row_bytes)
        out = tensor.new_empty(sum(recv), *tensor.shape[1:])
        if not differentiable:
            dist.all_to_all_single(out, tensor.contiguous(), recv, send)
            return out
        from torch.distributed.nn.functional import all_to_all_single

        self._count(recv, row_bytes)  # the backward's rows
        with warnings.catch_warnings():  # deprecated in favour of a functional collective without autograd
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_to_all_single")
            return all_to_all_single(out, tensor.contiguous(), recv, send)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the processes, in place."""
        if self.world > 1:
            dist.all_reduce(tensor)
            self.bytes_sent += 2 * tensor.numel() * tensor.element_size() * (self.world - 1) // self.world  # ring
        return tensor

    def to_main(self, tensors: list[torch.Tensor], rank: int):
        """Process `rank`'s `tensors` into process 0's (buffers of the same shapes); a no-op elsewhere."""
        if rank == 0 or self.rank not in (0, rank):
            return
        for t in tensors:
            if self.rank == rank:
                dist.send(t.contiguous(), 0)
            else:
                dist.recv(t, rank)

    def barrier(self):
        if self.world > 1:
            dist.barrier()


class LocalTable(nn.Module):
    """The rows this process holds (of the sources `owners` gives it, balanced when None) and how global rows map to
    them (buffers: `.to(device)` moves them); built, it cuts the model's row-indexed parameters to them."""

    def __init__(self, model, owners: torch.Tensor | None, rank: int, world_size: int):
        super().__init__()
        (indptr, indices), base_model = graph_csr(model), model.base_model
        owners = balance_sources(source_costs(model), world_size, indptr.diff()) if owners is None else owners
        owners = torch.as_tensor(owners, dtype=torch.long).cpu()
        check_assignment(owners, indptr.diff(), world_size)
        self.names, device = tuple(base_model.edge_row_parameters), base_model.node_bias.device
        self.rank, owned = rank, owners == rank
        local_indptr = torch.cat([torch.zeros_like(indptr[:1]), torch.cumsum(torch.where(owned, indptr.diff(), 0), 0)])
        local_rows = global_rows_of(owned.nonzero().flatten(), indptr)  # (R,) global rows, ascending
        buffers = {"owners": owners, "local_offset": local_indptr[:-1] - indptr[:-1], "local_indptr": local_indptr,
                   "global_indptr": indptr, "local_indices": None if indices is None else indices[local_rows - 1]}
        for name, value in buffers.items():
            self.register_buffer(name, None if value is None else value.to(device), persistent=False)
        keep = torch.cat([torch.zeros(1, dtype=torch.long), local_rows])
        for name in self.names:
            p = getattr(base_model, name).detach()
            rows = (torch.empty(len(keep), *p.shape[1:], device=device) if p.device.type == "meta"
                    else p.index_select(0, keep.to(p.device)).to(device))
            setattr(base_model, name, nn.Parameter(rows))

    def owned_sources(self) -> torch.Tensor:
        return (self.owners == self.rank).nonzero().flatten().cpu()

    def source_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Source node of global edge rows (> 0)."""
        if self.local_indices is None:  # dense: row = 1 + u·V + v
            return (rows - 1) // (self.global_indptr.numel() - 1)
        return torch.searchsorted(self.global_indptr, rows - 1, right=True) - 1

    def fetch(self, base_model, transport, rows: torch.Tensor, link, anchors: list) -> list[torch.Tensor]:
        """`edge_fetch`: one (B, L, *row shape) tensor per row-indexed parameter of the (B, L) global `rows`, from their
        owners (ids there, rows back, gradients back again); `anchors` collects what arrived, for the loss's graph."""
        params = [getattr(base_model, name) for name in self.names]
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        dest = torch.where(uniq > 0, self.owners[self.source_of_rows(uniq.clamp_min(1))],
                           torch.full_like(uniq, self.rank))  # row 0 is replicated: served locally
        order, send, recv = transport.route(dest)
        wanted = transport.exchange(uniq[order], send, recv, differentiable=False)  # global rows of owned sources
        src = self.source_of_rows(wanted.clamp_min(1))
        wanted = torch.where(wanted > 0, wanted + self.local_offset[src], torch.zeros_like(wanted))  # local; 0 stays
        # gather_edges: their gradient joins the candidate gradient (`link`); other tables as the model's _fetch_rows
        served = (gather_edges(*params, wanted, True, link) if self.names == ("weights", "biases") else
                  [sparse_rows(p, wanted) for p in params])
        widths = [math.prod(p.shape[1:]) for p in params]
        payload = torch.cat([t.reshape(wanted.numel(), n) for t, n in zip(served, widths)], 1)
        got = transport.exchange(payload, recv, send, differentiable=True)
        anchors.append(got)
        steps = got.index_select(0, torch.argsort(order)).index_select(0, inverse)  # back to `rows` order
        return [t.reshape(*rows.shape, *p.shape[1:]) for t, p in zip(steps.split(widths, 1), params)]
