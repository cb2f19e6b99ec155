"""`--min_bigram_count auto` and `--signal_dropout auto`: the count comes from how often bigrams of each count recur in
held-back text and from the run's length; the dropout from the run's length."""

import math

import pytest
import torch

from modeling_brillm.training.pruning import (
    FIT_EPOCHS,
    MAX_DROPOUT,
    MIN_VISITS,
    NOVEL,
    RECURRENCE,
    choose_min_count,
    choose_signal_dropout,
    probe_bigrams,
    straying,
)
from modeling_brillm.training.recipe import PROBE_EVERY, RUNS

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
    text = repeated_text()
    choice = choose_min_count(text, V)
    assert choice.data_count == 1 and choice.recurrence[min(choice.recurrence)] >= RECURRENCE  # the first class
    fewest = (torch.cat(text)[:-1] * V + torch.cat(text)[1:]).unique(return_counts=True)[1].min()
    assert choice.min_count <= fewest  # every bigram recurs, so every bigram keeps its edge
    assert "the smallest c at >= 80% is 1" in choice.describe()



def test_the_probes_numbers_are_arguments_an_ablation_can_vary():
    text = documents_with_private_bigrams()
    default = probe_bigrams(text, V).held_out
    assert default == probe_bigrams(text, V, runs=RUNS, probe_every=PROBE_EVERY, recurrence=RECURRENCE).held_out
    assert default.data_count > 1 and probe_bigrams(text, V, recurrence=0).held_out.data_count == 1  # neutral
    halves = probe_bigrams(text, V, probe_every=2).held_out  # every other run held out
    assert halves.probe_tokens == pytest.approx(sum(len(s) - 1 for s in text) / 2, rel=0.05)  # bigrams
    assert probe_bigrams(text, V, runs=len(text)).held_out.probe_tokens < default.probe_tokens  # single blocks

def test_novelty_at_each_count_is_what_the_data_count_would_give():
    """novelty_at[c] is the novelty the probe reports when its data count is c: the same held-out occurrences, the
    more of them without an edge the higher the count."""
    text = documents_with_private_bigrams()
    held = probe_bigrams(text, V).held_out
    assert held.novelty_at[held.data_count] == held.novelty
    assert probe_bigrams(text, V, recurrence=0).held_out.novelty == held.novelty_at[1]  # c0 = 1
    shares = [held.novelty_at[c] for c in range(1, 5)]
    assert shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 1
    assert choose_min_count(text, V, planned_epochs=4.0).novelty_at == held.novelty_at  # kept with the choice


def test_bigrams_private_to_documents_are_pruned():
    choice = choose_min_count(documents_with_private_bigrams(), V)
    assert choice.min_count > 1
    assert all(choice.recurrence[c] < RECURRENCE for c in range(1, choice.min_count) if c in choice.recurrence)
    common = torch.cat([b[:12] for b in documents_with_private_bigrams()])
    fewest = (common[:-1] * V + common[1:]).unique(return_counts=True)[1].min()
    assert choice.min_count <= 0.9 * fewest  # the shared language's bigrams keep their edges


def uniform_text(blocks: int = 140, length: int = 30) -> list[torch.Tensor]:
    """Tokens drawn uniformly: a bigram seen once comes back as often as its count says, yet a quarter of the
    held-out bigrams were never seen."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, V, (length,), generator=g) for _ in range(blocks)]


def test_a_bigram_seen_once_keeps_no_edge_where_text_strays():
    """Singles that come back as a class still get no edge of their own where much of the held-out text is new."""
    text = uniform_text()
    choice = choose_min_count(text, V)
    assert choice.data_count == 1 and choice.recurrence[1] >= RECURRENCE and choice.novelty >= NOVEL
    assert choice.min_count == MIN_VISITS == 2
    assert f"a bigram seen once keeps no edge: {MIN_VISITS}" in choice.describe()
    assert choose_min_count(repeated_text(), V).min_count == 1  # familiar text: singles keep their edges
    timed = choose_min_count(text, V, planned_epochs=FIT_EPOCHS, epochs_grow_with_pruning=True)
    assert (timed.min_count, timed.epochs, timed.grown) == (MIN_VISITS, FIT_EPOCHS, False)
    once = [torch.arange(i * 5, i * 5 + 5) for i in range(200)]  # every bigram seen once: a graph still has edges
    assert choose_min_count(once, 1000).min_count == 1


def test_too_little_text_keeps_every_bigram():
    choice = choose_min_count([torch.tensor([1, 2, 3])], V)
    assert choice.min_count == 1 and choice.recurrence == {}


# ------------------------------------------------------------------------------------------- the run's length
def test_a_short_run_raises_the_count_until_every_edge_is_trained_enough():
    """A run of half a pass reads half the text: an edge seen c times in it is a target c / 2 times."""
    text = repeated_text()
    one = choose_min_count(text, V, planned_epochs=1.0)
    assert (one.data_count, one.min_count, one.epochs) == (1, MIN_VISITS, 1.0)
    half = choose_min_count(text, V, planned_epochs=0.5)
    assert half.min_count == 2 * MIN_VISITS
    assert (f"raised to {2 * MIN_VISITS} so that every edge is a training target at least {MIN_VISITS} times in "
            "the planned 0.5 epoch(s)") in half.describe()
    assert choose_min_count(text, V, planned_epochs=MIN_VISITS).min_count == 1  # familiar text, two passes


def test_a_run_of_a_few_passes_keeps_the_data_count():
    text = documents_with_private_bigrams()
    long = choose_min_count(text, V, planned_epochs=FIT_EPOCHS)
    assert long.min_count == long.data_count == choose_min_count(text, V).min_count >= MIN_VISITS
    assert "raised" not in long.describe() and not long.grown


def zipf_text(blocks: int = 400, length: int = 30) -> list[torch.Tensor]:
    """Tokens drawn by Zipf's law: frequent tokens have many rare successors, as in text."""
    g = torch.Generator().manual_seed(2)
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    return [torch.multinomial(weights, length, replacement=True, generator=g) for _ in range(blocks)]


