"""What a sequence needs to go on: BriLLM's recurrent state, O(d) per sequence whatever its length.

The signal entering the next edge is a softmax(position weights)-weighted mean of every earlier edge output, kept
as running sums with a running maximum for stability: x = mix_sum / mix_norm, both scaled by exp(-mix_max).
transformers' generation loop carries it where a Transformer's key/value cache goes: under the name `CACHE`.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers calls the generation cache `past_key_values` up to 5.23 and `cache` from 5.24 (in model outputs,
# generate()'s model kwargs and forward arguments; the old name then still works, with a deprecation warning). The
# model speaks the installed release's name; its forward() accepts either.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

TENSORS = ("signal", "mix_sum", "mix_norm", "mix_max", "length", "last_token")


class BriLLMState:
    """The recurrent state of a batch of sequences (see the module docstring)."""

    def __init__(self, signal, mix_sum, mix_norm, mix_max, length, last_token, seen: int, longest: int | None = None):
        self.signal = signal  # (B, d) signal leaving the last token
        self.mix_sum = mix_sum  # (B, d) Σ exp(p_k − max) · c_k
        self.mix_norm = mix_norm  # (B,)  Σ exp(p_k − max)
        self.mix_max = mix_max  # (B,)  max p_k so far (−inf before the first edge)
        self.length = length  # (B,)  real tokens consumed
        self.last_token = last_token  # (B,)  node the signal sits on
        self.seen = seen  # input columns consumed, padding included (what generate() slices by)
        # host-side bound on length.max() (None = not known yet): a decode step checks the position range with it
        # without reading the device
        self.longest = longest
        self.graph_owned = False  # True: the tensors are a captured decode step's buffers (see decode_capture.py)
        # a one-row CPU step's own (generation.HostStep): the step, reused for the next tokens, and the outputs of the
        # edges leaving last_token, which the next step crosses one of
        self.step = self.next_edges = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state's tensors in `TENSORS` order (what a decode step reads and returns)."""
        return tuple(getattr(self, name) for name in TENSORS)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Beam search: keep the rows `beam_idx` (in place)."""
        for name, tensor in zip(TENSORS, self.tensors()):
            setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))
        return self

    def detach(self) -> BriLLMState:
        return BriLLMState(*(t.detach() for t in self.tensors()), seen=self.seen, longest=self.longest)

    def clone(self) -> BriLLMState:
        """A copy that owns its tensors (a state returned by a captured decode step lives in the graph's buffers,
        which the next replay overwrites)."""
        return BriLLMState(*(t.clone() for t in self.tensors()), seen=self.seen, longest=self.longest)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]


class HostState(BriLLMState):
    """A one-row state that the CPU's host step (generation.HostStep) returned. Its length, last token, mix norm and
    mix max are Python numbers as well (`host`), which the next host step reads instead of four tensors; the tensors
    are made only when something else asks for them."""

    def __init__(self, signal, mix_sum, last_token, host: tuple, seen: int, step, next_edges):
        self._scalars = {}
        self.signal, self.mix_sum, self.last_token = signal, mix_sum, last_token
        self.host = host  # (length, last token, mix norm, mix max)
        self.seen, self.longest, self.graph_owned = seen, None, False
        self.step, self.next_edges = step, next_edges

    def _scalar(name: str, index: int, dtype: torch.dtype):
        def get(self):
            if name not in self._scalars:
                self._scalars[name] = torch.tensor([self.host[index]], dtype=dtype)
            return self._scalars[name]

        def put(self, value):
            self._scalars[name] = value
            self.step = None  # set from outside (a reorder): `host` no longer holds, the next step reads the tensors
        return property(get, put)

    length = _scalar("length", 0, torch.long)
    mix_norm = _scalar("mix_norm", 2, torch.float32)
    mix_max = _scalar("mix_max", 3, torch.float32)
    del _scalar


def given_state(cache, past_key_values) -> BriLLMState | None:
    """The state a forward() call was given, under either of the cache's names."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the state as `cache` or as `past_key_values` (its name before transformers 5.24), "
                         "not both.")
    return cache if cache is not None else past_key_values


__all__ = ["BriLLMState", "CACHE", "HostState", "TENSORS", "given_state"]
