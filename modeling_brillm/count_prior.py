"""The count prior (`config.count_prior`): a fixed bigram model of the training text whose log p(v | u) every logit
adds, stored without a V×V table (docs/model.md, "The count prior"; graph.count_prior builds it)."""

from dataclasses import dataclass

import torch

DISCOUNT = 0.75  # D: the usual absolute discount (Ney, Essen & Kneser 1994 put it just under n1 / (n1 + 2·n2))
# up to this many entries (V ≤ 4096, 64 MiB) the prior is also a dense (V, V) table: one row gather per position
DENSE_TABLE_MAX = 1 << 24


@dataclass
class CountPrior:
    """A count prior in the form the model stores it: log p(·|u) up to one constant per row."""

    node: torch.Tensor  # (V,) float32, log p_uni(v)
    indptr: torch.Tensor  # (V + 1,) int64
    indices: torch.Tensor  # (K,) int64, target of every seen bigram (sorted within a source)
    values: torch.Tensor  # (K,) float32, log p(v|u) − log λ(u) − log p_uni(v) of every seen bigram

    num_bigrams = property(lambda self: self.indices.numel())  # seen bigrams K

    def table(self) -> torch.Tensor:
        """The dense (V, V) prior, node + seen entries."""
        return dense_table(self.node, self.indptr, self.indices, self.values)


def dense_table(node: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The stored prior as a dense (V, V) table: row u is `node` plus u's seen entries."""
    V = node.numel()
    sources = torch.repeat_interleave(torch.arange(V, device=node.device), indptr[1:] - indptr[:-1])
    out = node.expand(V, V).clone()
    out[sources, indices] += values
    return out


def add_count_prior(logits: torch.Tensor, sources: torch.Tensor, node: torch.Tensor, indptr: torch.Tensor,
                    indices: torch.Tensor, values: torch.Tensor, max_degree: int) -> torch.Tensor:
    """`logits` (N, V) of the successors of `sources` (N,) plus the prior, its shapes fixed by (N, max_degree)."""
    out = logits + node.to(logits.dtype)
    if max_degree == 0:
        return out
    start = indptr[sources].unsqueeze(1)
    slot = start + torch.arange(max_degree, device=logits.device)
    real = slot < indptr[sources + 1].unsqueeze(1)
    slot = torch.where(real, slot, torch.zeros_like(slot))  # K >= 1 when any source has a successor
    add = torch.where(real, values[slot], torch.zeros((), dtype=values.dtype, device=values.device))
    return out.scatter_add(1, indices[slot], add.to(out.dtype))