def test_a_time_budget_counts_the_epochs_pruning_buys():
    """With a time budget a sparser graph scores fewer successors per token and so trains more epochs: the count is
    the smallest whose own epochs reach the bar, below the count a fixed number of epochs needs."""
    text = zipf_text()
    fixed = choose_min_count(text, V, planned_epochs=0.2)
    timed = choose_min_count(text, V, planned_epochs=0.2, epochs_grow_with_pruning=True)
    assert fixed.min_count == MIN_VISITS * 5 and fixed.epochs == 0.2
    assert timed.data_count < timed.min_count < fixed.min_count
    assert timed.epochs > 0.2 and timed.min_count * timed.epochs >= MIN_VISITS


def test_a_tiny_run_still_keeps_the_most_frequent_edge():
    text = repeated_text()
    most = int((torch.cat(text)[:-1] * V + torch.cat(text)[1:]).unique(return_counts=True)[1].max())
    choice = choose_min_count(text, V, planned_epochs=1e-6)
    assert choice.min_count <= most + 1  # a graph can still be built (the most frequent bigram keeps its edge)
    with pytest.raises(ValueError, match="planned_epochs must be positive"):
        choose_min_count(text, V, planned_epochs=0)


# ------------------------------------------------------------------------------------------- signal dropout
WIDE = 1000  # a vocabulary with room for every document's own words


def documents_of_their_own(blocks: int = 2000) -> list[torch.Tensor]:
    """Every document (20 consecutive blocks) half in six words of its own: much of any held-out part has no edge."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(blocks):
        own = 10 + 6 * (i // 20) + torch.randint(0, 6, (16,), generator=g)
        common = torch.randint(0, 10, (16,), generator=g)
        out.append(torch.where(torch.rand(16, generator=g) < 0.5, own, common))
    return out


def test_a_long_run_raises_the_count_with_its_epochs():
    """Past FIT_EPOCHS an edge must keep the data count's occurrences per planned pass: the count grows in
    proportion to the epochs planned at the least count, without a ceiling."""
    text = documents_of_their_own()
    data = choose_min_count(text, WIDE).data_count
    assert data >= MIN_VISITS
    at_bar = choose_min_count(text, WIDE, planned_epochs=FIT_EPOCHS)
    assert at_bar.min_count == data and "raised" not in at_bar.describe()
    long = choose_min_count(text, WIDE, planned_epochs=3 * FIT_EPOCHS)
    assert long.min_count == 3 * data and long.data_count == data and long.grown
    assert straying(long.novelty) == 1
    assert f"raised to {3 * data}: a run of {3 * FIT_EPOCHS:g} planned epochs (past {FIT_EPOCHS:g})" in long.describe()
    assert choose_min_count(text, WIDE, planned_epochs=1.25 * FIT_EPOCHS).min_count == math.ceil(1.25 * data)
    # with a time budget the epochs a sparser graph buys do not feed back into the count
    timed = choose_min_count(text, WIDE, planned_epochs=3 * FIT_EPOCHS, epochs_grow_with_pruning=True)
    assert timed.min_count == 3 * data and timed.epochs >= 3 * FIT_EPOCHS


def test_a_long_run_on_familiar_text_keeps_the_data_count_and_its_signal():
    """Where held-out text is more of the same, a document's particulars come back too: no growth, no dropout."""
    text = documents_with_private_bigrams()
    choice = choose_min_count(text, V, planned_epochs=100.0)
    assert choice.novelty < NOVEL and choice.min_count == choice.data_count and not choice.grown
    assert choose_signal_dropout(choice.novelty, 100.0)[0] == 0.0


def test_signal_dropout_grows_smoothly_with_the_run_and_the_novelty():
    far = 2 * NOVEL  # full weight
    assert choose_signal_dropout(far, None)[0] == 0.0  # length unknown: one pass
    assert choose_signal_dropout(far, FIT_EPOCHS)[0] == 0.0
    assert 0 < choose_signal_dropout(far, 1.01 * FIT_EPOCHS)[0] < 0.01  # no step at FIT_EPOCHS
    p, why = choose_signal_dropout(far, 2 * FIT_EPOCHS)
    assert p == MAX_DROPOUT / 2 and f"auto chose {p:g} = {MAX_DROPOUT:g} x 1 x (1 - 2 / 4 planned epochs)" in why
    ps = [choose_signal_dropout(far, e)[0] for e in (3, 5, 8, 20, 1000)]
    assert ps == sorted(ps) and MAX_DROPOUT - 0.01 < ps[-1] <= MAX_DROPOUT
    # and none at NOVEL, half of it half-way to twice NOVEL: no step in the novelty either
    assert [straying(n) for n in (0.0, NOVEL, 1.5 * NOVEL, 2 * NOVEL, 0.9)] == pytest.approx([0, 0, 0.5, 1, 1])
    assert choose_signal_dropout(NOVEL, 100.0)[0] == 0.0
    assert choose_signal_dropout(1.5 * NOVEL, 2 * FIT_EPOCHS)[0] == pytest.approx(MAX_DROPOUT / 4)
    assert choose_signal_dropout(1.01 * NOVEL, 2 * FIT_EPOCHS)[0] < 0.01
    with pytest.raises(ValueError, match="planned_epochs must be positive"):
        choose_min_count(repeated_text(), V, planned_epochs=-1)
