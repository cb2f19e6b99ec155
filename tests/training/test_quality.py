"""benchmarks/quality.py and benchmarks/recipe_sweep.py: a run with tiny models and budgets of about a second writes
the JSON and the PNG, with finite perplexities and curves monotone in time; both models are scored on the same
targets; a BriLLM row and a sweep variant are the pretrain.py command they print (the same losses and held-out
figures); the seed noise; bad input gets a one-line error."""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling_brillm.evaluation import perplexity
from modeling_brillm.training import epochs
from modeling_brillm.training.checkpoints import LOG_NAME, read_log
from modeling_brillm.training.recipe import RATE, defaults
from tests._scripts import load_script
from tests._tiny import CORPUS, PAD, corpus_ids, make_model, make_tokenizer

quality = load_script("benchmarks/quality.py", "brillm_quality_benchmark")


def padded(seqs):
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


def test_tiny_run_writes_results_and_plot(tmp_path, capsys):
    train = tmp_path / "train.txt"
    valid = tmp_path / "valid.txt"
    words = " ".join(CORPUS).split()
    lines = [" ".join(words[(7 * i) % len(words):][:9]) + "." for i in range(300)]
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    valid.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--train_file", str(train), "--validation_file", str(valid), "--vocab_size", "300", "--block_size", "16",
            "--node_sizes", "16", "8", "--schedule", "cosine",
            "--budgets", "0.4", "1", "--curve_points", "3", "--gpt2", "1x16x2@2e-3", "--batch_size", "8",
            "--threads", "1",
            "--no-wait-quiet", "--output_dir", str(out), "--results_dir", str(tmp_path / "records")]
    assert quality.main(argv) == 0
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "quality.json").read_text())
    assert [m["kind"] for m in results["models"]] == ["brillm", "brillm", "gpt2"]
    assert results["models"][2]["lr"] == 2e-3
    assert [m["label"] for m in results["models"][:2]] == ["BriLLM d=16", "BriLLM d=8"]
    for row in results["models"][:2]:
        assert row["schedule"] == "cosine" and row["batch_size"] == 8 and row["min_bigram_count"] == "auto"
    assert results["settings"]["budgets"] == [0.4, 1.0]
    for model in results["models"]:
        curve = model["curve"]
        assert curve[0]["steps"] == 0 and len(curve) >= 3
        times = [p["train_seconds"] for p in curve]
        steps = [p["steps"] for p in curve]
        assert all(a < b for a, b in zip(times, times[1:])), times
        assert all(a < b for a, b in zip(steps, steps[1:])), steps
        assert times[-1] >= 1.0
        assert all(math.isfinite(p["perplexity"]) and p["perplexity"] > 1 for p in curve)
        # the same held-out targets for every model
        assert {p["eval_tokens"] for p in curve} == {results["data"]["heldout_targets"]}
        for budget, row in results["perplexity_at_budget"].items():
            assert row[model["label"]] == pytest.approx(quality.at_budget(curve, float(budget))["perplexity"], rel=1e-3)
        assert model["parameters"] > 0
    assert 1 < results["bigram_add_0_1_perplexity"] < results["data"]["vocab_size"]
    text = capsys.readouterr().out
    assert "held-out perplexity at each budget" in text
    assert "--min_bigram_count auto chose" in text and "--signal_dropout auto chose" in text
    assert "--max_train_time 1s:" in text  # the epochs the budget buys, timed as pretrain.py times them
    chosen = re.search(r"--signal_dropout auto chose ([0-9.]+)", text).group(1)
    assert results["models"][0]["signal_dropout"] == float(chosen)  # the data's choice, as pretrain.py makes it
    assert results["models"][0]["lr"] == defaults("training")["learning_rate"] == RATE  # pretrain.py's built-in rate
    for model in results["models"][:2]:  # every BriLLM row printed as the pretrain.py run it is
        assert model["pretrain_command"].startswith("python examples/pretrain.py ")
        assert model["pretrain_command"] in text
        assert "--max_train_time 1 --eval_seconds" in model["pretrain_command"]


