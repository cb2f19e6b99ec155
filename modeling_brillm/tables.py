"""The tables the steps read (`EdgeTable`, `GraphView`), and those a BriLLM derives from its graph and config, built on
demand and cached per version of what they read: the real edges' sorted keys, the count prior as a dense table, the
successors by count (the sampled loss's negatives)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .count_prior import DENSE_TABLE_MAX, dense_table
from .graph import edge_keys
from .plans import graph_max_degree


@dataclass
class EdgeTable:
    """The edges as a step reads them: row 0 of the tables is the shared edge, rows 1.. the real edges in CSR order."""

    weights: torch.Tensor  # (P, d, d)
    biases: torch.Tensor  # (P, 1, d)
    edge_base: torch.Tensor | None = None  # (d, d) every edge adds it to its own matrix (config.edge_backoff)
    non_edge_bias: torch.Tensor | None = None  # (V,) a non-successor's offset on the shared energy
    sparse_grad: bool = False  # the tables get sparse COO gradients over the touched rows


@dataclass
class GraphView:
    """The graph as a step reads it: CSR by source (successors of u are `indices[indptr[u]:indptr[u + 1]]`)."""

    indptr: torch.Tensor  # (V + 1,); a dense graph's is arange(V + 1)·V
    indices: torch.Tensor | None  # (E,) targets, None for a dense graph (every node is every node's successor)
    keys: torch.Tensor | None  # (E,) sorted source·V + target of the real edges (None: dense)
    vocab_size: int

    @property
    def max_degree(self) -> int:
        """The largest number of real successors of any node (one host read per graph)."""
        return self.vocab_size if self.indices is None else graph_max_degree(self.indptr)


def frequency_table(indptr: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """(V, width) successors of every node by descending bigram count (ties by target id), padded with −1."""
    V = indptr.numel() - 1
    src = torch.repeat_interleave(torch.arange(V, device=indptr.device), indptr.diff())
    order = torch.argsort(src * (counts.max() + 1 if counts.numel() else 1) - counts, stable=True)
    rank = torch.arange(order.numel(), device=indptr.device) - indptr[src[order]]
    table = torch.full((V, width), -1, dtype=torch.long, device=indptr.device)
    keep = rank < width
    table[src[order][keep], rank[keep]] = indices[order][keep]
    return table


class DerivedTables:
    """Mixin of `BriLLMModel` (which holds the graph's buffers and the config)."""

    def reset_caches(self):
        """Forget the tables derived from the graph and the config (after the graph grows)."""
        self._edge_key_cache = self._pe_cache = self._freq_cache = self._prior_cache = None

    def edge_keys(self) -> torch.Tensor | None:
        """Sorted keys source·V + target of the real edges (None for a dense graph); cached per graph version."""
        if self.config.graph == "dense":
            return None
        indices, indptr = self.graph_indices, self.graph_indptr
        key = (indices.data_ptr(), indices._version, indptr._version, indices.device)
        if self._edge_key_cache is None or self._edge_key_cache[0] != key:
            self._edge_key_cache = (key, edge_keys(indptr, indices, self.config.vocab_size))
        return self._edge_key_cache[1]

    def prior_table(self) -> torch.Tensor | None:
        """The count prior as a dense (V, V) table, when it is small enough (`count_prior.DENSE_TABLE_MAX`) and
        the model has one; cached per prior version."""
        if not self.config.count_prior or self.config.vocab_size ** 2 > DENSE_TABLE_MAX:
            return None
        parts = (self.prior_node, self.prior_indptr, self.prior_indices, self.prior_values)
        key = tuple((t.data_ptr(), t._version) for t in parts) + (self.prior_node.device,)
        if self._prior_cache is None or self._prior_cache[0] != key:
            self._prior_cache = (key, dense_table(*parts))
        return self._prior_cache[1]

    def frequency_table(self, width: int) -> torch.Tensor:
        """(V, width) successors of every node by descending bigram count, padded with −1 (cached)."""
        counts, indices = self.graph_counts, self.graph_indices
        key = (width, counts.data_ptr(), counts._version, indices.data_ptr(), indices._version, counts.device)
        if self._freq_cache is None or self._freq_cache[0] != key:
            self._freq_cache = (key, frequency_table(self.graph_indptr, indices, counts, width))
        return self._freq_cache[1]


__all__ = ["DerivedTables", "EdgeTable", "GraphView"]
