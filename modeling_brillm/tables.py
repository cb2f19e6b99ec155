"""The tables the steps read, and those a BriLLM derives from its graph and config (cached per version of inputs)."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from .count_prior import DENSE_TABLE_MAX, add_count_prior, dense_table
from .csr import edge_keys
from .energy import RowTables
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
    # a CPU graph's CSR on the host for one row's step (`DerivedTables.host_csr`); None on other devices
    host: tuple | None = None

    @property
    def max_degree(self) -> int:
        """The largest number of real successors of any node (one host read per graph)."""
        return self.vocab_size if self.indices is None else graph_max_degree(self.indptr)

    def block(self, u: int) -> tuple[int, int]:
        """Entries first..last−1 of the real successors of node `u` (edge rows first+1..last), read on the host."""
        if self.indices is None:
            return u * self.vocab_size, (u + 1) * self.vocab_size
        return (self.host[0][u], self.host[0][u + 1]) if self.host else (int(self.indptr[u]), int(self.indptr[u + 1]))


def positional_encoding(positions: torch.Tensor, d: int, variant: str = "released") -> torch.Tensor:
    """Sinusoidal rows (..., d) float32 of integer `positions`: "released" multiplies by 10000^(2j/d), "sinusoidal"
    divides; in the release's own float32 steps, which an equal formula would not reproduce (docs/model.md)."""
    if positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}; pass e.g. torch.arange(n).")
    if variant not in ("released", "sinusoidal"):
        raise ValueError(f"variant must be 'released' or 'sinusoidal', got {variant!r}.")
    exponent = torch.arange(0, d, 2, device=positions.device) / d  # int64 / int → float32 (true division)
    freq = 10000.0 ** exponent  # float32 power, as the release
    pos = positions.to(torch.int64).unsqueeze(-1)
    angle = pos * freq if variant == "released" else pos / freq  # int64 with float32 → float32, (..., ceil(d/2))
    pe = torch.empty(*positions.shape, d, dtype=torch.float32, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle[..., : d // 2])
    return pe


@dataclass
class Positions:
    """The positional encoding's rows and the mix's position weights, read by position."""

    table: torch.Tensor  # (M + 1, d) float32 PE of positions 0..M
    logits: torch.Tensor  # (M,) float32 position weight logits
    formula: tuple | None = None  # (d, variant): positions past M follow the formula (position_overflow="extend")

    def pe(self, index: torch.Tensor) -> torch.Tensor:
        if self.formula is None:
            return self.table[index]
        # no host sync: both paths (teacher forcing, one-token decoding) compute rows past M the same way
        M = self.trained
        beyond = positional_encoding(index, *self.formula)
        return torch.where((index > M).unsqueeze(-1), beyond, self.table[index.clamp_max(M)])

    @property
    def trained(self) -> int:
        """The trained range, max_position_embeddings: positions 0..M have PE rows, the edges into 1..M weights."""
        return self.table.shape[0] - 1

    def row(self, at: int) -> torch.Tensor:
        """PE (1, d) of position `at`, a host int: a slice of the table within range."""
        if at <= self.trained:
            return self.table[at:at + 1]
        return self.pe(torch.tensor([at], device=self.table.device))

    def weight(self, index: torch.Tensor) -> torch.Tensor:
        """The logit of the edge entering position `index`: p[index − 1] (past the range: the last one)."""
        return self.logits[(index - 1).clamp(0, self.trained - 1)]


@dataclass
class ReadOut:
    """What every node adds to its energy: ⟨x, node_readout[v]⟩ and the count prior (`(dense table,)` or CSR parts)."""

    node_readout: torch.Tensor | None = None
    prior: tuple | None = None

    def __call__(self, logits: torch.Tensor, signal: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """`logits` (N, V) of the successors of `sources` (N,), plus what every node reads of the signal (N, d)."""
        if self.node_readout is not None:
            logits = logits + (signal.to(self.node_readout.dtype) @ self.node_readout.t()).to(logits.dtype)
        if self.prior is not None:
            if len(self.prior) == 1:
                return logits + self.prior[0][sources]
            return add_count_prior(logits, sources, *self.prior)
        return logits


@dataclass
class StepAt:
    """Where one decode step happens, per row."""

    last: torch.Tensor  # (B,) the node the signal sits on
    pe_now: torch.Tensor  # (B, d) PE of the crossed edge's position
    pe_next: torch.Tensor  # (B, d) PE of the next position, where the new node's successors are scored
    weight: torch.Tensor  # (B,) the crossed edge's position weight logit
    node_add: torch.Tensor | None = None  # (B, d) the entered nodes' vectors (config.node_embedding)


@dataclass
class StepTables:
    """What the one-token step reads of a model, gathered once per decoding loop: a transformers config answers an
    attribute in microseconds, and a step would ask for dozens."""

    edges: EdgeTable
    graph: GraphView
    positions: Positions
    node_embedding: torch.Tensor | None
    read_out: Callable

    def at(self, state, tokens) -> StepAt:
        """Where the step of `tokens` (B,) on `state` happens."""
        length, positions = state.length, self.positions
        pe = positions.pe(torch.stack([length, length + 1], 1))
        node_add = None if self.node_embedding is None else self.node_embedding[tokens]
        return StepAt(state.last_token, pe[:, 0], pe[:, 1], positions.weight(length), node_add)

    @cached_property
    def row_tables(self) -> RowTables:
        """The edge tables as one row's step on the CPU reads them (`energy.RowTables`), made once."""
        return RowTables.of(self.edges)

    @cached_property
    def host_logits(self) -> list[float]:
        """The position weight logits on the host (one row's step on the CPU reads them there), read once."""
        return self.positions.logits.tolist()


class DerivedTables:
    """Mixin of `BriLLMModel`: the tables derived from its graph and config, cached per version of what they read."""

    def reset_caches(self):
        """Forget the derived tables (after the graph grows)."""
        self._caches = {}

    def _cached(self, name: str, tensors, build):
        """`build()`, kept until one of `tensors` is replaced or changed in place (or its device changes)."""
        key = tuple((t.data_ptr(), t._version, t.device) for t in tensors)
        hit = self._caches.get(name)
        if hit is None or hit[0] != key:
            hit = self._caches[name] = (key, build())
        return hit[1]

    def edge_keys(self) -> torch.Tensor | None:
        """Sorted keys source·V + target of the real edges (None for a dense graph)."""
        if self.config.graph == "dense":
            return None
        indptr, indices, V = self.graph_indptr, self.graph_indices, self.config.vocab_size
        return self._cached("keys", (indptr, indices), lambda: edge_keys(indptr, indices, V))

    def host_csr(self) -> tuple:
        """A CPU graph's CSR as one row's step reads it: (indptr list, indices NumPy view); (None, None) when dense."""
        if self.config.graph == "dense":
            return None, None
        indptr, indices = self.graph_indptr, self.graph_indices
        return self._cached("host", (indptr, indices), lambda: (indptr.tolist(), indices.numpy()))

    def prior_table(self) -> torch.Tensor | None:
        """The count prior as a dense (V, V) table, when the model has one small enough (DENSE_TABLE_MAX)."""
        if not self.config.count_prior or self.config.vocab_size ** 2 > DENSE_TABLE_MAX:
            return None
        parts = (self.prior_node, self.prior_indptr, self.prior_indices, self.prior_values)
        return self._cached("prior", parts, lambda: dense_table(*parts))

    def frequency_table(self, width: int) -> torch.Tensor:
        """(V, width) successors of every node by descending bigram count (ties by target id), padded with −1."""
        indptr, indices, counts = self.graph_indptr, self.graph_indices, self.graph_counts

        def build():
            src = torch.repeat_interleave(torch.arange(indptr.numel() - 1, device=indptr.device), indptr.diff())
            order = torch.argsort(src * (counts.max() + 1 if counts.numel() else 1) - counts, stable=True)
            rank = torch.arange(order.numel(), device=indptr.device) - indptr[src[order]]
            table = torch.full((indptr.numel() - 1, width), -1, dtype=torch.long, device=indptr.device)
            keep = rank < width
            table[src[order][keep], rank[keep]] = indices[order][keep]
            return table
        return self._cached(f"frequency {width}", (indices, counts), build)
