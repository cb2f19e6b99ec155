"""Which bigrams get their own edge (`--min_bigram_count auto`) and whether the signal needs dropout
(`--signal_dropout auto`): both chosen from held-out parts of the training text; the rate goes with the dropout
(`--learning_rate auto`). The numbers are defined in recipe.py, with why and evidence (docs/training.md's table).

A real edge is d²+d parameters trained only on the occurrences of its bigram. A bigram seen once or twice in the
training text is often particular to the document it came from: its edge learns to predict it there, where it will
not come back, while a pair without an edge backs off to the shared edge and the learned `non_edge_bias`, which every
position trains. So the rule asks the training text itself which counts come back in text the counts were not taken
from (a held-out estimate, as Church and Gale's for bigram frequencies):

1. cut the training blocks, in their order, into `RUNS` runs and set every `PROBE_EVERY`-th run aside (runs of
   consecutive blocks keep a document's sentences together, so the probe is other documents, as a validation set is);
2. count the bigrams of the other runs; for the bigrams seen c..2c−1 times there, compare how often they occur in the
   probe with how often their counts predict (scaled by the sizes);
3. the data count is the smallest c whose bigrams come back at least `RECURRENCE` as often as predicted (classes
   with no bigram are skipped; past `MAX_COUNT` every bigram keeps its edge).

Where held-out text strays (its `novelty`: the share of the probe's bigram occurrences without an edge at the data
count, reaches the lower dropout bar) a bigram seen once never keeps an edge (`STRAYING_COUNT`): its edge has one
occurrence of one document to learn from, and the back-off predicts the pair better.

The count also has to fit the run (`planned_epochs`): it is raised, if need be, until an edge is a training target
at least `MIN_VISITS` times in the planned run, c · epochs >= MIN_VISITS (with a time budget the epochs grow as a
sparser graph scores fewer successors per token: `epochs_grow_with_pruning`).

Where novelty is large, a long run learns contexts particular to the training documents and its held-out loss turns
up after a few epochs. So `choose_signal_dropout` drops the signal (p = `DROPOUT`) where a run plans more epochs than
`DROPOUT_BARS` allows at its novelty, and `LONG_DROPOUT` past `LONG_EPOCHS`; pretraining grows p from 0 over the
first epoch (`epochs.warm_signal_dropout`), where no block has been seen before. Past its growth bar the count grows
in proportion to the planned epochs, c >= data count · epochs / bar, up to `MAX_GROWTH` times the data count: an
edge keeps as many occurrences per planned pass as the data count gave it at the bar. The epochs are those planned
at the data count (counting those a sparser graph buys would feed the count back into itself). A lower rate fits
sooner: a gain where the signal drops, a loss where nothing holds over-fitting off, so `choose_learning_rate` takes
`DROPPING_RATE` wherever the signal drops and `RATE` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .recipe import (  # the numbers of the recipe are defined in recipe.py, with why and evidence
    DROPOUT,
    DROPOUT_BARS,
    DROPPING_RATE,
    LONG_DROPOUT,
    LONG_EPOCHS,
    MAX_COUNT,
    MAX_GROWTH,
    MIN_VISITS,
    PROBE_EVERY,
    RATE,
    RECURRENCE,
    RUNS,
    STRAYING_COUNT,
    Bar,
)

__all__ = ["DROPOUT", "DROPOUT_BARS", "DROPPING_RATE", "LONG_DROPOUT", "LONG_EPOCHS", "MAX_COUNT", "MAX_GROWTH",
           "MIN_VISITS", "RATE", "RECURRENCE", "STRAYING_COUNT", "Bar", "BigramProbe", "DropoutChoice",
           "PruningChoice", "choose_learning_rate", "choose_min_count", "choose_signal_dropout", "decide_min_count",
           "dropout_bar", "probe_bigrams"]


@dataclass
class PruningChoice:
    min_count: int
    recurrence: dict  # c -> held-out occurrences / expected, for the classes [c, 2c) looked at
    probe_tokens: int
    data_count: int  # the count the held-out estimate alone chose (min_count may be higher to fit the run)
    epochs: float | None = None  # the planned epochs at min_count, when the run's length was given
    novelty: float = 0.0  # share of the probe's bigram occurrences without an edge at data_count
    # where the count grew with the epochs: (epochs at the floor, bar, whether MAX_GROWTH held it below their ask)
    long_run: tuple[float, float, bool] | None = None

    @property
    def floor(self) -> int:
        """The least count for this text: the data count, and no edge for a bigram seen once where text strays."""
        return max(self.data_count, STRAYING_COUNT) if dropout_bar(self.novelty) is not None else self.data_count

    def describe(self) -> str:
        shown = ", ".join(f"{c}: {r:.2f}" for c, r in list(self.recurrence.items())[:6]) or "none to compare"
        text = (f"--min_bigram_count auto chose {self.min_count}: bigrams seen c..2c-1 times in nine tenths of the "
                f"training blocks come back in the other tenth ({self.probe_tokens:,} tokens) at these shares of "
                f"their expected rate ({shown}); the smallest c at >= {RECURRENCE:.0%} is {self.data_count}")
        if self.floor > self.data_count:
            text += (f"; on text that strays ({self.novelty:.1%} of the held-out tenth's bigrams have no edge) a "
                     f"bigram seen once keeps no edge: {self.floor}")
        if self.epochs is None:
            return text
        if self.min_count <= self.floor:
            return f"{text}; the planned {self.epochs:.3g} epoch(s) train its edges at least {MIN_VISITS} times"
        if self.long_run is not None:
            epochs, bar, capped = self.long_run
            bound = f"{self.data_count} x {epochs:.3g} epochs (planned at {self.floor}) / {bar:g}"
            if capped:
                wanted = math.ceil(self.data_count * epochs / bar - 1e-9)
                bound = f", at most {MAX_GROWTH:g} x {self.data_count} ({bound} asks for {wanted})"
            else:
                bound = f" >= {bound}"
            return (f"{text}, raised to {self.min_count}{bound}: held-out text strays ({self.novelty:.1%} of "
                    "its bigrams have no edge), and a long run's edges must keep enough occurrences per pass")
        return (f"{text}, raised to {self.min_count} so that every edge is a training target at least "
                f"{MIN_VISITS} times in the planned {self.epochs:.3g} epoch(s)")


def _bigram_keys(sequences, V: int) -> torch.Tensor:
    keys = [seq[:-1] * V + seq[1:] for seq in sequences if len(seq) > 1]
    if not keys:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(keys)


@dataclass
class BigramProbe:
    """What the probe reads from the training sequences: the held-out estimate, and the bigrams' counts (sorted
    keys u·V + v) that say what a count costs in time."""
    held_out: PruningChoice
    keys: torch.Tensor
    counts: torch.Tensor
    vocab_size: int

    def summary(self) -> dict:
        """The probe's figures, as recipe.json records them."""
        held = self.held_out
        return {"data_count": held.data_count, "novelty": held.novelty, "probe_tokens": held.probe_tokens,
                "recurrence": {str(c): r for c, r in held.recurrence.items()}, "bigrams": int(self.keys.numel()),
                "most": int(self.counts.max()) if self.counts.numel() else 0, "vocab_size": self.vocab_size}


