"""recipe.py: the default recipe as one table and one function. The function chooses what the code chose before it
was last changed (recipe_oracle.json, regenerated whenever a rule changes on purpose), the docs' table is the module's,
and a run's saved recipe.json rebuilds the same config with `--recipe`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling_brillm import count_prior
from modeling_brillm.training import presets, pruning, recipe
from modeling_brillm.training import pretraining as pretrain
from modeling_brillm.training.errors import UsageError
from modeling_brillm.training.presets import choose_recipe
from modeling_brillm.training.pruning import BigramProbe, PruningChoice, probe_bigrams
from modeling_brillm.training.recipe import RULES, RunPlan, load_recipe, recipe_table_markdown
from tests.training.test_pruning import WIDE, V, documents_of_their_own, documents_with_private_bigrams, repeated_text

ROOT = Path(__file__).resolve().parents[2]
ORACLE = json.loads((Path(__file__).with_name("recipe_oracle.json")).read_text())
TEXTS = {"repeated": (repeated_text, V), "private": (documents_with_private_bigrams, V),
         "own": (documents_of_their_own, WIDE)}

AUTO = {"model": {"graph": "sparse", "signal_dropout": "auto"}, "training": {"min_bigram_count": "auto"},
        "tokenizer": {}}


# ------------------------------------------------------------------------------------ the same choices as before
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_the_count_and_dropout_are_those_recorded(text):
    make, vocab = TEXTS[text]
    probe = probe_bigrams(make(), vocab)
    cases = [c for c in ORACLE["min_count"] if c["text"] == text]
    assert len(cases) == 31
    for case in cases:
        choice = choose_recipe(AUTO, {}, probe, RunPlan(case["planned_epochs"], case["grow"]))
        count = choice.settings["training.min_bigram_count"]
        assert (count.value, count.why) == (case["min_count"], case["describe"]), case
        pruned = choice.pruning
        assert (pruned.data_count, pruned.epochs, pruned.grown, pruned.novelty) == (
            case["data_count"], case["epochs"], case["grown"], case["novelty"])
        assert choice.value("model", "signal_dropout") == case["p"]
        assert count.rule in {r.name for r in RULES}


def test_the_dropout_on_a_grid_of_novelty_and_planned_epochs():
    assert len(ORACLE["signal_dropout"]) == 160
    dense = {**AUTO, "model": {"graph": "dense", "signal_dropout": "auto"}}
    for case in ORACLE["signal_dropout"]:
        probe = BigramProbe(PruningChoice(1, {}, 0, 1, novelty=case["novelty"]), torch.zeros(0, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long), V)
        choice = choose_recipe(dense, {}, probe, RunPlan(case["planned_epochs"]))
        dropout = choice.settings["model.signal_dropout"]
        assert (dropout.value, dropout.why) == (case["p"], case["describe"]), case
        assert dropout.rule in {r.name for r in RULES}


@pytest.mark.parametrize("case", ORACLE["settings"], ids=lambda c: " ".join(c["flags"]) or "(none)")
def test_defaults_presets_and_flags_resolve_as_before(case):
    from modeling_brillm import BriLLMConfig

    args = pretrain.parse_args(case["flags"])
    choice = presets.resolve_settings(args)
    model, tokenizer = choice.section("model"), choice.section("tokenizer")
    assert {k: model[k] for k in case["model"]} == case["model"] and tokenizer == case["tokenizer"]
    # the model fields the oracle leaves out were BriLLMConfig()'s; the default preset now lists them
    assert all(model[k] == getattr(BriLLMConfig(), k) for k in set(model) - set(case["model"]))
    assert {k: getattr(args, k) for k in case["training"]} == case["training"]
    assert set(case["training"]) == {key.split(".")[1] for key in recipe.DEFAULT_PRESET if key.startswith("training")}


# ------------------------------------------------------------------------------------------------ one table
def test_every_number_is_defined_once_and_listed():
    listed = {rule.name: rule.value for rule in RULES}
    for name in ("RECURRENCE", "MIN_VISITS", "NOVEL", "FIT_EPOCHS", "MAX_DROPOUT"):
        assert getattr(pruning, name) is getattr(recipe, name) and listed[name] is getattr(recipe, name), name
    assert listed["RUNS, PROBE_EVERY"] == (recipe.RUNS, recipe.PROBE_EVERY)
    assert listed["learning_rate"] is recipe.RATE
    assert listed["count_prior.DISCOUNT"] is count_prior.DISCOUNT  # listed by reference: model code stays alone
    defaults = presets.default_choice()  # the default preset: every setting, each from its one rule
    assert set(defaults.settings) == set(recipe.DEFAULT_PRESET)
    assert all(defaults.rule(key) == rule.name and defaults.settings[key].value is rule.value
               for key, rule in recipe.DEFAULT_PRESET.items())
    assert len({rule.name for rule in RULES}) == len(RULES)
    assert all(rule.why and rule.evidence for rule in RULES)


def test_a_preset_states_only_what_it_changes_and_why():
    """Every shipped preset states settings that differ from the default preset, each with a reason; a stated batch
    may equal the default's, since stating it also keeps a GPU from choosing its own (GPU_STEP_TOKENS)."""
    for name in presets.known_presets():
        data = json.loads((presets.PRESET_DIR / f"{name}.json").read_text(encoding="utf-8"))
        for section in ("model", "tokenizer", "training"):
            values = data.get(section, {})
            stated = {k: v for k, v in values.items() if not k.startswith("_")}
            assert set(values.get("_why", {})) == set(stated), (name, section)
            for key, value in stated.items():
                full = f"{section}.{key}"
                assert full == presets.STEP_BATCH or recipe.DEFAULT_PRESET[full].value != value, (name, full)