def test_a_brillm_row_is_the_pretrain_command_it_prints(tmp_path):
    """The losses and the final held-out figure of a quality.py BriLLM row equal those of its printed pretrain.py
    command run on its own (at a constant rate: a decay follows the training clock, so its losses depend on the
    timing of the steps)."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model": {"node_size": 8, "signal_dropout": 0.1},
                                  "training": {"min_bigram_count": 2}}))
    out = tmp_path / "q"
    argv = tiny_files(tmp_path) + ["--config", str(recipe), "--budgets", "1", "3", "--curve_points", "2",
                                   "--gpt2", "none", "--max_train_steps", "6", "--schedule", "constant",
                                   "--no-wait-quiet", "--output_dir", str(out),
                                   "--results_dir", str(tmp_path / "records")]
    assert quality.main(argv) == 0
    row = json.loads((out / "quality.json").read_text())["models"][0]
    assert_row_is_its_command(row, out / "brillm", tmp_path / "alone", steps=6)


def test_variants_are_rows_with_their_own_flags(tmp_path):
    """--variants: one BriLLM row per variant, each its own pretrain.py run (its folder, label and flags)."""
    out = tmp_path / "q"
    argv = tiny_files(tmp_path) + ["--budgets", "2", "--curve_points", "0", "--gpt2", "--max_train_steps", "3",
                                   "--variants", "full=--node_size 8",
                                   "rank2=--node_size 8 --config_overrides edge_rank=2", "--no-wait-quiet",
                                   "--output_dir", str(out), "--results_dir", str(tmp_path / "records")]
    assert quality.main(argv) == 0
    rows = json.loads((out / "quality.json").read_text())["models"]
    assert [(r["label"], r["edge_rank"], Path(r["output_dir"]).name) for r in rows] == [
        ("BriLLM d=8 full", 0, "brillm-full"), ("BriLLM d=8 rank2", 2, "brillm-rank2")]
    assert rows[1]["parameters"] < rows[0]["parameters"] and "--config_overrides edge_rank=2" in rows[1][
        "pretrain_command"]


def run_alone(command: str, folder):
    """The printed pretrain.py command run on its own in a subprocess, writing to `folder`."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "examples/pretrain.py"] and "--max_train_steps" in argv
    argv[argv.index("--output_dir") + 1] = str(folder)
    subprocess.run([sys.executable, *argv[1:]], cwd=quality.ROOT, check=True, capture_output=True, timeout=120,
                   env={**quality.os.environ, "TOKENIZERS_PARALLELISM": "false"})


def log_figures(folder):
    """(training loss per step, [(step, held-out loss, targets)] of every evaluation) from a run's train_log.jsonl."""
    log = read_log(folder / LOG_NAME)
    return ({r["step"]: r["loss"] for r in log if "loss" in r},
            [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in log if "eval_loss" in r])


def assert_row_is_its_command(row, folder, alone, steps: int):
    """A row trained in-process (its run's folder) has the losses and held-out figures of its command run alone
    (a step cap makes both stop at the same step; evaluations at clock points fall on different steps in the two
    runs but do not change the training)."""
    run_alone(row["pretrain_command"], alone)
    (losses, evals), (losses_alone, evals_alone) = log_figures(folder), log_figures(alone)
    assert sorted(losses) == list(range(1, steps + 1)) and losses == losses_alone
    assert evals[0] == evals_alone[0] and evals[-1] == evals_alone[-1]  # before training, and the final model
    assert row["curve"][-1]["eval_nll"] == evals_alone[-1][1] and row["steps"] == steps


def test_heldout_score_matches_the_package_perplexity_and_gpt2_loss():
    tokenizer = make_tokenizer()
    brillm = make_model(tokenizer)
    seqs = corpus_ids(tokenizer)
    held = padded(seqs)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    total, count = quality.heldout_nll(brillm, held, batch_size=4, accelerator=accelerator)
    reference = perplexity(brillm, None, seqs, block_size=64)
    assert count == reference.num_tokens
    assert total / count == pytest.approx(reference.nll, rel=1e-5)

    data = {"tokenizer": tokenizer, "train": held}
    gpt2 = quality.make_gpt2(data, (1, 16, 2, 1e-3), seed=0).eval()
    ids, mask = held
    with torch.no_grad():
        mean = gpt2(input_ids=ids, attention_mask=mask, labels=quality.labels_of(ids, mask)).loss
    total, count = quality.heldout_nll(gpt2, held, batch_size=3, accelerator=accelerator)
    assert count == int(quality.target_mask(mask).sum()) == sum(len(s) - 1 for s in seqs)
    assert total / count == pytest.approx(float(mean), rel=1e-5)