def probe_bigrams(sequences, vocab_size: int) -> BigramProbe:
    """The held-out estimate (steps 1 to 3 of the module) and the bigram counts of these training sequences (int64
    token tensors in data order)."""
    sequences = list(sequences)
    keys, counts = _bigram_keys(sequences, vocab_size).unique(return_counts=True)
    return BigramProbe(_held_out_choice(sequences, vocab_size), keys, counts, vocab_size)


def choose_min_count(sequences, vocab_size: int, planned_epochs: float | None = None,
                     epochs_grow_with_pruning: bool = False) -> PruningChoice:
    """The `min_bigram_count` for these training sequences (int64 token tensors in data order); see the module.
    `planned_epochs`: the run's length in epochs (None: not known, the held-out estimate alone decides); with
    `epochs_grow_with_pruning` it is the length of a run with a time budget at the count chosen without it
    (`PruningChoice.floor`)."""
    return decide_min_count(probe_bigrams(sequences, vocab_size), planned_epochs, epochs_grow_with_pruning)


def decide_min_count(probe: BigramProbe, planned_epochs: float | None = None,
                     epochs_grow_with_pruning: bool = False) -> PruningChoice:
    """`choose_min_count` from the probe of the sequences."""
    if planned_epochs is not None and planned_epochs <= 0:
        raise ValueError(f"planned_epochs must be positive, got {planned_epochs}")
    choice, keys, counts, vocab_size = probe.held_out, probe.keys, probe.counts, probe.vocab_size
    if keys.numel() == 0:
        return choice
    most = int(counts.max())  # a larger count would leave no edge
    if planned_epochs is None:
        return replace(choice, min_count=min(choice.floor, most))
    cost = _scored_successors(keys, counts, vocab_size)  # c -> successors scored per token, relative to c = 1

    def epochs(c: int) -> float:
        return planned_epochs * (cost(choice.floor) / cost(c) if epochs_grow_with_pruning else 1.0)

    bar = dropout_bar(choice.novelty)
    past_bar = bar is not None and planned_epochs > bar.growth
    wanted = choice.data_count * planned_epochs / bar.growth if past_bar else 0.0  # the long run's bound on c,
    per_pass = min(wanted, math.floor(MAX_GROWTH * choice.data_count))  # up to MAX_GROWTH x the data count

    c = choice.floor
    while c < most and (c * epochs(c) < MIN_VISITS or c < per_pass - 1e-9):
        c = c + 1 if c < 2 * MAX_COUNT else math.ceil(c * 1.1)  # past 128, 10% steps suffice
    c = min(c, most)
    # past a bar (>= 2 epochs) the data count already meets MIN_VISITS, so any raise there is the long run's
    long_run = (planned_epochs, bar.growth, wanted > per_pass + 1e-9) if past_bar and c > choice.floor else None
    return PruningChoice(c, choice.recurrence, choice.probe_tokens, choice.data_count, epochs(c), choice.novelty,
                         long_run)


