"""The BriLLM graph: which edges u→v are real, stored as CSR by source (row 0 of the edge tables is shared).

Edge table row of the j-th real edge (in (source, target) order) is j + 1; every pair u→v that is not a
real edge uses row 0, the shared edge. A dense graph has every pair real: row of u→v is 1 + u·V + v.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .count_prior import CountPrior, count_prior


@dataclass
class BigramGraph:
    """A sparse graph in CSR form: successors of u are `indices[indptr[u]:indptr[u+1]]`, sorted."""

    indptr: torch.Tensor  # (V + 1,) int64
    indices: torch.Tensor  # (E,) int64 target node of every real edge
    counts: torch.Tensor  # (E,) int64 bigram count of every real edge (0 when unknown)
    prior: CountPrior | None = None  # the count prior of every bigram seen, edge or not (config.count_prior)

    @property
    def vocab_size(self) -> int:
        """Number of nodes V."""
        return self.indptr.numel() - 1

    @property
    def num_edges(self) -> int:
        """Number of real edges E."""
        return self.indices.numel()


def count_bigrams(
    sequences: Iterable, vocab_size: int, ignore_ids: Iterable[int] = (), chunk_tokens: int = 1 << 22
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count every bigram u→v of the token-id sequences; returns sorted keys u·V+v and their counts.

    `ignore_ids` (padding, say) never form an edge. Counting is vectorised per chunk of sequences (one flat tensor,
    the pairs across two sequences dropped) and merged, so a corpus of hundreds of millions of tokens needs memory
    for its distinct bigrams only, and a sequence costs one append.
    """
    ignore = torch.tensor(sorted(set(int(i) for i in ignore_ids)), dtype=torch.long)
    keys = torch.empty(0, dtype=torch.long)
    counts = torch.empty(0, dtype=torch.long)
    pending, lengths = [], []

    def flush():
        """Count the pending chunk and merge its bigrams into the running (keys, counts)."""
        nonlocal keys, counts, pending, lengths
        if not pending:
            return
        flat = torch.cat(pending)
        low, high = torch.aminmax(flat)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"token id out of range: sequences must hold ids in [0, {vocab_size}), found "
                f"{int(low)}..{int(high)}. Use the tokenizer the graph is built for."
            )
        keep = torch.ones(flat.numel() - 1, dtype=torch.bool)
        keep[torch.tensor(lengths[:-1], dtype=torch.long).cumsum(0) - 1] = False  # last token → next's first
        if ignore.numel():
            ignored = torch.isin(flat, ignore)
            keep &= ~(ignored[:-1] | ignored[1:])
        new_keys, new_counts = torch.unique((flat[:-1] * vocab_size + flat[1:])[keep], return_counts=True)
        merged, inverse = torch.unique(torch.cat([keys, new_keys]), return_inverse=True)
        counts = torch.zeros(merged.numel(), dtype=torch.long).index_add_(0, inverse, torch.cat([counts, new_counts]))
        keys, pending, lengths = merged, [], []

    pending_tokens = 0
    for seq in sequences:
        seq = torch.as_tensor(seq, dtype=torch.long)
        if seq.dim() != 1:
            seq = seq.reshape(-1)
        n = seq.numel()
        if n < 2:
            continue  # no bigram, and (as before) never checked
        pending.append(seq)
        lengths.append(n)
        pending_tokens += n
        if pending_tokens >= chunk_tokens:
            flush()
            pending_tokens = 0
    flush()
    return keys, counts


