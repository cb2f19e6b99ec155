"""The 8-GPU setups rehearsed on 8 CPU processes: `accelerate launch` with the CPU twins of gpu8_ddp.yaml,
gpu8_fsdp.yaml and gpu8_sharded.yaml (cpu8_*.yaml, 8 gloo processes) running examples/pretrain.py on a tiny model.

DDP, FSDP and `--edge_sharding source` each give one process's losses at the same global batch with default flags
(per-process batches of 1 and 2 rows, FSDP with gradient accumulation); the validation batches do not divide by 8
(accelerate pads DDP's and FSDP's, the sharded evaluation hands some processes no rows) and the validation loss is
one process's; FSDP splits parameters whose first dimension does not divide by 8 and its folder loads and generates
in one process; a source-sharded checkpoint of 8 processes resumes on 1, 2 and 8 on the same curve; a graph with
fewer source nodes than owners stops every process with one clear message. Each test is one group of runs that
feeds several checks (8-process launches dominate the time); every subprocess has a timeout.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pretrain.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
CONFIGS = ROOT / "configuration" / "accelerate"
TINY = ["--vocab_size", "300", "--node_size", "8", "--block_size", "16", "--num_generations", "0",
        "--max_train_steps", "10", "--per_device_eval_batch_size", "1"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "ACCELERATE_USE_CPU",
        "BRILLM_AVAILABLE_MEMORY_GB")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


def _pretrain(args, config: str | None = None, check: bool = True, timeout: int = 240):
    """examples/pretrain.py in one plain process, or launched with configuration/accelerate/<config>."""
    cmd, env = [sys.executable, str(SCRIPT)], _env()
    if config is None:
        env["ACCELERATE_USE_CPU"] = "1"  # one CPU process on any machine
    else:
        cmd = [str(ACCELERATE), "launch", "--config_file", str(CONFIGS / config), "--main_process_port",
               str(random.randint(20000, 40000)), str(SCRIPT)]
    result = subprocess.run(cmd + [str(a) for a in [*TINY, *args]], capture_output=True, text=True, timeout=timeout,
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _log(out) -> tuple[dict[int, float], dict[int, float]]:
    """(training loss, validation loss) by step of a run's train_log.jsonl."""
    records = [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r})


def _weights(out) -> dict:
    from safetensors.torch import load_file

    return {k.removeprefix("brillm."): v for k, v in load_file(str(Path(out) / "model.safetensors")).items()}


def _same_curve(out, ref_out, steps, eval_steps=()):
    (got, got_eval), (ref, ref_eval) = _log(out), _log(ref_out)
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0), (step, got[step], ref[step])
    for step in eval_steps:
        assert got_eval[step] == pytest.approx(ref_eval[step], rel=1e-5, abs=0), (step, got_eval, ref_eval)


