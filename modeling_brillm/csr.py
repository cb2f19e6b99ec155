"""The BriLLM graph as the model reads it, CSR by source: the j-th real edge (in (source, target) order) is edge-table
row j + 1, every other pair row 0 (the shared edge); dense: u→v is row 1 + u·V + v. Building graphs: graph.py."""

from dataclasses import dataclass

import numpy as np
import torch

from .count_prior import CountPrior


@dataclass
class BigramGraph:
    """A sparse graph in CSR form: successors of u are `indices[indptr[u]:indptr[u+1]]`, sorted."""

    indptr: torch.Tensor  # (V + 1,) int64
    indices: torch.Tensor  # (E,) int64 target node of every real edge
    counts: torch.Tensor  # (E,) int64 bigram count of every real edge (0 when unknown)
    prior: CountPrior | None = None  # the count prior of every bigram seen, edge or not (config.count_prior)

    vocab_size = property(lambda self: self.indptr.numel() - 1)  # nodes V
    num_edges = property(lambda self: self.indices.numel())  # real edges E


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
        keys = edge_keys(indptr, indices, vocab_size)
        if bool((keys[1:] <= keys[:-1]).any()):
            return f"{name}_indices are not sorted and unique within each source"
    return None


def edge_keys(indptr: torch.Tensor, indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sorted keys source·V + target of a CSR graph's real edges (key k: edge row k + 1), for `edge_rows_from_keys`."""
    sources = torch.repeat_interleave(torch.arange(vocab_size, device=indices.device), indptr.diff())
    return sources * vocab_size + indices


def edge_rows_from_keys(keys: torch.Tensor | None, sources: torch.Tensor, targets: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """Edge-table row of every pair source→target: its real edge's, or 0 (shared). `keys`: a sparse graph's `edge_keys`,
    or None (dense: 1 + s·V + t). No host read: the model, the decode step and its torch reference map pairs alike."""
    if keys is None:
        return 1 + sources * vocab_size + targets
    if keys.numel() == 0:
        return torch.zeros_like(sources)
    query = sources * vocab_size + targets
    pos = torch.searchsorted(keys, query).clamp_max(keys.numel() - 1)
    return torch.where(keys[pos] == query, pos + 1, torch.zeros_like(pos))


def edge_row(csr: tuple[list[int], np.ndarray] | None, source: int, target: int, vocab_size: int) -> int:
    """`edge_rows_from_keys` of one pair, on the host: a binary search in `csr` (indptr list, indices; None: dense)."""
    if csr is None:
        return 1 + source * vocab_size + target
    indptr, indices = csr
    start, end = indptr[source], indptr[source + 1]
    k = start + int(np.searchsorted(indices[start:end], target))
    return k + 1 if k < end and indices[k] == target else 0
