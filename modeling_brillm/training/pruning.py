"""The data probe behind `--min_bigram_count auto` and `--signal_dropout auto`, from held-out runs of the training
blocks and the run's planned epochs; its numbers and formulas are rows of recipe.RULES (docs/training.md's table)."""

import math
from dataclasses import dataclass, replace

import torch

from .recipe import FIT_EPOCHS, MAX_DROPOUT, MIN_VISITS, NOVEL, PROBE_EVERY, RECURRENCE, RUNS


@dataclass
class PruningChoice:
    min_count: int
    recurrence: dict  # c -> held-out occurrences / expected, for the classes [c, 2c) looked at
    probe_tokens: int
    data_count: int  # the count the held-out estimate alone chose (min_count may be higher to fit the run)
    epochs: float | None = None  # the planned epochs at min_count, when the run's length was given
    novelty: float = 0.0  # share of the probe's bigram occurrences without an edge at data_count
    grown: bool = False  # whether the count grew with a run of more than FIT_EPOCHS passes
    novelty_at: dict | None = None  # c -> the novelty had the data count been c (1..4 and c0): what c0 adds

    def describe(self) -> str:
        shown = ", ".join(f"{c}: {r:.2f}" for c, r in list(self.recurrence.items())[:6]) or "none to compare"
        text = (f"--min_bigram_count auto chose {self.min_count}: bigrams seen c..2c-1 times in nine tenths of the "
                f"training blocks come back in the other tenth ({self.probe_tokens:,} tokens) at these shares of "
                f"their expected rate ({shown}); the smallest c at >= {RECURRENCE:.0%} is {self.data_count}")
        if self.min_count <= self.data_count:
            return text
        if self.grown:
            return (f"{text}, raised to {self.min_count}: a run of {self.epochs:.3g} planned epochs (past "
                    f"{FIT_EPOCHS:g}) on text that strays ({self.novelty:.1%} of the held-out tenth's bigrams have no "
                    "edge) keeps the data count's occurrences per pass")
        if self.novelty >= NOVEL and self.min_count == MIN_VISITS and (self.epochs or 1) >= 1:  # where text strays
            return (f"{text}; on text that strays ({self.novelty:.1%} of the held-out tenth's bigrams have no edge) a "
                    f"bigram seen once keeps no edge: {self.min_count}")
        return (f"{text}, raised to {self.min_count} so that every edge is a training target at least {MIN_VISITS} "
                f"times in the planned {self.epochs:.3g} epoch(s)")


def _bigram_keys(sequences: list, vocab_size: int, runs: int, probe_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, probe) bigram keys u·V + v of the sequences, every `probe_every`-th of `runs` runs of them the probe's
    (other documents, as a validation set is): one pass over all the tokens, not one per sequence."""
    if not sequences:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    tokens, lengths = torch.cat(sequences), torch.tensor([len(s) for s in sequences])
    run = torch.arange(len(sequences)) // max(1, -(-len(sequences) // runs))
    held = (run % probe_every == probe_every - 1).repeat_interleave(lengths)[:-1]  # by the bigram's first token
    starts = torch.zeros(len(tokens) + 1, dtype=torch.bool)
    starts[lengths.cumsum(0)] = True  # where each sequence after the first begins, and the end
    inside = ~starts[1:-1]  # tokens t and t + 1 lie in one sequence
    keys = tokens[:-1] * vocab_size + tokens[1:]
    return keys[inside & ~held], keys[inside & held]


@dataclass
class BigramProbe:
    """The held-out estimate, and the bigrams' counts (sorted keys u·V + v) that say what a count costs in time."""
    held_out: PruningChoice
    keys: torch.Tensor
    counts: torch.Tensor
    vocab_size: int

    def summary(self) -> dict:
        """The probe's figures, as recipe.json records them."""
        held = self.held_out
        return {"data_count": held.data_count, "novelty": held.novelty,
                "novelty_at": {str(c): v for c, v in (held.novelty_at or {}).items()},
                "probe_tokens": held.probe_tokens,
                "recurrence": {str(c): r for c, r in held.recurrence.items()}, "bigrams": int(self.keys.numel()),
                "most": int(self.counts.max()) if self.counts.numel() else 0, "vocab_size": self.vocab_size}


def probe_bigrams(sequences, vocab_size: int, runs: int = RUNS, probe_every: int = PROBE_EVERY,
                  recurrence: float = RECURRENCE) -> BigramProbe:
    """The held-out estimate and bigram counts of these training sequences (int64 tensors in data order); an
    ablation varies the probe's numbers, the recipe keeps recipe.py's."""
    fit, probe = (k.unique(return_counts=True) for k in _bigram_keys(list(sequences), vocab_size, runs, probe_every))
    keys, inverse = torch.cat([fit[0], probe[0]]).unique(return_inverse=True)  # merged: no sort of every bigram
    counts = torch.zeros(len(keys), dtype=torch.long).index_add_(0, inverse, torch.cat([fit[1], probe[1]]))
    return BigramProbe(_held_out_choice(*fit, *probe, recurrence), keys, counts, vocab_size)


def choose_min_count(sequences, vocab_size: int, planned_epochs: float | None = None,
                     epochs_grow_with_pruning: bool = False) -> PruningChoice:
    """`decide_min_count` of the probe of these training sequences."""
    return decide_min_count(probe_bigrams(sequences, vocab_size), planned_epochs, epochs_grow_with_pruning)