def test_the_released_model_is_the_config_default_and_the_recipe_turns_on_the_extensions_that_earn_their_place():
    from modeling_brillm import BriLLMConfig

    released = BriLLMConfig()
    on, off = ("node_readout", "node_embedding", "count_prior"), ("non_edge_bias", "edge_backoff")
    assert not any(getattr(released, name) for name in on + off)
    assert released.signal_dropout == 0 and released.position_recency == 0
    assert all(recipe.defaults("model")[name] is True for name in on)
    assert all(recipe.defaults("model")[name] is False for name in off)  # within the noise (docs/ablations.md)


def test_docs_table_is_the_generated_one():
    docs = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    begin, end = "<!-- recipe table: recipe_table_markdown() -->\n", "<!-- end of the recipe table -->"
    assert begin in docs and end in docs
    table = docs.split(begin, 1)[1].split(end, 1)[0]
    assert table == recipe_table_markdown()
    paper = [rule for rule in RULES if rule.evidence == "the paper"]
    run = [rule for rule in RULES if rule.run]
    assert paper and run and all(rule.evidence == recipe.RUN for rule in run)
    assert table.count("\n") == len(RULES) - len(paper) - len(run) + 6  # the paper's and the run's share a row each
    assert table.startswith(f"{recipe.tuned_numbers()} tuned numbers:")
    assert all(f"`{rule.name}` {rule.value!r}" in table.splitlines()[-2] for rule in paper)
    assert all(f"`{rule.name}` {rule.value!r}" in table.splitlines()[-1] for rule in run)



def test_every_rule_cites_a_section_that_exists():
    """A rule's evidence names a section of docs/ablations.md (§"..."), another doc's (docs/x.md §"...") or a source:
    never a section that is gone."""
    import re

    docs = ROOT / "docs"
    for rule in RULES:
        for doc, section in re.findall(r'(?:(docs/[\w.]+) )?§"([^"]+)"', rule.evidence):
            text = (ROOT / doc if doc else docs / "ablations.md").read_text(encoding="utf-8")
            assert re.search(rf"^#{{2,3}} {re.escape(section)}( \(|$)", text, flags=re.M), (rule.name, section)