def _same_weights(out, ref_out, atol=2e-5):
    got, ref = _weights(out), _weights(ref_out)
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=atol), (key, float((got[key] - value).abs().max()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat dog bird sat on mat log tree saw a big small red blue ran over under and with house".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(400)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cpu_twins_are_the_gpu_configs_on_eight_cpu_processes():
    for kind in ("ddp", "fsdp", "sharded"):
        cpu, gpu = (yaml.safe_load((CONFIGS / f"{device}8_{kind}.yaml").read_text()) for device in ("cpu", "gpu"))
        changed = {k for k in set(cpu) | set(gpu) if cpu.get(k) != gpu.get(k)}
        assert changed <= {"use_cpu", "gpu_ids", "mixed_precision"}, (kind, changed)
        assert cpu["num_processes"] == gpu["num_processes"] == 8 and cpu["use_cpu"] is True
        assert cpu["mixed_precision"] == "no" and cpu["gpu_ids"] == "-1,-1"


@pytest.mark.slow
def test_ddp_and_fsdp_on_eight_processes_match_one(corpus, tmp_path):
    one, ddp, fsdp = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp"
    data = ["--train_file", corpus]
    # auto picks dense AdamW for several processes; one process with the same optimizer and global batch 16
    _pretrain([*data, "--output_dir", one, "--optimizer", "adamw", "--per_device_train_batch_size", "16"])
    result = _pretrain([*data, "--output_dir", ddp, "--per_device_train_batch_size", "2"], "cpu8_ddp.yaml")
    assert "8 process(es) [MULTI_CPU]" in result.stdout and "global batch 16 blocks = 2 x 8" in result.stdout
    assert "optimizer: adamw" in result.stdout
    _same_curve(ddp, one, range(1, 11), eval_steps=(0, 10))
    _same_weights(ddp, one)
    result = _pretrain([*data, "--output_dir", fsdp, "--per_device_train_batch_size", "1",
                        "--gradient_accumulation_steps", "2"], "cpu8_fsdp.yaml")
    assert "sharded by the script with torch's FSDP2" in result.stdout
    assert "global batch 16 blocks = 1 x 8 process(es) x 2" in result.stdout
    _same_curve(fsdp, one, range(1, 11), eval_steps=(0, 10))
    _same_weights(fsdp, one)
    # the 8-way split: rank 0 holds the first ceil(n / 8) rows of every parameter, n its first dimension
    shapes = {k: v.shape for k, v in _weights(fsdp).items() if not k.startswith(("graph_", "prior_"))}
    assert any(s[0] % 8 for s in shapes.values()), shapes
    held = int(result.stdout.split("the main process holds ")[1].split(" of the ")[0].replace(",", ""))
    assert held == sum(math.ceil(s[0] / 8) * math.prod(s[1:]) for s in shapes.values()), (held, shapes)
    # the gathered folder is a plain one: loads and generates in one process
    from transformers import AutoTokenizer

    from modeling_brillm import BriLLMForCausalLM

    model, tokenizer = BriLLMForCausalLM.from_pretrained(fsdp), AutoTokenizer.from_pretrained(fsdp)
    ids = tokenizer(["The cat sat on the mat."], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_source_sharded_on_eight_processes_matches_one_and_resumes_on_one_two_and_eight(corpus, tmp_path):
    one, eight = tmp_path / "one", tmp_path / "eight"
    data = ["--train_file", corpus]
    _pretrain([*data, "--output_dir", one, "--per_device_train_batch_size", "8"])  # SparseAdamW, global batch 8
    result = _pretrain([*data, "--output_dir", eight, "--edge_sharding", "source", "--per_device_train_batch_size",
                        "1", "--checkpointing_steps", "5"], "cpu8_sharded.yaml")
    rows = json.loads(result.stdout.split("edge rows per process ")[1].split(" of ")[0])
    assert len(rows) == 8 and min(rows) > 0, rows  # eight owners, each with rows
    _same_curve(eight, one, range(1, 11), eval_steps=(0, 10))
    _same_weights(eight, one)
    assert len(list((eight / "step_5").glob("edge_shard_*_of_00008.safetensors"))) == 8
    # the 8-process checkpoint at step 5 resumes on 1, on 2 and on 8 processes, continuing the same curve
    for processes, config in ((1, None), (2, "cpu_2.yaml"), (8, "cpu8_sharded.yaml")):
        resumed = tmp_path / f"resumed{processes}"
        result = _pretrain([*data, "--output_dir", resumed, "--edge_sharding", "source", "--resume_from_checkpoint",
                            eight / "step_5", "--per_device_train_batch_size", str(8 // processes)], config)
        assert "resumed from" in result.stdout and "not an exact continuation" not in result.stdout
        _same_curve(resumed, one, range(6, 11), eval_steps=(10,))
        _same_weights(resumed, one)


@pytest.mark.slow
def test_more_processes_than_source_nodes_stops_every_process_with_one_message(tmp_path):
    """Four source nodes with successors, eight owners: every process finds it before the first step, from what all
    of them hold, and exits (the launcher stops the others at the first exit): one line, the launcher's report after
    it, no hang."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("ab ab ab ab.\n" * 300, encoding="utf-8")
    result = _pretrain(["--train_file", corpus, "--output_dir", tmp_path / "out", "--edge_sharding", "source",
                        "--per_device_train_batch_size", "2"], "cpu8_sharded.yaml", check=False, timeout=180)
    assert result.returncode != 0 and "train:" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "would own no edge rows" in line]
    assert lines and len(set(lines)) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: --edge_sharding source: with 8 processes") and "Use at most 4" in lines[0]
    assert "Traceback" not in result.stderr.split(lines[0])[0]  # the launcher's own report comes after the line
