"""`--min_bigram_count auto`: the count comes from how often bigrams of each count recur in held-back text."""

import math

import pytest
import torch

from modeling_brillm.training.pruning import (
    DROPOUT,
    DROPOUT_BARS,
    LONG_DROPOUT,
    LONG_EPOCHS,
    MAX_GROWTH,
    MIN_VISITS,
    RECURRENCE,
    STRAYING_COUNT,
    choose_learning_rate,
    choose_min_count,
    choose_signal_dropout,
)

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


def uniform_text(blocks: int = 140, length: int = 30) -> list[torch.Tensor]:
    """Tokens drawn uniformly: a bigram seen once comes back as often as its count says, yet a quarter of the
    held-out bigrams were never seen."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, V, (length,), generator=g) for _ in range(blocks)]


def test_a_bigram_seen_once_keeps_no_edge_where_text_strays():
    """Singles that come back as a class still get no edge of their own where much of the held-out text is new."""
    text = uniform_text()
    choice = choose_min_count(text, V)
    assert choice.data_count == 1 and choice.recurrence[1] >= RECURRENCE
    assert choice.novelty >= DROPOUT_BARS[0][0]
    assert choice.min_count == STRAYING_COUNT == 2
    assert f"a bigram seen once keeps no edge: {STRAYING_COUNT}" in choice.describe()
    # a time budget's epochs were planned at that count: the floor buys no more of them, and is no long run's raise
    timed = choose_min_count(text, V, planned_epochs=3.0, epochs_grow_with_pruning=True)
    assert (timed.min_count, timed.epochs, timed.long_run) == (STRAYING_COUNT, 3.0, None)
    assert "raised" not in timed.describe()
    assert choose_min_count(repeated_text(), V).min_count == 1  # familiar text: singles keep their edges
    once = [torch.arange(i * 5, i * 5 + 5) for i in range(200)]  # every bigram seen once: a graph still has edges
    assert choose_min_count(once, 1000).min_count == 1


def test_too_little_text_keeps_every_bigram():
    choice = choose_min_count([torch.tensor([1, 2, 3])], V)
    assert choice.min_count == 1 and choice.recurrence == {}


# ------------------------------------------------------------------------------------------- the run's length
def test_a_short_run_raises_the_count_until_every_edge_is_trained_enough():
    """One planned epoch: an edge seen c times is a target c times, so the count rises to MIN_VISITS."""
    text = repeated_text()
    assert choose_min_count(text, V).min_count == 1
    short = choose_min_count(text, V, planned_epochs=1.0)
    assert (short.data_count, short.min_count, short.epochs) == (1, MIN_VISITS, 1.0)
    assert f"raised to {MIN_VISITS}" in short.describe()
    half = choose_min_count(text, V, planned_epochs=0.5)
    assert half.min_count == 2 * MIN_VISITS


def test_a_long_run_keeps_the_data_count():
    long = choose_min_count(documents_with_private_bigrams(), V, planned_epochs=float(MIN_VISITS))
    assert long.min_count == long.data_count == choose_min_count(documents_with_private_bigrams(), V).min_count
    assert "raised" not in long.describe() and f"at least {MIN_VISITS} times" in long.describe()


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


def test_novelty_is_the_held_out_share_of_bigrams_without_an_edge():
    assert choose_min_count(repeated_text(), V).novelty == 0.0  # every held-out bigram was seen in training
    choice = choose_min_count(documents_of_their_own(), WIDE)
    assert choice.novelty >= DROPOUT_BARS[0][0]
    assert choose_min_count(documents_of_their_own(), WIDE, planned_epochs=10.0).novelty == choice.novelty


def test_a_long_run_on_text_that_strays_raises_the_count_with_its_epochs():
    """Past its novelty's bar an edge must keep the data count's occurrences per planned pass: the count grows in
    proportion to the epochs planned at the data count."""
    text = documents_of_their_own()
    data = choose_min_count(text, WIDE).data_count
    bar = DROPOUT_BARS[0].growth  # this text strays far: the first bar
    at_bar = choose_min_count(text, WIDE, planned_epochs=bar)
    assert at_bar.min_count == data and "raised" not in at_bar.describe()
    long = choose_min_count(text, WIDE, planned_epochs=3 * bar)
    assert long.min_count == 3 * data and long.data_count == data
    assert f"raised to {3 * data} >= {data} x {3 * bar:g} epochs (planned at {data}) / {bar:g}" in long.describe()
    assert choose_min_count(text, WIDE, planned_epochs=1.25 * bar).min_count == math.ceil(1.25 * data)
    # with a time budget the epochs a sparser graph buys do not feed back into the count
    timed = choose_min_count(text, WIDE, planned_epochs=3 * bar, epochs_grow_with_pruning=True)
    assert timed.min_count == 3 * data and timed.epochs >= 3 * bar


def test_the_count_grows_at_most_max_growth_times_the_data_count():
    """A very long run still keeps the pairs that come back: the growth stops at MAX_GROWTH x the data count, and
    the start-up line says the cap decided."""
    text = documents_of_their_own()
    data = choose_min_count(text, WIDE).data_count
    bar = DROPOUT_BARS[0].growth
    cap = math.floor(MAX_GROWTH * data)
    reached = choose_min_count(text, WIDE, planned_epochs=cap * bar / data)  # the growth meets the cap
    assert reached.min_count == cap and f"raised to {cap} >= {data} x" in reached.describe()
    very_long = choose_min_count(text, WIDE, planned_epochs=10 * MAX_GROWTH * bar)
    assert very_long.min_count == cap and very_long.data_count == data
    wanted = math.ceil(data * 10 * MAX_GROWTH)
    assert (f"raised to {cap}, at most {MAX_GROWTH:g} x {data} ({data} x {10 * MAX_GROWTH * bar:.3g} epochs "
            f"(planned at {data}) / {bar:g} asks for {wanted})") in very_long.describe()


def test_a_long_run_on_familiar_text_keeps_the_data_count():
    """Where held-out text is more of the same, a rare edge's particulars come back too: no growth."""
    text = documents_with_private_bigrams()
    choice = choose_min_count(text, V, planned_epochs=100.0)
    assert choice.novelty < DROPOUT_BARS[-1][0] and choice.min_count == choice.data_count