def build_sparse_graph(
    sequences: Iterable, vocab_size: int, min_count: int = 1, ignore_ids: Iterable[int] = (), with_prior: bool = False
) -> BigramGraph:
    """The sparse graph of the bigrams seen at least `min_count` times in `sequences` (token-id lists), with the
    count prior of all of them when `with_prior` (`count_prior.py`)."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}.")
    all_keys, all_counts = count_bigrams(sequences, vocab_size, ignore_ids)
    keys, counts = all_keys, all_counts
    keep = counts >= min_count
    keys, counts = keys[keep], counts[keep]
    if keys.numel() == 0:
        raise ValueError(
            "no bigram was seen "
            + (f"{min_count} times or more" if min_count > 1 else "at all")
            + ": the training sequences need at least two tokens each (or lower min_count)."
        )
    graph = graph_from_edges(keys // vocab_size, keys % vocab_size, vocab_size, counts)
    if with_prior:
        graph.prior = count_prior(all_keys, all_counts, vocab_size)
    return graph


def graph_from_edges(sources, targets, vocab_size: int, counts=None) -> BigramGraph:
    """CSR graph from edge lists (any order, no duplicates)."""
    sources = torch.as_tensor(sources, dtype=torch.long)
    targets = torch.as_tensor(targets, dtype=torch.long)
    counts = torch.zeros_like(sources) if counts is None else torch.as_tensor(counts, dtype=torch.long)
    keys, order = torch.sort(sources * vocab_size + targets)
    if keys.numel() > 1 and bool((keys[1:] == keys[:-1]).any()):
        raise ValueError("duplicate edges: each pair u→v may be listed once.")
    indptr = torch.zeros(vocab_size + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(torch.bincount(sources, minlength=vocab_size), 0)
    return BigramGraph(indptr=indptr, indices=targets[order], counts=counts[order])


def merge_edges(graph: BigramGraph, sources, targets, counts=None) -> tuple[BigramGraph, torch.Tensor, torch.Tensor]:
    """`graph` plus the new edges source→target (none of them real yet, no duplicates: the caller checks).

    Returns the merged graph and where its old edges and the new ones landed in the merged CSR order (edge
    indices, i.e. edge-table rows minus one), so the caller can lay its edge tables out the same way.
    """
    V = graph.vocab_size
    sources = torch.as_tensor(sources, dtype=torch.long, device=graph.indptr.device)
    targets = torch.as_tensor(targets, dtype=torch.long, device=graph.indptr.device)
    counts = torch.zeros_like(sources) if counts is None else torch.as_tensor(counts, dtype=torch.long,
                                                                              device=sources.device)
    old_sources = torch.repeat_interleave(torch.arange(V, device=sources.device), graph.indptr.diff())
    keys = torch.cat([old_sources * V + graph.indices, sources * V + targets])
    order = torch.argsort(keys, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)  # merged index of every concatenated edge
    all_counts = torch.cat([graph.counts, counts])[order]
    merged_sources = torch.cat([old_sources, sources])
    indptr = torch.zeros(V + 1, dtype=torch.long, device=sources.device)
    indptr[1:] = torch.cumsum(torch.bincount(merged_sources, minlength=V), 0)
    merged = BigramGraph(indptr=indptr, indices=keys[order] % V, counts=all_counts)
    E = graph.num_edges
    return merged, position[:E], position[E:]


def check_csr(indptr: torch.Tensor, indices: torch.Tensor, vocab_size: int, name: str = "graph") -> str | None:
    """Why a CSR edge list is malformed, or None when it is well formed (`name`: the buffers' prefix)."""
    if indptr.numel() != vocab_size + 1:
        return f"{name}_indptr has {indptr.numel()} entries, expected vocab_size + 1 = {vocab_size + 1}"
    if int(indptr[0]) != 0 or int(indptr[-1]) != indices.numel():
        return f"{name}_indptr must run from 0 to num_edges={indices.numel()}, got {int(indptr[0])}..{int(indptr[-1])}"
    if bool((indptr[1:] < indptr[:-1]).any()):
        return f"{name}_indptr is not non-decreasing"
    if indices.numel():
        if int(indices.min()) < 0 or int(indices.max()) >= vocab_size:
            return f"{name}_indices hold node ids outside [0, {vocab_size})"
        sources = torch.repeat_interleave(torch.arange(vocab_size), indptr.diff())
        keys = sources * vocab_size + indices
        if bool((keys[1:] <= keys[:-1]).any()):
            return f"{name}_indices are not sorted and unique within each source"
    return None


def edge_keys(indptr: torch.Tensor, indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sorted key source·V + target of every real edge of a CSR graph (key k's edge-table row is its index + 1):
    the table `edge_rows_from_keys` searches."""
    sources = torch.repeat_interleave(torch.arange(vocab_size, device=indices.device), indptr.diff())
    return sources * vocab_size + indices


def edge_rows_from_keys(keys: torch.Tensor | None, sources: torch.Tensor, targets: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """Edge-table row of every pair source→target: its real edge's, or 0 (the shared edge).

    `keys` is `edge_keys(...)` of a sparse graph, or None for a dense one (every pair real: row 1 + s·V + t). A pure
    lookup with no host read, so the model, the decode step and its torch reference all map pairs the same way."""
    if keys is None:
        return 1 + sources * vocab_size + targets
    if keys.numel() == 0:
        return torch.zeros_like(sources)
    query = sources * vocab_size + targets
    pos = torch.searchsorted(keys, query).clamp_max(keys.numel() - 1)
    return torch.where(keys[pos] == query, pos + 1, torch.zeros_like(pos))


def edge_row(csr: tuple[list[int], np.ndarray] | None, source: int, target: int, vocab_size: int) -> int:
    """`edge_rows_from_keys` for one pair, on the host: `csr` (indptr list, indices array sorted within each
    source's block) of a sparse graph, None for a dense one. One binary search over the source's block."""
    if csr is None:
        return 1 + source * vocab_size + target
    indptr, indices = csr
    start, end = indptr[source], indptr[source + 1]
    k = start + int(np.searchsorted(indices[start:end], target))
    return k + 1 if k < end and indices[k] == target else 0


__all__ = ["BigramGraph", "count_bigrams", "build_sparse_graph", "graph_from_edges", "merge_edges", "check_csr",
           "edge_keys", "edge_row", "edge_rows_from_keys"]
