"""Which process owns which source nodes (balanced by expected work), and the bytes a process then holds."""

from __future__ import annotations

import heapq
import math

import torch


def graph_csr(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indptr, indices) of the model's graph on the CPU (works while the edge table is on the meta device)."""
    V = model.config.vocab_size
    if model.config.graph == "dense":
        return torch.arange(V + 1) * V, None
    return model.base_model.graph_indptr.cpu(), model.base_model.graph_indices.cpu()


def source_costs(model, source_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Expected work of every source node, float64 (V,): (uses + 1) x (real successors + 1), the uses from
    `source_counts` (V,) when given, else the graph's bigram counts (a dense graph without counts: all alike)."""
    V, degree = model.config.vocab_size, graph_csr(model)[0].diff()
    uses = torch.zeros(V, dtype=torch.float64)
    if source_counts is not None:
        uses = torch.as_tensor(source_counts, dtype=torch.float64).cpu()
        if uses.shape != (V,):
            raise ValueError(f"source_counts must have shape ({V},), got {tuple(uses.shape)}.")
    elif model.config.graph == "sparse":
        src = torch.repeat_interleave(torch.arange(V), degree)
        uses.index_add_(0, src, model.base_model.graph_counts.cpu().double())
    return (uses + 1) * (degree.double() + 1)


def balance_sources(costs: torch.Tensor, num_shards: int, degree: torch.Tensor | None = None) -> torch.Tensor:
    """Owner (V,) of every source: greedy longest-processing-time (each source, in falling cost order, to the least
    loaded shard), the sources without successors (no rows) spread last."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    order = torch.argsort(costs, descending=True, stable=True).tolist()
    if degree is not None:  # row-holding sources first, so every shard gets some when there are enough
        has_rows = (degree > 0).tolist()
        order = [u for u in order if has_rows[u]] + [u for u in order if not has_rows[u]]
    owners = torch.empty(costs.numel(), dtype=torch.long)
    heap = [(0.0, shard) for shard in range(num_shards)]
    cost = costs.tolist()
    for u in order:
        load, shard = heapq.heappop(heap)
        owners[u] = shard
        heapq.heappush(heap, (load + cost[u], shard))
    return owners


def check_assignment(owners: torch.Tensor, degree: torch.Tensor, world_size: int):
    """Raise a clear error when `owners` does not fit this graph and process count (the same on every process:
    it reads only what all of them hold, so none is left waiting in a collective)."""
    V = degree.numel()
    if owners.shape != (V,):
        raise ValueError(f"the source assignment has shape {tuple(owners.shape)}, expected ({V},) "
                         "(one owner per node).")
    if owners.numel() and (int(owners.min()) < 0 or int(owners.max()) >= world_size):
        raise ValueError(f"the source assignment names processes outside 0..{world_size - 1}.")
    rows = torch.zeros(world_size, dtype=torch.long).index_add_(0, owners.cpu(), degree.cpu())
    empty = (rows == 0).nonzero().flatten().tolist()
    if empty:
        sources = int((degree > 0).sum())
        raise ValueError(
            f"with {world_size} processes, process(es) {empty} would own no edge rows: only {sources} source nodes "
            f"have real successors. Use at most {sources} processes (or a larger graph)."
        )


def sharded_memory(config, world_size: int, global_tokens: int = 8192, imbalance: float = 1.25,
                   optimizer_state: bool = True, moment_bytes: int = 8) -> dict:
    """Bytes per process in fp32, by part, for the busiest one (its positions: `global_tokens` / world size x
    `imbalance`); `moment_bytes`: the two AdamW moments per parameter (8 in float32, 4 in bfloat16)."""
    V, d, P = config.vocab_size, config.node_size, config.num_edge_rows
    row = 4 * (d * d + d)
    degree = V if config.graph == "dense" else max(1, (P - 1) // max(V, 1))
    rows = (P - 1 + world_size - 1) // world_size + degree
    scored = math.ceil(global_tokens / world_size * imbalance)
    parts = {"edge rows (weights + biases)": rows * row}
    if optimizer_state:
        parts["AdamW moments"] = moment_bytes * rows * row // 4
    parts["row gradients (touched rows, at most the share)"] = rows * row
    every_node = getattr(config, "node_readout", False) or getattr(config, "count_prior", False)
    parts["candidate workspace"] = 5 * 4 * scored * degree * d + (2 * 4 * scored * V if every_node else 0)
    parts["fetched rows + their gradients"] = 2 * math.ceil(global_tokens / world_size) * row
    sparse = config.graph == "sparse"
    extra = (V * (getattr(config, "non_edge_bias", False) and sparse) + V * d * getattr(config, "node_readout", False)
             + d * d * getattr(config, "edge_backoff", False) + V * d * getattr(config, "node_embedding", False))
    parts["replicated (node_bias, positions, shared edge, extensions) + moments"] = (4 + moment_bytes) * (
        V * d + config.max_position_embeddings + d * d + d + extra)
    if getattr(config, "count_prior", False):  # fixed tables: V node values, K bigrams (index + value)
        parts["count prior"] = 4 * V + 12 * getattr(config, "count_prior_bigrams", 0)
    parts["total"] = sum(parts.values())
    return parts