def test_signal_dropout_where_held_out_text_strays_and_the_run_is_long():
    bar = DROPOUT_BARS[0].dropout
    strays = choose_min_count(documents_of_their_own(), WIDE, planned_epochs=1.25 * bar)
    long = choose_signal_dropout(strays.novelty, strays.epochs)
    assert long.p == DROPOUT and f"auto chose {DROPOUT:g}" in long.describe()
    assert long.describe().endswith(f"the run plans {1.25 * bar:.3g} epoch(s) (> {bar:g})")
    short = choose_signal_dropout(strays.novelty, bar)  # too short to learn the documents' particulars
    assert short.p == 0.0 and f"<= {bar:g}" in short.describe()
    assert choose_signal_dropout(strays.novelty).p == DROPOUT  # length unknown: the data decides
    familiar = choose_min_count(repeated_text(), V, planned_epochs=100.0)
    assert choose_signal_dropout(familiar.novelty, familiar.epochs).p == 0.0


def test_signal_dropout_is_all_or_nothing_at_the_bar():
    novelty = choose_min_count(documents_of_their_own(), WIDE).novelty
    bar = DROPOUT_BARS[0].dropout
    assert choose_signal_dropout(novelty, bar).p == 0.0  # up to the bar: none
    assert choose_signal_dropout(novelty, 1.01 * bar).p == DROPOUT  # just past it: all of it
    assert choose_signal_dropout(0.0, 100 * bar).p == 0.0  # familiar text: no dropout however long


def test_a_run_past_long_epochs_drops_more():
    """Over many passes even the dropout of the bar lets held-out loss turn up: a long run drops more."""
    novelty = choose_min_count(documents_of_their_own(), WIDE).novelty
    assert DROPOUT_BARS[-1].dropout < LONG_EPOCHS and DROPOUT < LONG_DROPOUT < 1
    assert choose_signal_dropout(novelty, LONG_EPOCHS).p == DROPOUT
    long = choose_signal_dropout(novelty, 1.01 * LONG_EPOCHS)
    assert long.p == LONG_DROPOUT and long.describe().endswith(f"> {LONG_EPOCHS:g}: a long run drops more)")
    assert "long run" not in choose_signal_dropout(novelty, LONG_EPOCHS).describe()
    assert choose_signal_dropout(novelty).p == DROPOUT  # length unknown: the bar's dropout
    assert choose_signal_dropout(0.0, 100 * LONG_EPOCHS).p == 0.0  # familiar text: none however long


def test_the_rate_is_lower_where_the_signal_drops():
    """A lower rate fits sooner: it goes with any dropout (the bar's, the long run's), not with none."""
    lowered, why = choose_learning_rate(DROPOUT)
    assert lowered < choose_learning_rate(0.0)[0] and f"drops at {DROPOUT:g}" in why
    assert choose_learning_rate(0.5 * DROPOUT)[0] == lowered
    long, why = choose_learning_rate(LONG_DROPOUT)
    assert long == lowered and f"drops at {LONG_DROPOUT:g}" in why
    assert "does not drop" in choose_learning_rate(0.0)[1]


def test_text_that_strays_less_needs_a_longer_run_before_dropout():
    (far, short_bar, _), (some, long_bar, _) = DROPOUT_BARS
    between = 1.25 * short_bar  # past the short bar, short of the long one
    assert choose_signal_dropout(far, between).p == DROPOUT  # the short bar
    middling = choose_signal_dropout(some, between)
    assert middling.p == 0.0 and f"(>= {some:.0%})" in middling.describe() and f"<= {long_bar:g}" in middling.describe()
    assert choose_signal_dropout(some, 1.25 * long_bar).p == DROPOUT
    below = choose_signal_dropout(some - 0.01, 100 * long_bar)
    assert below.p == 0.0 and f"(< {some:.0%})" in below.describe() and "epoch" not in below.describe()


def test_text_that_strays_some_drops_its_signal_before_its_count_grows():
    """From 5% a run can turn up between 3 and 4 planned epochs without dropout, where the count's growth was
    measured from 4: the two bars differ."""
    some = DROPOUT_BARS[-1]
    assert some.dropout < some.growth
    between = (some.dropout + some.growth) / 2
    chosen = choose_signal_dropout(some.novelty, between)
    assert chosen.p == DROPOUT and f"(> {some.dropout:g})" in chosen.describe()
