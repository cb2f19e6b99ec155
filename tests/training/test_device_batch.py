"""The step's size on a GPU (GPU_STEP_TOKENS): the rule, the memory check that halves it, an explicit batch that
wins, and a CPU run that is unchanged. No GPU is needed: the device's facts (`memory.device_facts`: its type and
free bytes) are faked, and the runs train tiny models on the CPU."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from modeling_brillm import BriLLMConfig
from modeling_brillm.graph import graph_from_edges
from modeling_brillm.training import memory, presets, recipe
from modeling_brillm.training import pretraining as pretrain
from modeling_brillm.training.presets import StepBatch, choose_step_batch, fit_step_batch
from modeling_brillm.training.recipe import FREE_SHARE, GPU_STEP_TOKENS, RULES
from tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
KEY = "training.per_device_train_batch_size"
BASE = ["--vocab_size", "300", "--node_size", "8", "--block_size", "16", "--num_generations", "0",
        "--validation_split_percentage", "0"]
TINY = [*BASE, "--max_train_steps", "2"]
MB = 1024 ** 2


def settled(argv: list) -> SimpleNamespace:
    """The flags as pretrain.py leaves them before the data is read (defaults < preset < flags)."""
    args = pretrain.parse_args([str(a) for a in argv])
    presets.resolve_settings(args)
    return args


# ------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("block,batch", [(32, 2048), (64, 1024), (512, 128), (48, 1365)])
def test_on_a_gpu_the_default_batch_makes_the_rule_s_tokens(block, batch):
    args = settled(["--block_size", block])
    step = choose_step_batch(args, "cuda", train_blocks=10 ** 6, processes=1)
    assert step == StepBatch(batch) and args.per_device_train_batch_size == batch
    assert args.recipe_choice.rule(KEY) == "GPU_STEP_TOKENS"


def test_the_rule_is_capped_at_the_training_blocks_per_process():
    args = settled([])
    step = choose_step_batch(args, "cuda", train_blocks=1000, processes=2)
    assert step == StepBatch(500, capped=True) and args.per_device_train_batch_size == 500


@pytest.mark.parametrize("argv", [["--per_device_train_batch_size", "64"], ["--config", "demo"]])
def test_a_flag_or_a_preset_keeps_its_batch(argv):
    args = settled(argv)
    before = args.per_device_train_batch_size
    assert choose_step_batch(args, "cuda", train_blocks=10 ** 6, processes=1) is None
    assert args.per_device_train_batch_size == before


def test_on_the_cpu_nothing_changes():
    args = settled([])
    assert choose_step_batch(args, "cpu", train_blocks=10 ** 6, processes=1) is None
    assert args.per_device_train_batch_size == 32 and KEY not in args.recipe_choice.given
    assert args.recipe_choice.rule(KEY) == "per_device_train_batch_size"  # the default preset's rule
    assert fit_step_batch(args, None, lambda blocks: float("inf"), None) is None


def test_a_resumed_run_keeps_its_checkpoint_s_batch():
    args = settled(["--gradient_accumulation_steps", "2"])
    step = choose_step_batch(args, "cuda", 10 ** 6, processes=2, checkpoint_global_batch=2048)
    assert step.resumed and args.per_device_train_batch_size == 512
    line = fit_step_batch(args, step, lambda blocks: 100 * MB * blocks, free=1024 * MB)
    assert args.per_device_train_batch_size == 512 and "warning" in line and "kept as the checkpoint's batch" in line
    assert args.recipe_choice.rule(KEY) == "the checkpoint's batch"


# ------------------------------------------------------------------------------------------- the memory check
def test_the_batch_halves_until_the_step_fits_with_a_margin():
    args = settled([])
    step = choose_step_batch(args, "cuda", 10 ** 6, 1)
    need = lambda blocks: 10 * MB + MB * blocks  # noqa: E731
    line = fit_step_batch(args, step, need, free=600 * MB)
    assert args.per_device_train_batch_size == 512  # 522 MB <= 0.9 x 600 MB < 1034 MB
    assert need(512) <= FREE_SHARE * 600 * MB < need(1024)
    assert line == "batch 1024 x 64 (GPU_STEP_TOKENS: 65,536 tokens per step) would need ~1.0 GB, 600.0 MB free: " \
                   "using 512 (~522.0 MB)"


def test_a_batch_that_fits_is_kept_and_said():
    args = settled([])
    step = choose_step_batch(args, "cuda", 10 ** 6, 1)
    line = fit_step_batch(args, step, lambda blocks: MB * blocks, free=100 * 1024 * MB)
    assert args.per_device_train_batch_size == 1024 and line.endswith("needs ~1.0 GB, 100.0 GB free")


def test_an_explicit_batch_is_kept_with_a_warning_where_it_would_not_fit():
    args = settled(["--per_device_train_batch_size", "4096"])
    need = lambda blocks: MB * blocks  # noqa: E731
    line = fit_step_batch(args, None, need, free=1024 * MB)
    assert args.per_device_train_batch_size == 4096
    assert line.startswith("warning: batch 4096 x 64 would need ~4.0 GB, 1.0 GB free")
    assert "kept as flag --per_device_train_batch_size set it" in line
    assert fit_step_batch(args, None, need, free=8192 * MB) is None


def test_the_step_estimate_grows_with_the_batch_and_counts_the_logits():
    paper = BriLLMConfig(vocab_size=4000, node_size=32, graph="sparse", num_edges=908_000, node_readout=True)
    args = SimpleNamespace(block_size=64, edge_sharding="none", moment_dtype="float32")
    accelerator = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO, mixed_precision="no",
                                  device=SimpleNamespace(type="cuda"))
    need = memory.step_memory(paper, None, accelerator, args)
    state = memory.training_memory(paper.num_parameters_formula())["total"]
    per_token = (need(1024) - need(512)) / (512 * 64)
    assert need(1) == pytest.approx(state, rel=1e-3)
    assert per_token >= 1.1 * 4 * memory.LOGIT_COPIES * 4000  # every token's V logits, several times over
    assert 15 * 1024 ** 3 < state < 20 * 1024 ** 3  # 16 B per parameter +10%: the record's 15.5 GB peak at 1024 x 64
    # a token scores its source's successors: frequent sources weigh more than the mean degree
    graph = graph_from_edges(torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 0]), 3, torch.tensor([9, 9, 9, 1]))
    small = BriLLMConfig(vocab_size=3, node_size=4, graph="sparse", num_edges=4)
    assert memory.successors_per_token(small, graph) == pytest.approx((27 * 3 + 1 * 1) / 28)
    assert memory.successors_per_token(small, None) == pytest.approx(4 / 3)


# ------------------------------------------------------------------------------------------------ the table
def test_the_rule_is_one_row_whose_figures_are_its_record_s():
    rows = [rule for rule in RULES if "GPU_STEP_TOKENS" in rule.name]
    assert len(rows) == 1 and rows[0].value == GPU_STEP_TOKENS == 65_536 and rows[0].sets is None
    assert recipe.defaults("training")["per_device_train_batch_size"] == 32  # the CPU's default is not the rule's
    record = json.loads((ROOT / rows[0].evidence).read_text())
    train = {row["batch"]: row["triton_tokens_per_s"] for row in record["figures"]["train"]}
    small, large = train["32 × 32"], train["1024 × 64"]
    assert 1024 * 64 == GPU_STEP_TOKENS
    assert f"{small:,}" in rows[0].why and f"{large:,}" in rows[0].why and f"({round(large / small)}×)" in rows[0].why


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat dog sat on mat log tree saw a big red ran over under and with house river".split()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
                              for _ in range(300)) + "\n")
    return path


def run_on(device, free_mb, argv, monkeypatch, capsys, tmp_path) -> tuple[str, dict, list]:
    """pretrain.py in this process, the device's facts faked; (its output, recipe.json's settings, its log)."""
    monkeypatch.setattr(memory, "device_facts", lambda _device: (device, None if free_mb is None else free_mb * MB))
    for key in ("TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, "false" if key.startswith("TOK") else "1")
    out = tmp_path / "out"
    assert pretrain.main([str(a) for a in [*argv, "--output_dir", out]]) == 0
    text = capsys.readouterr().out
    settings = {s["name"]: s for s in json.loads((out / "recipe.json").read_text())["settings"]}
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return text, settings, log


def batch_of(text: str) -> int:
    return int(re.search(r"global batch (\d+) blocks", text).group(1))


def test_a_gpu_run_takes_the_rule_s_batch_capped_and_plans_from_it(corpus, monkeypatch, capsys, tmp_path):
    text, settings, log = run_on("cuda", 10 ** 6, ["--train_file", corpus, *TINY], monkeypatch, capsys, tmp_path)
    blocks = int(re.search(r"(\d+) training blocks", text).group(1))
    assert batch_of(text) == blocks  # 65,536 // 16 = 4096 blocks, capped at the corpus's
    assert f"batch {blocks} x 16 (GPU_STEP_TOKENS: 65,536 tokens per step, capped at the training blocks) needs" in text
    batch = settings["per_device_train_batch_size"]
    assert batch["value"] == blocks and batch["rule"] == "GPU_STEP_TOKENS" and "needs ~" in batch["why"]
    assert "2 steps (1 per epoch" in text  # the epochs follow from the batch
    recorded = json.loads((tmp_path / "out" / "recipe.json").read_text())["inputs"]["plan"]
    assert recorded["global_batch"] == blocks and recorded["planned_epochs"] == pytest.approx(2.0)
    again = settled(["--recipe", tmp_path / "out" / "recipe.json"])  # applied verbatim, on any device
    assert choose_step_batch(again, "cuda", 10 ** 6, 1) is None and again.per_device_train_batch_size == blocks


def test_a_gpu_run_halves_the_batch_when_memory_is_short(corpus, monkeypatch, capsys, tmp_path):
    text, _, _ = run_on("cuda", 10 ** 6, ["--train_file", corpus, *TINY], monkeypatch, capsys, tmp_path / "a")
    blocks = batch_of(text)
    need = float(re.search(r"needs ~([\d.]+) MB", text).group(1))
    free_mb = need / 2.5  # the whole corpus's batch does not fit; a smaller one does
    text, settings, log = run_on("cuda", free_mb, ["--train_file", corpus, *TINY], monkeypatch, capsys,
                                 tmp_path / "b")
    chosen = batch_of(text)
    assert chosen < blocks and chosen in {blocks // 2, blocks // 4, blocks // 8}
    assert re.search(rf"batch {blocks} x 16 \(GPU_STEP_TOKENS[^)]*\) would need ~[\d.]+ MB, [\d.]+ MB free: using "
                     rf"{chosen} \(~", text)
    assert settings["per_device_train_batch_size"]["value"] == chosen
    assert f"using {chosen}" in settings["per_device_train_batch_size"]["why"]
    assert "planning the run again" in text  # --max_train_steps: the planned epochs follow the smaller batch
    steps_per_epoch = blocks // chosen
    assert f"2 steps ({steps_per_epoch} per epoch" in text
    recorded = json.loads((tmp_path / "b" / "out" / "recipe.json").read_text())["inputs"]["plan"]
    assert recorded["global_batch"] == chosen and recorded["planned_epochs"] == pytest.approx(2 * chosen / blocks)


def test_a_time_budget_is_timed_at_the_batch_that_fits(corpus, monkeypatch, capsys, tmp_path):
    budget = ["--train_file", corpus, *BASE, "--max_train_time", "1"]
    text, _, _ = run_on("cuda", 10 ** 6, budget, monkeypatch, capsys, tmp_path / "a")
    blocks = batch_of(text)
    need = float(re.search(r"needs ~([\d.]+) MB", text).group(1))
    text, settings, _ = run_on("cuda", need / 2.5, budget, monkeypatch, capsys, tmp_path / "b")
    chosen = batch_of(text)
    assert chosen < blocks and settings["per_device_train_batch_size"]["value"] == chosen
    # fitted before the throwaway model times its steps: the epochs bought are timed at it, not planned again
    assert "--max_train_time 1s:" in text and f"using {chosen}" in text and "planning the run again" not in text
    assert f"global batch {chosen} blocks" in text


def test_an_explicit_batch_wins_on_a_gpu_with_a_warning(corpus, monkeypatch, capsys, tmp_path):
    argv = ["--train_file", corpus, *TINY, "--per_device_train_batch_size", "8"]
    text, settings, _ = run_on("cuda", 0.001, argv, monkeypatch, capsys, tmp_path)
    assert batch_of(text) == 8
    assert settings["per_device_train_batch_size"]["rule"] == "flag --per_device_train_batch_size"
    assert "warning: batch 8 x 16 would need" in text and "kept as flag --per_device_train_batch_size" in text


def test_a_cpu_run_is_unchanged(corpus, monkeypatch, capsys, tmp_path):
    text, settings, _ = run_on("cpu", None, ["--train_file", corpus, *TINY], monkeypatch, capsys, tmp_path)
    assert batch_of(text) == 32 and "GPU_STEP_TOKENS" not in text
    batch = settings["per_device_train_batch_size"]
    assert (batch["value"], batch["rule"], batch["why"]) == (32, "per_device_train_batch_size", "")


# ---------------------------------------------------------------------------------------------- the benchmark
def test_the_default_batch_benchmark_runs_and_records_beside_the_throughput(tmp_path, capsys):
    bench = load_script("benchmarks/gpu_throughput.py", "brillm_gpu_throughput")
    run = {"rows": [dict(kind="train", shape="paper", backend=backend, objective="exact", optimizer="sparse_adamw",
                         B=1024, L=64, tokens_per_s=speed, peak_gb=15.5) for backend, speed in
                    (("torch", 120_000.0), ("triton", 1_500_000.0))]}
    (tmp_path / "gpu_throughput-20990101T000000Z.json").write_text(json.dumps({"figures": run}))
    figures = bench.main(["--device", "cpu", "--shape", "tiny", "--default_batch", "1", "--corpus_tokens", "12000",
                          "--results_dir", str(tmp_path)])["default_batch"]
    assert figures["batch"] == 32 and figures["rule"] == "per_device_train_batch_size"  # the CPU's
    assert figures["tokens_per_s"] > 0 and figures["num_edges"] > 0
    assert figures["throughput_rows"] == [dict(batch="1024x64", tokens_per_s=1_500_000.0, peak_gb=15.5,
                                               optimizer="sparse_adamw")]
    record = json.loads(next(p for p in tmp_path.glob("gpu_throughput-*.json") if "2099" not in p.name).read_text())
    assert record["figures"]["default_batch"]["batch"] == 32 and "default batch 32 x 32" in capsys.readouterr().out
    committed, rows = bench.throughput_rows(tmp_path / "none")  # no run's record: the committed one
    assert committed.startswith("benchmarks/results/gpu_throughput-") and rows and all(r["tokens_per_s"] for r in rows)
