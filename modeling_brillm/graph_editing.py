"""The graph's methods of the models: reading and storing the graph and its count prior; building a model from
a graph. Growing a graph (new nodes, new real edges) and building one from text are tools of the package
(graph.py), which the methods below call."""

from __future__ import annotations

import torch

from .backend import package_tool
from .count_prior import CountPrior
from .csr import BigramGraph, check_csr, edge_rows_from_keys

# the recipe's per-node rows beside node_bias: a non-successor's offset, the node's readout of the signal, the
# vector it adds to the signal it passes on
NODE_ROWS = ("non_edge_bias", "node_readout", "node_embedding")


class GraphMethods:
    """The graph's public methods, shared by `BriLLMModel` and `BriLLMForCausalLM` (they act on `base_model`)."""

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def from_graph(cls, graph: BigramGraph | None, config=None, **config_kwargs):
        """A freshly initialised model on `graph` (a sparse `BigramGraph`, or None for a dense graph)."""
        if graph is not None and not isinstance(graph, BigramGraph):
            raise TypeError(f"from_graph: graph must be a BigramGraph (or None for a dense graph), got "
                            f"{type(graph).__name__}; build one with modeling_brillm.build_sparse_graph.")
        if config is not None and config_kwargs:
            raise ValueError(f"from_graph: pass either config or config fields, not both (got config and "
                             f"{sorted(config_kwargs)}); set the fields on the config instead.")
        if graph is None and config is not None and config.graph == "sparse":
            raise ValueError("from_graph: a sparse config needs its graph (the BigramGraph of its num_edges real "
                             "edges); pass it, or use a config with graph='dense'.")
        if config is None and graph is None:
            config = cls.config_class(graph="dense", **config_kwargs)
        elif config is None:
            if config_kwargs.get("count_prior") and graph.prior is not None:
                config_kwargs["count_prior_bigrams"] = graph.prior.num_bigrams
            config = cls.config_class(vocab_size=graph.vocab_size, graph="sparse", num_edges=graph.num_edges,
                                      **config_kwargs)
        model = cls(config)
        if graph is not None:
            model.set_graph(graph)
        return model

    @classmethod
    def from_token_sequences(cls, sequences, vocab_size: int, min_count: int = 1, dense: bool = False,
                             ignore_ids=(), **config_kwargs):
        """A fresh model whose real edges are the bigrams of `sequences` seen `min_count` times (or dense); with
        `count_prior=True` its count prior is every bigram of `sequences`."""
        if dense:
            return cls.from_graph(None, vocab_size=vocab_size, **config_kwargs)
        graph = package_tool("graph", "from_token_sequences").build_sparse_graph(
            sequences, vocab_size, min_count=min_count, ignore_ids=ignore_ids,
            with_prior=bool(config_kwargs.get("count_prior")))
        return cls.from_graph(graph, **config_kwargs)

    # -------------------------------------------------------------------------------------------- the graph
    def set_graph(self, graph: BigramGraph):
        """Store a sparse graph's edge list (its size must be the config's)."""
        if self.config.graph != "sparse":
            raise ValueError("set_graph needs a sparse config; a dense graph has every edge.")
        if graph.vocab_size != self.config.vocab_size or graph.num_edges != self.config.num_edges:
            raise ValueError(f"graph has V={graph.vocab_size}, E={graph.num_edges} but the config says "
                             f"V={self.config.vocab_size}, num_edges={self.config.num_edges}.")
        problem = check_csr(graph.indptr, graph.indices, graph.vocab_size)
        if problem:
            raise ValueError(f"malformed graph: {problem}.")
        base = self.base_model
        with torch.no_grad():
            base.graph_indptr.copy_(graph.indptr)
            base.graph_indices.copy_(graph.indices)
            base.graph_counts.copy_(graph.counts)
        if self.config.count_prior:
            if graph.prior is None:
                raise ValueError("this config has count_prior=True but the graph carries no count prior: build it "
                                 "with build_sparse_graph(..., with_prior=True), or pass count_prior=False.")
            self.set_count_prior(graph.prior)

    def set_count_prior(self, prior: CountPrior):
        """Store the count prior (`count_prior.py`); its size must be the config's `count_prior_bigrams`."""
        V, K = self.config.vocab_size, self.config.count_prior_bigrams
        if not self.config.count_prior:
            raise ValueError("set_count_prior needs a config with count_prior=True (the model has no prior buffers).")
        if prior.node.numel() != V or prior.num_bigrams != K:
            raise ValueError(f"the count prior has V={prior.node.numel()}, {prior.num_bigrams} bigrams but the "
                             f"config says V={V}, count_prior_bigrams={K}.")
        problem = check_csr(prior.indptr, prior.indices, V, "prior")
        if problem:
            raise ValueError(f"malformed count prior: {problem}.")
        base = self.base_model
        with torch.no_grad():
            for name in ("node", "indptr", "indices", "values"):
                getattr(base, f"prior_{name}").copy_(getattr(prior, name))

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
        """Raise if the stored edge list is malformed or disagrees with the config."""
        if self.config.graph == "sparse":
            base = self.base_model
            problem = check_csr(base.graph_indptr.cpu(), base.graph_indices.cpu(), self.config.vocab_size)
            if problem:
                raise ValueError(
                    f"the checkpoint's edge list does not fit its config (num_edges={self.config.num_edges}): "
                    f"{problem}. The weights file is corrupt or belongs to another config."
                )
        if self.config.count_prior:
            base = self.base_model
            problem = check_csr(base.prior_indptr.cpu(), base.prior_indices.cpu(), self.config.vocab_size, "prior")
            if problem:
                raise ValueError(f"the checkpoint's count prior does not fit its config (count_prior_bigrams="
                                 f"{self.config.count_prior_bigrams}): {problem}. The weights file is corrupt or "
                                 "belongs to another config.")

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
