"""What BriLLM's forward passes return: the signals after the recurrence (`Signals`), and transformers' output
classes, which carry the O(d) decoding state (`state.BriLLMState`) as their cache."""

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .ops import EdgeGradLink
from .state import CACHE, BriLLMState


class _CarriesState:
    """transformers' output classes with the cache read as `.state` on every version."""

    @property
    def state(self) -> BriLLMState | None:
        """The `BriLLMState`, whichever name the installed transformers gives the cache (`state.CACHE`)."""
        return getattr(self, CACHE)


@dataclass
class BriLLMModelOutput(_CarriesState, BaseModelOutputWithPast):
    """Signals x_t entering the edge that leaves token t (last_hidden_state, (B, T, d)) and the state."""


@dataclass
class BriLLMCausalLMOutput(_CarriesState, CausalLMOutputWithPast):
    """`logits[:, t]` are the energies of every node as the successor of token t (they predict token t+1)."""


@dataclass
class Signals:
    """A batch after the recurrence, compacted: the real tokens of each row moved to the front."""

    tokens: torch.Tensor  # (B, L) node ids
    valid: torch.Tensor  # (B, L) real token
    column: torch.Tensor  # (B, L) original input column of each compacted token
    index: torch.Tensor  # (B, L) absolute position of the token in its sequence
    signals: torch.Tensor  # (B, L, d) signal leaving each token
    state: BriLLMState
    link: EdgeGradLink | None = None  # hands the recurrence's edge gradients to candidate_energies

    def scatter(self, width: int) -> torch.Tensor:
        """The signals back in their input columns, (B, width, d), zero at padding."""
        out = self.signals.new_zeros(self.tokens.shape[0], width, self.signals.shape[-1])
        out[self.valid.nonzero(as_tuple=True)[0], self.column[self.valid]] = self.signals[self.valid]
        return out


__all__ = ["BriLLMCausalLMOutput", "BriLLMModelOutput", "Signals"]