def _scored_successors(keys: torch.Tensor, counts: torch.Tensor, vocab_size: int):
    """c -> the mean number of successors the exact loss scores per training token when bigrams seen at least c
    times are edges (a token u scores every successor of u)."""
    sources = keys // vocab_size
    occurrences = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, sources, counts.double())
    per_edge = occurrences[sources]  # every occurrence of an edge's source scores it
    total = float(occurrences.sum())
    return lambda c: max(float(per_edge[counts >= c].sum()) / total, 1.0)


def _held_out_choice(sequences: list, vocab_size: int) -> PruningChoice:
    """The held-out estimate of the module docstring (steps 1 to 3)."""
    n = len(sequences)
    run = max(1, -(-n // RUNS))
    fit = [s for i, s in enumerate(sequences) if (i // run) % PROBE_EVERY != PROBE_EVERY - 1]
    probe = [s for i, s in enumerate(sequences) if (i // run) % PROBE_EVERY == PROBE_EVERY - 1]
    fit_keys, probe_keys = _bigram_keys(fit, vocab_size), _bigram_keys(probe, vocab_size)
    if fit_keys.numel() == 0 or probe_keys.numel() == 0:
        return PruningChoice(1, {}, int(probe_keys.numel()), 1)  # too little text to estimate: keep every bigram
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
    # the fit count of every probe bigram, for the share of the probe that gets no edge at keep_from
    position = torch.searchsorted(keys, probe_unique).clamp_max(len(keys) - 1)
    fit_count = torch.where(keys[position] == probe_unique, counts[position], 0)
    novelty = float(probe_counts[fit_count < keep_from].sum()) / probe_keys.numel()
    return PruningChoice(keep_from, recurrence, int(probe_keys.numel()), keep_from, novelty=novelty)


@dataclass
class DropoutChoice:
    p: float
    novelty: float
    epochs: float | None

    def describe(self) -> str:
        head = (f"--signal_dropout auto chose {self.p:g}: {self.novelty:.1%} of the held-out tenth's bigrams have "
                "no edge")
        reached = dropout_bar(self.novelty)
        if reached is None:
            return f"{head} (< {DROPOUT_BARS[-1].novelty:.0%})"
        novelty, bar = reached.novelty, reached.dropout
        head += f" (>= {novelty:.0%})"
        if self.epochs is None:
            return head
        head += f" and the run plans {self.epochs:.3g} epoch(s) ({'>' if self.epochs > bar else '<='} {bar:g}"
        return head + (f"; > {LONG_EPOCHS:g}: a long run drops more)" if self.epochs > LONG_EPOCHS else ")")


def choose_learning_rate(signal_dropout: float) -> tuple[float, str]:
    """`--learning_rate auto` for a model that drops its signal at `signal_dropout` (see `RATE`): (rate, why)."""
    if signal_dropout > 0:
        return DROPPING_RATE, (f"--learning_rate auto chose {DROPPING_RATE:g}: the signal drops at "
                               f"{signal_dropout:g}, which holds off the over-fitting a lower rate reaches sooner")
    return RATE, f"--learning_rate auto chose {RATE:g}: the signal does not drop"


def dropout_bar(novelty: float) -> Bar | None:
    """The first of `DROPOUT_BARS` that `novelty` reaches, or None."""
    return next((bar for bar in DROPOUT_BARS if novelty >= bar.novelty), None)


def choose_signal_dropout(novelty: float, epochs: float | None = None) -> DropoutChoice:
    """`--signal_dropout auto` (see the module): `DROPOUT` where held-out text strays from the training text
    (`PruningChoice.novelty`) and the run of `epochs` (None: not known) is long enough at that novelty to learn the
    documents' particulars (`DROPOUT_BARS`), `LONG_DROPOUT` past `LONG_EPOCHS`; else 0. Length unknown: the novelty
    decides."""
    bar = dropout_bar(novelty)
    if bar is None or (epochs is not None and epochs <= bar.dropout):
        return DropoutChoice(0.0, novelty, epochs)
    return DropoutChoice(LONG_DROPOUT if epochs is not None and epochs > LONG_EPOCHS else DROPOUT, novelty, epochs)