def test_batch_order_is_shared_and_covers_each_epoch():
    first = quality.batch_order(10, 3, seed=1)
    a = [b.tolist() for b, _ in zip(first, range(6))]
    b = [b.tolist() for b, _ in zip(quality.batch_order(10, 3, seed=1), range(6))]
    assert a == b
    epoch = sum(a[:3], [])
    assert len(set(epoch)) == 9  # three full batches of distinct blocks, the tenth dropped
    assert a[3:] != a[:3]  # a fresh permutation next epoch


def test_gpt2_batches_are_the_pretrain_loaders():
    """GPT-2's batch_order draws the blocks in the order of pretrain.py's loader (accelerate's seedable sampler,
    seed + epoch), so every model sees the same batches."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                  data_seed=7))
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(10)), shuffle=True, batch_size=3,
                                                             drop_last=True))
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen += [batch.tolist() for batch in loader]
    order = [b.tolist() for b, _ in zip(quality.batch_order(10, 3, seed=7), range(6))]
    assert seen == order


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0"], "--budgets must be positive"),
    (["--budgets", "10", "10"], "repeated"),
    (["--gpt2", "4by64"], "layers x width"),
    (["--gpt2", "2x64x3"], "multiple of the heads"),
    (["--gpt2", "2x64@0"], "learning rate after @"),
    (["--batch_size", "0"], "--batch_size must be a positive integer"),
    (["--max_train_steps", "0"], "--max_train_steps must be a positive integer"),
    (["--no_brillm", "--gpt2"], "nothing to train"),
    (["--train_file", "/nonexistent/train.txt"], "no such file"),
    (["--train_file", "data.parquet"], "unknown file extension"),
    (["--config", "no-such-preset"], "unknown preset"),
    (["--variants", "full=", "full=--node_size 8"], "distinct names"),
    (["--variants", "rank4"], "NAME=FLAGS"),
    (["--variants", "a=", "--node_sizes", "8"], "without --node_sizes"),
])
def test_bad_input_is_one_clear_line(argv, message, tmp_path, capsys):
    assert quality.main(argv + ["--output_dir", str(tmp_path), "--no-wait-quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def load_sweep():
    return load_script("benchmarks/recipe_sweep.py", "brillm_recipe_sweep")


def tiny_files(tmp_path):
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    words = " ".join(CORPUS).split()
    train.write_text("\n".join(" ".join(words[(7 * i) % len(words):][:9]) + "." for i in range(300)) + "\n",
                     encoding="utf-8")
    valid.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    return ["--train_file", str(train), "--validation_file", str(valid), "--vocab_size", "300", "--block_size", "16",
            "--batch_size", "8", "--threads", "1"]


def test_recipe_sweep_writes_table_and_plot(tmp_path, capsys):
    sweep = load_sweep()
    out = tmp_path / "sweep"
    argv = tiny_files(tmp_path) + [
        "--max_train_steps", "4", "--eval_steps", "2", "--output_dir", str(out), "--no-wait-quiet",
        "--variant", "base=", "knobs=lazy_wd:1,wd:0.5,dropout:0.1,non_edge:1,shared_lr:0.5,node_lr:2,schedule:cosine",
        "pruned=min_count:60,d:4,clip:0,lr:0.01", "--results_dir", str(tmp_path / "records")]
    assert sweep.main(argv) == 0
    results = json.loads((out / "recipe_sweep.json").read_text())
    assert [m["label"] for m in results["models"]] == ["base", "knobs", "pruned"]
    base, knobs, pruned = results["models"]
    assert base["min_bigram_count"] == "auto" and base["node_readout"]  # pretrain.py's built-in recipe
    assert (base["node_lr_scale"], base["shared_edge_lr_scale"]) == (1.0, 1.0)
    assert knobs["lazy_weight_decay"] and knobs["non_edge_bias"] and knobs["weight_decay"] == 0.5
    assert knobs["schedule"] == "cosine" and knobs["signal_dropout"] == 0.1
    assert pruned["node_size"] == 4 and pruned["min_bigram_count"] == 60 and pruned["edges"] < base["edges"]
    assert pruned["grad_clip"] == 0.0 and pruned["lr"] == 0.01
    text = capsys.readouterr().out
    for model in (base, knobs, pruned):  # every variant printed as the pretrain.py run it is
        assert model["pretrain_command"] in text and (out / model["label"] / "train_log.jsonl").exists()
        assert "--max_train_steps 4 --eval_steps 2" in model["pretrain_command"]
    assert "--non_edge_bias --shared_edge_lr_scale 0.5" in knobs["pretrain_command"]
    for model in results["models"]:
        times = [p["train_seconds"] for p in model["curve"]]
        assert [p["steps"] for p in model["curve"]] == [0, 2, 4] and times == sorted(times)
        assert {p["eval_tokens"] for p in model["curve"]} == {base["curve"][0]["eval_tokens"]}  # the same targets
    assert f"| knobs | {knobs['recipe_text']} | **{knobs['curve'][-1]['perplexity']:.2f}** |" in text
    assert (out / "recipe_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((tmp_path / "records").glob("recipe_sweep-*.json"))) == 1


def test_a_sweep_variant_is_the_pretrain_command_it_prints(tmp_path):
    """A recipe_sweep.py variant is quality.py's BriLLM row with the variant's flags: its losses and held-out
    figures are those of its printed pretrain.py command run on its own."""
    sweep = load_sweep()
    out = tmp_path / "sweep"
    argv = tiny_files(tmp_path) + ["--max_train_steps", "5", "--eval_steps", "5",
                                   "--variant", "v=d:8,min_count:2,dropout:0.1,lazy_wd:1,wd:0.05,warmup:2,readout:0",
                                   "--no-wait-quiet", "--output_dir", str(out), "--results_dir", str(tmp_path / "r")]
    assert sweep.main(argv) == 0
    row = json.loads((out / "recipe_sweep.json").read_text())["models"][0]
    assert "--node_size 8 --min_bigram_count 2 --signal_dropout 0.1 --lazy_weight_decay" in row["pretrain_command"]
    assert row["node_size"] == 8 and row["warmup_steps"] == 2 and not row["node_readout"]
    assert_row_is_its_command(row, out / "v", tmp_path / "alone", steps=5)


@pytest.mark.parametrize("variant, message", [
    ("x=bogus:1", "not key:value"),
    ("x=d:big", "d needs an integer"),
    ("x=dropout:lots", "dropout needs a number or auto"),
    ("x=non_edge:yes", "non_edge is one of 0, 1"),
    ("x=schedule:warm", "schedule is one of constant, cosine, linear"),
    ("x=min_lr:0.1", "not key:value"),
    ("a/b=", "NAME of letters"),
    ("x=recurrence:-1", "recurrence needs a number >= 0"),
    ("x=probe_every:1", "probe_every needs an integer >= 2"),
    ("x=probe_runs:some", "probe_runs needs an integer >= 1 or blocks"),
])
def test_recipe_sweep_bad_variant_is_one_clear_line(variant, message, tmp_path, capsys):
    assert load_sweep().main(["--variant", variant, "--output_dir", str(tmp_path), "--no-wait-quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_recipe_sweep_refuses_repeated_names(tmp_path, capsys):
    sweep = load_sweep()
    assert sweep.main(["--variant", "a=", "a=lr:0.01", "--output_dir", str(tmp_path)]) == 2
    assert "names must differ" in capsys.readouterr().err
    assert sweep.main(["--variant", "a=", "--seeds", "1", "1", "--output_dir", str(tmp_path)]) == 2
    assert "names must differ" in capsys.readouterr().err


def test_seeds_train_every_variant_once_per_seed_and_give_the_spread(tmp_path, capsys):
    """--seeds: the seed noise, each variant once per seed at fixed steps (pretrain.py's own schedule, no time budget),
    and each evaluation's spread (max - min) / mean of their held-out perplexities."""
    sweep = load_sweep()
    out = tmp_path / "sweep"
    argv = tiny_files(tmp_path) + ["--max_train_steps", "4", "--eval_steps", "2", "--seeds", "7", "8", "--variant",
                                   "base=", "--no-wait-quiet", "--output_dir", str(out), "--results_dir", str(tmp_path)]
    assert sweep.main(argv) == 0
    results = json.loads((out / "recipe_sweep.json").read_text())
    first, second = results["models"]
    assert (first["label"], second["label"]) == ("base-s7", "base-s8")
    assert "--seed 7 " in first["pretrain_command"] and "--seed 8 " in second["pretrain_command"]
    for m in (first, second):
        assert "--max_train_time" not in m["pretrain_command"] and "--lr_scheduler_type" not in m["pretrain_command"]
    values = [first["curve"][-1]["perplexity"], second["curve"][-1]["perplexity"]]
    assert values[0] != values[1]  # another seed, another run
    noise = results["seed_noise"]["base"]
    assert sorted(noise) == ["2", "4"] and noise["4"]["perplexity"] == values
    assert noise["4"]["spread"] == pytest.approx((max(values) - min(values)) / (sum(values) / 2))
    assert f"base step 4: {values[0]:.3f}  {values[1]:.3f}   spread" in capsys.readouterr().out
    args = sweep.parse_args(argv)
    constant = sweep.variant_argv(args, "c", {"schedule": "constant"})
    assert constant[constant.index("--lr_scheduler_type") + 1] == "constant_with_warmup"


def test_a_fixed_step_sweep_compares_each_variant_with_the_base_in_noise_units(tmp_path, capsys):
    sweep = load_sweep()
    out = tmp_path / "sweep"
    argv = tiny_files(tmp_path) + ["--max_train_steps", "4", "--eval_steps", "2", "--noise", "0.01",
                                   "--variant", "first=prior:0", "base=", "flat=schedule:constant", "--no-wait-quiet",
                                   "--output_dir", str(out), "--results_dir", str(tmp_path / "r")]
    assert sweep.main(argv) == 0
    results = json.loads((out / "recipe_sweep.json").read_text())
    first, base, flat = results["models"]
    assert [p["steps"] for p in base["curve"]] == [0, 2, 4] and results["settings"]["budget"] is None
    assert base["schedule"] == "linear" and flat["schedule"] == "constant_with_warmup"
    assert "--max_train_time" not in base["pretrain_command"] and not first["count_prior"]
    assert results["comparison"]["base"] == "base"  # the variant named base, not the first
    assert base["vs_base_percent"] == 0 and base["verdict"].startswith("within 2x")
    change = first["curve"][-1]["perplexity"] / base["curve"][-1]["perplexity"] - 1
    assert first["vs_base_percent"] == pytest.approx(100 * change)
    assert first["vs_base_in_noise"] == pytest.approx(change / 0.01)
    assert first["verdict"] == sweep.verdict(change / 0.01)
    printed = capsys.readouterr().out
    assert first["vs_base"] == sweep.comparison_line(first) and first["vs_base"] in printed
    text = first["vs_base"]
    assert f"first: perplexity {first['curve'][-1]['perplexity']:.3f}, {100 * change:+.2f}% vs base" in text
    assert f"{first['vs_base_percent']:+.1f}% ({change / 0.01:+.1f}x noise) |" in printed


def test_a_probe_variant_trains_with_the_count_its_probe_chooses(tmp_path, capsys):
    """The probe's numbers are no pretrain.py flags: a variant that sets them runs with the count and the dropout
    the probe then chooses, given as numbers; where they are the recipe's choice, it is the recipe's run."""
    from modeling_brillm.training.recipe import PROBE_EVERY, RECURRENCE

    sweep = load_sweep()
    out = tmp_path / "sweep"
    argv = tiny_files(tmp_path) + ["--max_train_steps", "40", "--eval_steps", "40", "--noise", "0.01", "--variant",
                                   "base=", f"same=recurrence:{RECURRENCE}", f"again=probe_every:{PROBE_EVERY}",
                                   "strict=recurrence:5,probe_runs:blocks", "--no-wait-quiet",
                                   "--output_dir", str(out), "--results_dir", str(tmp_path / "r")]
    assert sweep.main(argv) == 0
    base, same, again, strict = json.loads((out / "recipe_sweep.json").read_text())["models"]
    assert same["same_run_as"] == again["same_run_as"] == "base"  # trained once
    assert same["curve"] == base["curve"] and same["pretrain_command"] == base["pretrain_command"]
    count = next(s["value"] for s in json.loads((out / "base" / "recipe.json").read_text())["settings"]
                 if s["name"] == "min_bigram_count")
    line = re.search(r"probe \{'recurrence': 5.0, 'runs': \d+\}: data count \d+, .*: (\{.*\})(.*)",
                     capsys.readouterr().out)
    chosen = ast.literal_eval(line.group(1))
    if chosen["min_count"] == count:  # this text's bigrams all come back: the probe chooses the recipe's count
        assert strict["same_run_as"] == "base" and line.group(2) == " (the recipe chooses the same)"
    else:
        assert f"--min_bigram_count {chosen['min_count']} --signal_dropout" in strict["pretrain_command"]


def test_verdict_is_twice_the_noise_either_way():
    sweep = load_sweep()
    assert sweep.verdict(2.5).startswith("worse") and sweep.verdict(-2.5).startswith("better")
    assert sweep.verdict(1.9).startswith("within") and sweep.verdict(-2.0).startswith("within")


def test_a_given_base_perplexity_is_the_base(tmp_path):
    sweep = load_sweep()
    args = sweep.parse_args(["--base_perplexity", "10", "--noise", "0.05"])
    models = [dict(kind="brillm", label="base", curve=[dict(perplexity=11.0)])]
    assert sweep.compare(models, args)["base_perplexity"] == 10
    assert models[0]["vs_base_percent"] == pytest.approx(10) and models[0]["vs_base_in_noise"] == pytest.approx(2)


@pytest.mark.parametrize("argv, message", [
    (["--eval_steps", "0", "--max_train_steps", "5"], "--eval_steps must be a positive integer"),
    (["--max_train_steps", "0"], "--max_train_steps must be a positive integer"),
    (["--noise", "0"], "--noise must be a positive number"),
    (["--base_perplexity", "nan"], "--base_perplexity must be a positive number"),
])
def test_recipe_sweep_fixed_step_bad_input_is_one_clear_line(argv, message, tmp_path, capsys):
    assert load_sweep().main(argv + ["--output_dir", str(tmp_path), "--no-wait-quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("schedule, at", [("cosine", lambda f: 0.5 * (1 + math.cos(math.pi * f))),
                                          ("linear", lambda f: 1 - f)])
def test_a_decay_follows_the_training_clock(schedule, at):
    """The one clock and schedule BriLLM (pretrain.py) and GPT-2 (quality.py) share: a warmup counted in steps, then
    transformers' decay at the clock's share of the budget."""
    assert quality.TrainingClock is epochs.TrainingClock and quality.make_schedule is epochs.make_schedule
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    clock = epochs.TrainingClock(10.0)
    sched = epochs.make_schedule(opt, quality.SCHEDULERS[schedule], 2, clock=clock)
    seen = []
    for seconds in (0.0, 1.0, 5.0, 10.0, 20.0):
        clock.seconds = seconds
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:2] == pytest.approx([0.0, 0.5])  # warmup steps 0 and 1 of 2
    assert seen[2:] == pytest.approx([at(0.1), at(0.5), 0.0])  # each rate set at the clock of the step before it