def decide_min_count(probe: BigramProbe, planned_epochs: float | None = None,
                     epochs_grow_with_pruning: bool = False) -> PruningChoice:
    """The count for a run of `planned_epochs` (None: not known, one pass); `epochs_grow_with_pruning`: a time
    budget's run, whose epochs are those at the least count the rule allows."""
    if planned_epochs is not None and planned_epochs <= 0:
        raise ValueError(f"planned_epochs must be positive, got {planned_epochs}")
    held, keys, counts = probe.held_out, probe.keys, probe.counts
    if keys.numel() == 0:
        return held
    most = int(counts.max())  # a larger count would leave no edge
    least = max(held.data_count, MIN_VISITS) if held.novelty >= NOVEL else held.data_count
    if planned_epochs is None:
        return replace(held, min_count=min(least, most))
    cost = _scored_successors(keys, counts, probe.vocab_size)  # c -> successors scored per token, relative to c = 1

    def epochs(c: int) -> float:
        return planned_epochs * (cost(least) / cost(c) if epochs_grow_with_pruning else 1.0)

    passes = max(0.0, planned_epochs / FIT_EPOCHS - 1)  # the passes past FIT_EPOCHS, in units of it
    grown = math.ceil(held.data_count * (1 + straying(held.novelty) * passes) - 1e-9)  # the long run's count
    c = max(least, grown)
    while c < most and c * epochs(c) < MIN_VISITS:
        c = c + 1 if c < 128 else math.ceil(c * 1.1)  # past 128, 10% steps suffice
    c = min(c, most)
    return replace(held, min_count=c, epochs=epochs(c), grown=grown > least and c == grown)


def straying(novelty: float) -> float:
    """The weight s of the long-run rules: 0 up to NOVEL, 1 from twice NOVEL, linear between."""
    return min(1.0, max(0.0, novelty / NOVEL - 1))


def _scored_successors(keys: torch.Tensor, counts: torch.Tensor, vocab_size: int):
    """c -> the successors the exact loss scores per training token when bigrams seen c times are edges."""
    sources = keys // vocab_size
    occurrences = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, sources, counts.double())
    per_edge = occurrences[sources]  # every occurrence of an edge's source scores it
    total = float(occurrences.sum())
    return lambda c: max(float(per_edge[counts >= c].sum()) / total, 1.0)


def _held_out_choice(keys, counts, probe_unique, probe_counts, recurrence: float) -> PruningChoice:
    """The held-out estimate from the fit's and the probe's bigrams (sorted keys, counts): the data count c0 (the
    smallest c whose class c..2c-1 comes back at `recurrence` of its expected rate), each class's recurrence, the
    novelty (held-out bigram occurrences without an edge) at c0."""
    fit_tokens, probe_tokens = int(counts.sum()), int(probe_counts.sum())
    if fit_tokens == 0 or probe_tokens == 0:
        return PruningChoice(1, {}, probe_tokens, 1)  # too little text to estimate: keep every bigram
    position = torch.searchsorted(probe_unique, keys).clamp_max(len(probe_unique) - 1)
    held = torch.where(probe_unique[position] == keys, probe_counts[position], 0)  # held-out count per bigram
    # every class c..2c-1 at once: prefix sums over the counts of the fit's occurrences and their held-out ones
    most = int(counts.max())
    seen = torch.zeros(2 * most + 1, dtype=torch.float64).index_add_(0, counts, counts.double()).cumsum(0)
    back = torch.zeros(2 * most + 1, dtype=torch.float64).index_add_(0, counts, held.double()).cumsum(0)
    c = torch.arange(1, most + 1)
    expected = (seen[2 * c - 1] - seen[c - 1]) * (probe_tokens / fit_tokens)
    returned = back[2 * c - 1] - back[c - 1]
    ratio = returned / expected.clamp_min(1e-300)
    looked = expected > 0  # a class with no bigram has nothing to decide
    met = (looked & (ratio >= recurrence)).nonzero()
    last = int(met[0]) + 1 if met.numel() else most  # the first class that comes back decides
    failed = c[looked & (ratio < recurrence) & (c < last)]
    data_count = int(failed.max()) + 1 if failed.numel() else 1  # the bigrams of every class that failed go
    shown = looked & (c <= last)
    rates = {int(k): float(r) for k, r in zip(c[shown], ratio[shown])}
    # the fit count of every probe bigram, for the share of the probe that gets no edge at the data count
    position = torch.searchsorted(keys, probe_unique).clamp_max(len(keys) - 1)
    fit_count = torch.where(keys[position] == probe_unique, counts[position], 0)
    def novelty(count: int) -> float:
        return float(probe_counts[fit_count < count].sum()) / probe_tokens

    return PruningChoice(data_count, rates, probe_tokens, data_count, novelty=novelty(data_count),
                         novelty_at={k: novelty(k) for k in sorted({1, 2, 3, 4, data_count})})


def choose_signal_dropout(novelty: float, epochs: float | None) -> tuple[float, str]:
    """`--signal_dropout auto` for text of this `novelty` and a run of `epochs` planned passes (None: one): (p, why)."""
    s = straying(novelty)
    strays = f"{novelty:.1%} of the held-out tenth's bigrams have no edge"
    if epochs is None or epochs <= FIT_EPOCHS or s == 0:
        planned = "the run's length is not known" if epochs is None else f"the run plans {epochs:.3g} epoch(s)"
        return 0.0, f"--signal_dropout auto chose 0: {planned} (past {FIT_EPOCHS:g} drops), {strays} (from {NOVEL:.0%})"
    p = round(MAX_DROPOUT * s * (1 - FIT_EPOCHS / epochs), 3)
    return p, (f"--signal_dropout auto chose {p:g} = {MAX_DROPOUT:g} x {s:.2g} x (1 - {FIT_EPOCHS:g} / {epochs:.3g} "
               f"planned epochs): {strays}, and past its first passes a run learns its documents' particulars")
