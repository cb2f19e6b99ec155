"""The tables a BriLLM derives from its graph and config, built on demand and cached per version of what they read:
the real edges' sorted keys, the count prior as a dense table, the successors by count (the sampled loss's
negatives) and the largest out-degree (the decode step's static shape). The positional encoding's table stays with
its formula in modeling_brillm.py."""

import numpy as np
import torch

from .count_prior import DENSE_TABLE_MAX, dense_table
from .graph import edge_keys
from .losses import frequency_table
from .ops import graph_max_degree


class DerivedTables:
    """Mixin of `BriLLMModel` (which holds the graph's buffers and the config)."""

    def reset_caches(self):
        """Forget the tables derived from the graph and the config (after the graph grows)."""
        self._edge_key_cache = self._pe_cache = self._freq_cache = self._prior_cache = self._host_csr_cache = None

    def edge_keys(self) -> torch.Tensor | None:
        """Sorted keys source·V + target of the real edges (None for a dense graph); cached per graph version."""
        if self.config.graph == "dense":
            return None
        indices, indptr = self.graph_indices, self.graph_indptr
        key = (indices.data_ptr(), indices._version, indptr._version, indices.device)
        if self._edge_key_cache is None or self._edge_key_cache[0] != key:
            self._edge_key_cache = (key, edge_keys(indptr, indices, self.config.vocab_size))
        return self._edge_key_cache[1]

    def host_csr(self) -> tuple[list[int], np.ndarray]:
        """The sparse graph's CSR as the host step reads it: indptr as a list, indices as a NumPy view (a CPU graph);
        cached per graph version."""
        indptr, indices = self.graph_indptr, self.graph_indices
        key = (indptr.data_ptr(), indptr._version, indices.data_ptr(), indices._version)
        if self._host_csr_cache is None or self._host_csr_cache[0] != key:
            self._host_csr_cache = (key, (indptr.tolist(), indices.numpy()))
        return self._host_csr_cache[1]

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

    def decode_max_degree(self) -> int:
        """Largest real out-degree (static shape of the sync-free step); read from the device once per graph."""
        if self.config.graph == "dense":
            return self.config.vocab_size
        return graph_max_degree(self.graph_indptr)


__all__ = ["DerivedTables"]
