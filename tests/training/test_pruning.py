"""`--min_bigram_count auto`: the count comes from how often bigrams of each count recur in held-back text."""

import torch

from modeling_brillm.training.pruning import RECURRENCE, choose_min_count

V = 50


def repeated_text(runs: int = 200, length: int = 40) -> list[torch.Tensor]:
    """Every block the same few sentences: every bigram recurs everywhere."""
    g = torch.Generator().manual_seed(0)
    sentences = [torch.randint(0, V, (length,), generator=g) for _ in range(5)]
    return [sentences[i % 5] for i in range(runs)]


def documents_with_private_bigrams(blocks: int = 2000) -> list[torch.Tensor]:
    """A shared language (tokens 0..9, frequent bigrams) plus, in every run of blocks, a few bigrams of private
    tokens (10..49) that appear a couple of times in that run and nowhere else."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(blocks):
        common = torch.randint(0, 10, (12,), generator=g)
        doc = i // 20  # 20 consecutive blocks: one document
        private = torch.tensor([10 + doc % 40, 10 + (doc * 7 + 3) % 40])
        out.append(torch.cat([common, private]) if i % 10 == 0 else common)
    return out


def test_text_that_repeats_keeps_every_bigram():
    choice = choose_min_count(repeated_text(), V)
    assert choice.min_count == 1
    assert choice.recurrence[min(choice.recurrence)] >= RECURRENCE  # the first class met the bar
    assert "auto chose 1" in choice.describe()


def test_bigrams_private_to_documents_are_pruned():
    choice = choose_min_count(documents_with_private_bigrams(), V)
    assert choice.min_count > 1
    assert all(choice.recurrence[c] < RECURRENCE for c in range(1, choice.min_count) if c in choice.recurrence)
    common = torch.cat([b[:12] for b in documents_with_private_bigrams()])
    fewest = (common[:-1] * V + common[1:]).unique(return_counts=True)[1].min()
    assert choice.min_count <= 0.9 * fewest  # the shared language's bigrams keep their edges


def test_too_little_text_keeps_every_bigram():
    choice = choose_min_count([torch.tensor([1, 2, 3])], V)
    assert choice.min_count == 1 and choice.recurrence == {}