# ----------------------------------------------------------------------------------------- saved and reloaded
def test_a_choice_saves_and_loads_with_its_rules(tmp_path):
    make, vocab = TEXTS["own"]
    choice = choose_recipe(AUTO, {"model.node_size": "flag --node_size"}, probe_bigrams(make(), vocab),
                           RunPlan(5.0))
    path = choice.save(tmp_path)
    loaded = load_recipe(tmp_path)
    assert path.name == "recipe.json" and loaded.settings == choice.settings
    assert loaded.inputs["probe"]["data_count"] == choice.pruning.data_count
    assert loaded.inputs["plan"]["planned_epochs"] == 5
    assert choice.value("model", "signal_dropout") == pytest.approx(recipe.MAX_DROPOUT * (1 - recipe.FIT_EPOCHS / 5))
    assert "training.min_bigram_count" in choice.describe()


@pytest.mark.parametrize("content,message", [(None, "no such file"), ("{", "not valid JSON"),
                                             ('{"format": 9, "settings": []}', "not a recipe of format 1"),
                                             ('{"format": 1, "settings": [{"x": 1}]}', "malformed")])
def test_a_bad_recipe_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "recipe.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_recipe(path)


def test_recipe_refuses_a_preset_and_a_flag_that_differs(tmp_path):
    choose_recipe(AUTO, {}, probe_bigrams(repeated_text(), V), RunPlan(1.0)).save(tmp_path)
    saved = str(tmp_path / "recipe.json")
    with pytest.raises(UsageError, match="--recipe and --config"):
        presets.resolve_settings(pretrain.parse_args(["--recipe", saved, "--config", "demo"]))
    with pytest.raises(UsageError, match="--signal_dropout 0.1 differs from the recipe's signal_dropout=0.0"):
        presets.resolve_settings(pretrain.parse_args(["--recipe", saved, "--signal_dropout", "0.1"]))
    model = presets.resolve_settings(pretrain.parse_args(["--recipe", saved])).section("model")
    assert model["signal_dropout"] == 0.0  # what the saved choice held, no probe


# --------------------------------------------------------------------------------------------- end to end
def run_pretrain(args):
    cmd = [sys.executable, str(ROOT / "examples" / "pretrain.py"), *[str(a) for a in args]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def values_and_rules(folder: Path) -> list:
    settings = json.loads((folder / "recipe.json").read_text())["settings"]
    return [(s["section"], s["name"], s["value"], s["rule"]) for s in settings]


def test_a_saved_recipe_rebuilds_the_same_config(tmp_path):
    rng = random.Random(0)
    words = "the cat dog sat on mat log tree saw a big red ran over under and with house river".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
                                for _ in range(300)) + "\n")
    common = ["--train_file", corpus, "--num_generations", "0", "--max_train_steps", "3"]
    first = tmp_path / "first"
    text = run_pretrain([*common, "--output_dir", first, "--vocab_size", "300", "--node_size", "8",
                         "--block_size", "16", "--checkpointing_steps", "2"])
    assert "the recipe (saved as recipe.json" in text and "training.min_bigram_count" in text
    saved = json.loads((first / "recipe.json").read_text())
    assert saved["inputs"]["probe"]["data_count"] >= 1 and saved["inputs"]["plan"]["max_train_steps"] == 3
    assert json.loads((first / "step_2" / "recipe.json").read_text())["settings"] == saved["settings"]
    again = tmp_path / "again"
    text = run_pretrain([*common, "--output_dir", again, "--recipe", first / "recipe.json"])
    assert "auto chose" not in text  # applied verbatim: no probe
    config, reproduced = (json.loads((d / "config.json").read_text()) for d in (first, again))
    assert config == reproduced
    assert values_and_rules(again) == values_and_rules(first)
