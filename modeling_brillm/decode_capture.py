"""CUDA graphs of the one-token step: captured once per batch size, replayed every token.

A step is ~60 small kernels (~0.1 ms of GPU work, ~1.7 ms of host time launched one by one); with a fixed width it reads
nothing from the device (the position check uses a host-side bound), so one launch replays it. The returned state lives
in the graph's buffers, advanced in place by the next replay (the loops keep only the newest state, `generate()` hands
out a copy). A graph reads the tables by address: re-allocating one (growing, `.to()`, loading) captures it again."""

from __future__ import annotations

import torch

from .backend import current_backend
from .state import BriLLMState


def _signature(model, device) -> tuple:
    """Everything a captured step depends on by address or by value (`model` is a `BriLLMModel`); the lazily built
    tables (positions, prior) are built here, before their addresses are read."""
    cfg = model.config
    tensors = [model.weights, model.biases, model.positions, model.position_table(device)]
    if cfg.graph == "sparse":
        tensors += [model.graph_indptr, model.graph_indices, model.edge_keys()]
    # the step adds the non-successors' offsets to their logits and x·edge_base to every edge's input
    tensors += [t for t in (model.non_edge_bias, model.edge_base) if t is not None]
    if cfg.count_prior:  # the step adds the prior's row of every token
        tensors += [model.prior_node, model.prior_indptr, model.prior_indices, model.prior_values]
        if model.prior_table() is not None:
            tensors.append(model.prior_table())
    return (tuple(t.data_ptr() for t in tensors), model.weights.dtype, str(device), current_backend(),
            cfg.vocab_size, cfg.max_position_embeddings, cfg.position_overflow, cfg.position_encoding,
            model.graph_view().max_degree)


class _Graph:
    def __init__(self, model, tokens, state, signature, pool):
        self.signature = signature
        device = tokens.device
        width = model.graph_view().max_degree
        self.tokens = tokens.detach().clone()
        self.state = state.clone()
        # warm up on a side stream (Triton compiles its kernels, caches fill), then record
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                model.decode_step(self.tokens, self.state, width)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, new_state = model.decode_step(self.tokens, self.state, width)
            for buffer, value in zip(self.state.tensors(), new_state.tensors()):
                buffer.copy_(value)  # the state advances in place: its next step reads it where it is

    def step(self, tokens, state):
        self.tokens.copy_(tokens)
        pairs = list(zip(state.tensors(), self.state.tensors()))
        if not all(t is buffer for t, buffer in pairs):  # a state this graph did not advance: copy it in
            for t, buffer in pairs:
                buffer.copy_(t)
        self.graph.replay()
        longest = None if state.longest is None else state.longest + 1
        return self.logits, BriLLMState.of(self.state.tensors(), state.seen + 1, longest)


class DecodeGraphs:
    """The captured decode steps of one model, one per batch size (they share one memory pool)."""

    def __init__(self):
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.tables = self.signature = None  # the decoding loop's step tables, and the signature read with them

    def step(self, model, tokens: torch.Tensor, state, tables):
        """Logits (B, V) and the new state (its tensors the graph's buffers) for `tokens` (B,) on top of `state`.
        `tables`: the loop's `step_tables()`; the signature is read once per loop (it reads the config)."""
        if tables is not self.tables:
            self.tables, self.signature = tables, _signature(model, tokens.device)
        signature = self.signature
        B = tokens.shape[0]
        graph = self.graphs.get(B)
        if graph is None or graph.signature != signature:
            if graph is not None:  # tables moved: every graph of this model is stale
                self.graphs.clear()
                self.pool = None
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[B] = _Graph(model, tokens, state, signature, self.pool)
        logits, new_state = graph.step(tokens, state)
        new_state.graph_owned = True
        return logits, new_state

    def clear(self):
        self.graphs.clear()
        self.pool = self.tables = self.signature = None

