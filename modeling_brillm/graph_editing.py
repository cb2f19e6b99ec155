"""The graph's methods of the models: reading the graph and its count prior. Building a model on a graph, storing
one and growing one (new nodes, new real edges) are tools of the package (graph.py), which the methods call."""

import torch

from .backend import package_tool
from .count_prior import CountPrior
from .csr import BigramGraph, check_csr, edge_rows_from_keys

# the per-node rows beside node_bias: a non-successor's offset, the readout of the signal, the vector passed on
NODE_ROWS = ("non_edge_bias", "node_readout", "node_embedding")


class GraphMethods:
    """The graph's public methods, shared by `BriLLMModel` and `BriLLMForCausalLM` (they act on `base_model`)."""

    @classmethod
    def from_graph(cls, graph: BigramGraph | None, config=None, **config_kwargs):
        """A freshly initialised model on `graph` (a sparse `BigramGraph`, or None for a dense graph)."""
        return package_tool("graph", "from_graph").from_graph(cls, graph, config, **config_kwargs)

    @classmethod
    def from_token_sequences(cls, sequences, vocab_size: int, min_count: int = 1, dense: bool = False,
                             ignore_ids=(), **config_kwargs):
        """A fresh model on the bigrams of `sequences` seen `min_count` times (or dense), a count prior on all."""
        return package_tool("graph", "from_token_sequences").from_token_sequences(
            cls, sequences, vocab_size, min_count, dense, ignore_ids, **config_kwargs)

    def set_graph(self, graph: BigramGraph):
        """Store a sparse graph's edge list (its size must be the config's)."""
        package_tool("graph", "set_graph").set_graph(self, graph)

    def set_count_prior(self, prior: CountPrior):
        """Store the count prior; its size must be the config's `count_prior_bigrams`."""
        package_tool("graph", "set_count_prior").set_count_prior(self, prior)

    def get_count_prior(self) -> CountPrior | None:
        """The stored count prior (None without `config.count_prior`)."""
        if not self.config.count_prior:
            return None
        base = self.base_model
        return CountPrior(base.prior_node, base.prior_indptr, base.prior_indices, base.prior_values)

    def get_graph(self) -> BigramGraph | None:
        if self.config.graph == "dense":
            return None
        base = self.base_model
        return BigramGraph(base.graph_indptr, base.graph_indices, base.graph_counts, self.get_count_prior())

    def check_graph(self):
        """Raise if the stored edge list or count prior is malformed or disagrees with the config."""
        cfg, base = self.config, self.base_model
        for on, name, what, size in ((cfg.graph == "sparse", "graph", "edge list", f"num_edges={cfg.num_edges}"),
                                     (cfg.count_prior, "prior", "count prior",
                                      f"count_prior_bigrams={cfg.count_prior_bigrams}")):
            problem = on and check_csr(getattr(base, f"{name}_indptr").cpu(), getattr(base, f"{name}_indices").cpu(),
                                       cfg.vocab_size, name)
            if problem:
                raise ValueError(f"the checkpoint's {what} does not fit its config ({size}): {problem}. The weights "
                                 "file is corrupt or belongs to another config.")

    def csr(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indptr, indices) of the real edges; indices None for a dense graph (every target, in order)."""
        base = self.base_model
        if self.config.graph == "dense":
            V = self.config.vocab_size
            return torch.arange(V + 1, device=base.weights.device) * V, None
        return base.graph_indptr, base.graph_indices

    def edge_rows(self, sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Edge-table row of every pair source→target: its real edge, or 0 (shared). On the model's device."""
        sources, targets = self.to_input_device(sources, targets)
        return edge_rows_from_keys(self.base_model.edge_keys(), sources, targets, self.config.vocab_size)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        """Add nodes for a grown tokenizer (`model.resize_token_embeddings(len(tokenizer))`), keeping every old
        logit (`graph.resize_nodes`); create the optimizer after resizing. Returns None (BriLLM has no embeddings)."""
        return package_tool("graph", "resize_token_embeddings").resize_nodes(self.base_model, new_num_tokens,
                                                                            pad_to_multiple_of, mean_resizing)

    def add_edges(self, pairs, counts=None) -> torch.Tensor:
        """Make the pairs u→v (a list of (u, v) or an (N, 2) tensor) real edges of a sparse graph, each starting as a
        copy of the shared edge (`graph.add_edges`); returns their edge-table rows. Create the optimizer after."""
        return package_tool("graph", "add_edges").add_edges(self.base_model, pairs, counts)

    def add_edges_from_sequences(self, sequences, min_count: int = 1, ignore_ids=()) -> torch.Tensor:
        """Make real every bigram of `sequences` seen `min_count` times that is not real yet; returns the new rows."""
        return package_tool("graph", "add_edges_from_sequences").add_edges_from_sequences(
            self.base_model, sequences, min_count, ignore_ids)
