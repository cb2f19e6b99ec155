"""Which bigrams get their own edge: `--min_bigram_count auto` chooses the count from the data.

A real edge is d²+d parameters trained only on the occurrences of its bigram. A bigram seen once or twice in the
training text is often particular to the document it came from: its edge learns to predict it there, where it will
not come back, while a pair without an edge backs off to the shared edge and the learned `non_edge_bias`, which every
position trains. So the rule asks the training text itself which counts come back in text the counts were not taken
from (a held-out estimate, as Church and Gale's for bigram frequencies):

1. cut the training blocks, in their order, into 100 runs and set every 10th run aside (runs of consecutive blocks
   keep a document's sentences together, so the probe is other documents, as a validation set is);
2. count the bigrams of the other nine tenths; for the bigrams seen c..2c−1 times there, compare how often they occur
   in the probe with how often their counts predict (scaled by the sizes);
3. `min_bigram_count` is the smallest c whose bigrams come back at least `RECURRENCE` (80%) as often as predicted
   (classes with no bigram are skipped; past `MAX_COUNT` every bigram keeps its edge).

On text whose held-out part is more of the same (lines of one manual) even single bigrams come back and every bigram
keeps its edge; between documents of different subjects the rare ones do not and are pruned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECURRENCE = 0.8  # the share of its expected held-out occurrences a count class must show to keep its edges
RUNS, PROBE_EVERY = 100, 10
MAX_COUNT = 64  # above this every bigram keeps its edge (the estimate has few classes left to go on)


@dataclass
class PruningChoice:
    min_count: int
    recurrence: dict  # c -> held-out occurrences / expected, for the classes [c, 2c) looked at
    probe_tokens: int

    def describe(self) -> str:
        shown = ", ".join(f"{c}: {r:.2f}" for c, r in list(self.recurrence.items())[:6]) or "none to compare"
        return (f"--min_bigram_count auto chose {self.min_count}: bigrams seen c..2c-1 times in nine tenths of the "
                f"training blocks come back in the other tenth ({self.probe_tokens:,} tokens) at these shares of "
                f"their expected rate ({shown}); the smallest c at >= {RECURRENCE:.0%} keeps its edges")


def _bigram_keys(sequences, V: int) -> torch.Tensor:
    keys = [seq[:-1] * V + seq[1:] for seq in sequences if len(seq) > 1]
    if not keys:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(keys)


def choose_min_count(sequences, vocab_size: int) -> PruningChoice:
    """The `min_bigram_count` for these training sequences (int64 token tensors in data order); see the module."""
    sequences = list(sequences)
    n = len(sequences)
    run = max(1, -(-n // RUNS))
    fit = [s for i, s in enumerate(sequences) if (i // run) % PROBE_EVERY != PROBE_EVERY - 1]
    probe = [s for i, s in enumerate(sequences) if (i // run) % PROBE_EVERY == PROBE_EVERY - 1]
    fit_keys, probe_keys = _bigram_keys(fit, vocab_size), _bigram_keys(probe, vocab_size)
    if fit_keys.numel() == 0 or probe_keys.numel() == 0:
        return PruningChoice(1, {}, int(probe_keys.numel()))  # too little text to estimate: keep every bigram
    keys, counts = fit_keys.unique(return_counts=True)
    probe_unique, probe_counts = probe_keys.unique(return_counts=True)
    position = torch.searchsorted(probe_unique, keys).clamp_max(len(probe_unique) - 1)
    held = torch.where(probe_unique[position] == keys, probe_counts[position], 0)  # held-out count per bigram
    scale = probe_keys.numel() / fit_keys.numel()
    recurrence, keep_from = {}, 1
    for c in range(1, MAX_COUNT + 1):
        cls = (counts >= c) & (counts < 2 * c)
        expected = float(counts[cls].sum()) * scale
        if expected == 0:
            continue  # no bigram seen c..2c-1 times: nothing to decide
        recurrence[c] = float(held[cls].sum()) / expected
        if recurrence[c] >= RECURRENCE:
            break
        keep_from = c + 1
    return PruningChoice(keep_from, recurrence, int(probe_keys.numel()))