def test_by_default_a_brillm_row_is_pretrain_py_with_its_own_batch_and_schedule():
    args = quality.parse_args(["--budgets", "60", "600", "--vocab_size", "2000"])
    argv = quality.brillm_argv(args, quality.curve_points(args.budgets, 2))
    assert "--per_device_train_batch_size" not in argv and "--lr_scheduler_type" not in argv  # the recipe's
    assert argv[argv.index("--max_train_time") + 1] == "600" and quality.gpt2_batch(args) == quality.GPT2_BATCH
    constant = quality.parse_args(["--schedule", "constant", "--batch_size", "16"])
    argv = quality.brillm_argv(constant, [30.0, 90.0])
    assert argv[argv.index("--lr_scheduler_type") + 1] == "constant_with_warmup"
    assert argv[argv.index("--per_device_train_batch_size") + 1] == "16" and quality.gpt2_batch(constant) == 16
    args.config = "demo"
    preset = quality.brillm_argv(args, [30.0, 90.0])  # a preset's own schedule gives way to the rule
    assert preset[preset.index("--lr_scheduler_type") + 1] == "linear"


def test_step_timing_is_the_pace_not_the_first_compiles(monkeypatch):
    """Planned epochs come from timed steps: slow first steps (the optimizer's moments, kernel compiles) and one slow
    step later must not pass for the run's pace (on a GPU the compiles once made a run plan a few of its ~20 epochs,
    and the signal-dropout rule chose none)."""
    pace = iter([5.0, 5.0, 0.01, 0.01, 3.0, 0.01, 0.01])
    clock = [0.0]
    monkeypatch.setattr(epochs.time, "perf_counter", lambda: clock[0])

    def step():
        clock[0] += next(pace)

    assert epochs.seconds_per_step(step, sync=lambda: None) == pytest.approx(0.01)


def test_gpt2_sizes_and_none():
    assert quality.gpt2_sizes(["4x128", "4x256x8@1e-3"], 3e-3) == [(4, 128, 4, 3e-3), (4, 256, 8, 1e-3)]
    assert quality.gpt2_sizes(["none"], 3e-3) == quality.gpt2_sizes([], 3e-3) == []
    with pytest.raises(quality.UsageError, match="layers x width"):
        quality.gpt2_sizes(["4x128", "none"], 3e-3)
