"""What BriLLM's steps pass around: the running mix, a sequence's O(d) state (`BriLLMState`, which transformers'
generation loop carries where a key/value cache goes, named `CACHE`), a scan's columns, and the output classes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

# the generation cache's name: `past_key_values` up to transformers 5.23, `cache` from 5.24; the model takes either
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

TENSORS = ("signal", "mix_sum", "mix_norm", "mix_max", "length", "last_token")


@dataclass
class Mix:
    """The running softmax mix of a batch's edge outputs."""

    signal: torch.Tensor  # (B, d) the signal leaving the last token: mix_sum / mix_norm
    mix_sum: torch.Tensor  # (B, d) Σ exp(p_k − mix_max) · c_k
    mix_norm: torch.Tensor  # (B,)  Σ exp(p_k − mix_max)
    mix_max: torch.Tensor  # (B,)  max p_k so far (−inf before the first edge)

    @classmethod
    def empty(cls, batch: int, d: int, device) -> Mix:
        return cls(torch.zeros(batch, d, device=device), torch.zeros(batch, d, device=device),
                   torch.zeros(batch, device=device), torch.full((batch,), float("-inf"), device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.signal, self.mix_sum, self.mix_norm, self.mix_max

    def where(self, rows: torch.Tensor, other: Mix) -> Mix:
        """This mix in `rows` (B,) bool, `other` elsewhere."""
        return Mix(*[torch.where(rows.unsqueeze(1) if a.dim() == 2 else rows, a, b)
                     for a, b in zip(self.tensors(), other.tensors())])


@dataclass
class BriLLMState:
    """The recurrent state of a batch of sequences: the mix, and where each sequence stands."""

    mix: Mix
    length: torch.Tensor  # (B,) real tokens consumed
    last_token: torch.Tensor  # (B,) the node the signal sits on
    seen: int  # input columns consumed, padding included (what generate() slices its inputs by)
    longest: int | None = None  # a host-side bound on length.max() (None: unknown) for the fixed-shape step's check
    graph_owned: bool = False  # the tensors are a captured decode step's buffers (generation.DecodeGraphs)
    row: RowCache | None = None  # one row decoding on the CPU: what its last step left on the host for the next

    signal = property(lambda self: self.mix.signal)
    mix_sum = property(lambda self: self.mix.mix_sum)
    mix_norm = property(lambda self: self.mix.mix_norm)
    mix_max = property(lambda self: self.mix.mix_max)
    batch_size = property(lambda self: self.length.shape[0])

    @classmethod
    def of(cls, tensors, seen: int, longest: int | None = None) -> BriLLMState:
        """The state of `tensors` in `TENSORS` order."""
        return cls(Mix(*tensors[:4]), tensors[4], tensors[5], seen, longest)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state's tensors in `TENSORS` order (what a decode step reads and returns)."""
        return (*self.mix.tensors(), self.length, self.last_token)

    def advanced(self, mix: Mix, tokens: torch.Tensor) -> BriLLMState:
        """The state after one more token per row, `tokens` (B,), with `mix` the new mix."""
        longest = None if self.longest is None else self.longest + 1
        return BriLLMState(mix, self.length + 1, tokens, self.seen + 1, longest)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> BriLLMState:
        """Beam search: keep the rows `beam_idx` (in place)."""
        picked = [t.index_select(0, beam_idx.to(t.device)) for t in self.tensors()]
        self.mix, self.length, self.last_token, self.row = Mix(*picked[:4]), picked[4], picked[5], None
        return self

    def map(self, fn) -> BriLLMState:
        """A state whose tensors are `fn` of these (detach, clone)."""
        return BriLLMState.of([fn(t) for t in self.tensors()], self.seen, self.longest)

    def detach(self) -> BriLLMState:
        return self.map(torch.Tensor.detach)

    def clone(self) -> BriLLMState:
        """A copy that owns its tensors (a captured step's state lives in buffers the next replay overwrites)."""
        return self.map(torch.Tensor.clone)


@dataclass
class RowCache:
    """One row decoding on the CPU: what its last step left on the host for the next (a read there is free, while a
    torch op on a one-element tensor costs microseconds). The tensors of the state stay the truth."""

    node: int  # the node the signal sits on
    length: int  # real tokens consumed
    norm: float  # the mix's norm and max
    top: float
    # the outputs of the edges leaving `node`, which the step computed to score them: the next step crosses one
    successors: torch.Tensor | None = None  # (n, d) in CSR order, successors[k] the edge of CSR entry first + k
    shared: torch.Tensor | None = None  # (1, d) the shared edge's (None: a dense graph)
    first: int = 0


def given_state(cache, past_key_values) -> BriLLMState | None:
    """The state a forward() call was given, under either of the cache's names."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the state as `cache` or as `past_key_values` (its name before transformers 5.24), "
                         "not both.")
    return cache if cache is not None else past_key_values


@dataclass
class Columns:
    """The edges a batch's signal crosses in a scan, one per compacted column (B, L)."""

    rows: torch.Tensor  # (B, L) edge-table row of each column's edge (any valid row where has_edge is False)
    has_edge: torch.Tensor  # (B, L) the column crosses an edge (not a sequence's first token, not padding)
    pe: torch.Tensor  # (B, L, d) PE of each column's position, in the edge table's dtype
    weight: torch.Tensor  # (B, L) the position weight logit of each column's edge
    node_add: torch.Tensor | None = None  # (B, L, d) the entered node's vector (config.node_embedding)
    keep: torch.Tensor | None = None  # (B, L + 1, d) signal dropout: entry j on the signal entering column j


@dataclass
class Signals:
    """A batch after the recurrence, compacted: the real tokens of each row moved to the front."""

    tokens: torch.Tensor  # (B, L) node ids
    valid: torch.Tensor  # (B, L) real token
    column: torch.Tensor  # (B, L) original input column of each compacted token
    index: torch.Tensor  # (B, L) absolute position of the token in its sequence
    signals: torch.Tensor  # (B, L, d) signal leaving each token
    state: BriLLMState
    link: object | None = None  # the EdgeGradLink that hands the recurrence's edge gradients to the energies

    def scatter(self, width: int) -> torch.Tensor:
        """The signals back in their input columns, (B, width, d), zero at padding."""
        out = self.signals.new_zeros(self.tokens.shape[0], width, self.signals.shape[-1])
        out[self.valid.nonzero(as_tuple=True)[0], self.column[self.valid]] = self.signals[self.valid]
        return out


class _CarriesState:
    """transformers' output classes with the cache read as `.state` on every version."""

    state = property(lambda self: getattr(self, CACHE))


@dataclass
class BriLLMModelOutput(_CarriesState, BaseModelOutputWithPast):
    """Signals x_t entering the edge that leaves token t (last_hidden_state, (B, T, d)) and the state."""


@dataclass
class BriLLMCausalLMOutput(_CarriesState, CausalLMOutputWithPast):
    """`logits[:, t]` are the energies of every node as the successor of token t (they predict token t+1)."""
