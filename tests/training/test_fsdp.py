"""FSDP2 through examples/pretrain.py on the CPU: `accelerate launch --config_file cpu_2_fsdp.yaml`, where accelerate
forms a MULTI_CPU run and the script shards the model with torch's `fully_shard` (modeling_brillm/training/fsdp.py).
Two processes match one within float32 rounding, checkpoints are sharded (torch.distributed.checkpoint) and resume
exactly, the best model is restored into the shards, and the final folder loads with the Auto classes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from modeling_brillm.training import checkpoints
from modeling_brillm.training.launch import fsdp_not_formed
from tests.training.test_pretrain import (
    CPU2_FSDP,
    OVERFIT_ARGS,
    ROOT,
    SCRIPT,
    corpus,  # noqa: F401 (a fixture)
    env,
    losses,
    lrs,
    overfit_files,
    run,
    same_weights,
    weights_of,
)

GPU8_FSDP = ROOT / "configuration" / "accelerate" / "gpu8_fsdp.yaml"
FSDP_LINE = "[MULTI_CPU, sharded by the script with torch's FSDP2]"


def launch_env(config: Path) -> dict:
    """The environment `accelerate launch --config_file config` gives its processes (FSDP_* from fsdp_config)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "--main_process_port", "0",
                                               str(SCRIPT)])
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


def formed(kind: str, processes: int = 2):
    import torch
    from accelerate.utils import DistributedType

    return SimpleNamespace(distributed_type=DistributedType(kind), device=torch.device("cpu"),
                           num_processes=processes)


def dcp_weights(folder: Path) -> dict:
    """The model weights of a sharded checkpoint (torch.distributed.checkpoint), merged in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    merged = folder.with_suffix(".pt")
    dcp_to_torch_save(folder, merged)
    return torch.load(merged, weights_only=True)["model"]


# ------------------------------------------------------------------------------------------- the launch
def test_cpu_config_is_the_gpu_config_in_fp32_on_two_cpu_processes():
    cpu, gpu = yaml.safe_load(CPU2_FSDP.read_text()), yaml.safe_load(GPU8_FSDP.read_text())
    assert {k for k in set(cpu) | set(gpu) if cpu.get(k) != gpu.get(k)} == {
        "num_processes", "gpu_ids", "use_cpu", "mixed_precision"}
    assert cpu["mixed_precision"] == "no" and gpu["mixed_precision"] == "bf16"
    assert cpu["distributed_type"] == "FSDP" and cpu["fsdp_config"]["fsdp_version"] == 2


def test_an_fsdp_launch_on_the_cpu_is_sharded_by_the_script_or_refused_clearly():
    environ = launch_env(CPU2_FSDP)
    assert environ["ACCELERATE_USE_FSDP"] == "true" and environ["FSDP_VERSION"] == "2"
    # pretrain.py shards there; another script would train as DDP: refused, naming the way out
    assert fsdp_not_formed(formed("MULTI_CPU"), environ, shards_on_cpu=True) is None
    refused = fsdp_not_formed(formed("MULTI_CPU"), environ)
    assert "formed a MULTI_CPU run on cpu" in refused and "does not shard the model itself" in refused
    assert "cpu_2.yaml" in refused
    assert fsdp_not_formed(formed("FSDP"), launch_env(GPU8_FSDP)) is None  # accelerate's own FSDP
    assert fsdp_not_formed(formed("MULTI_CPU"), {}) is None  # no FSDP asked
    # settings the CPU path cannot honour are named, each with its fix
    for name, value, expected in [("FSDP_VERSION", "1", "fsdp_version must be 2"),
                                  ("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT", "must be SHARDED_STATE_DICT"),
                                  ("FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params must be false"),
                                  ("FSDP_ACTIVATION_CHECKPOINTING", "true", "activation_checkpointing must be false"),
                                  ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true", "ram_efficient_loading must be false")]:
        message = fsdp_not_formed(formed("MULTI_CPU"), {**environ, name: value}, shards_on_cpu=True)
        assert expected in message and "cpu_2_fsdp.yaml" in message, message
    one = fsdp_not_formed(formed("NO", processes=1), environ, shards_on_cpu=True)
    assert "this launch started one" in one and "cpu_1.yaml" in one


# ------------------------------------------------------------------------------------------- whole runs
PARITY_ARGS = ["--vocab_size", "512", "--block_size", "32", "--node_size", "8", "--num_generations", "0",
               "--max_train_steps", "20", "--max_grad_norm", "0", "--lr_scheduler_type", "constant",
               "--optimizer", "adamw", "--learning_rate", "0.02",
               "--signal_dropout", "0.3", "--signal_dropout_warmup_epochs", "0",  # masks keyed by the global batch
               "--edge_backoff", "--non_edge_bias"]  # the recipe plus the two optional extensions


@pytest.mark.slow
def test_two_fsdp_processes_match_one_and_save_a_loadable_folder(corpus, tmp_path):  # noqa: F811
    """The default recipe (node readout, node embedding, count prior) and the edge backoff and non-edge bias:
    ordinary parameters and buffers, with dense AdamW: one process with batch 16, two FSDP processes with 8 each."""
    one, two = tmp_path / "one", tmp_path / "two"
    run(["--train_file", corpus, "--output_dir", one, *PARITY_ARGS, "--per_device_train_batch_size", "16"],
        ACCELERATE_USE_CPU="1")
    result = run(["--train_file", corpus, "--output_dir", two, *PARITY_ARGS, "--per_device_train_batch_size", "8",
                  "--checkpointing_steps", "10", "--num_generations", "1", "--max_new_tokens", "4"],
                 launcher=CPU2_FSDP, timeout=300)
    text = result.stdout
    assert FSDP_LINE in text and "global batch 16 blocks = 8 x 2 process(es) x 1" in text
    held, total = (int(n.replace(",", "")) for n in
                   text.split("the main process holds ")[1].split(" parameters")[0].split(" of the "))
    assert 0 < held < total  # sharded: the main process holds about half
    assert "sharded params+grads+AdamW" in text and "DDP buckets" not in text  # the memory check knows it
    assert "optimizer: adamw (AdamW on dense gradients; --optimizer adamw" in text
    assert "greedy" in text  # every process generates with the sharded weights
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    gap = max(abs(a[step] - b[step]) for step in a)
    print(f"largest loss difference over 20 steps, 1 process vs 2 FSDP processes: {gap:.2e}")
    assert gap < 1e-4, gap

    # a sharded checkpoint: one file per process, which accelerate's and torch's tools merge
    assert sorted(p.name for p in (two / "step_10" / "pytorch_model_fsdp_0").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert (two / "step_10" / "optimizer_0").is_dir() and not (two / "step_10" / "model.safetensors").exists()
    config = json.loads((two / "config.json").read_text())
    assert all(config[k] for k in ("node_readout", "edge_backoff", "non_edge_bias", "node_embedding", "count_prior"))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_brillm.BriLLMForCausalLM"
    assert not list(two.glob("_fsdp*.py")), "torch's FSDP class must not be saved as the model's code"
    probe = f"""
import math
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(two)!r}, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained({str(two)!r}, trust_remote_code=True)
ids = tok(["The cat sat on the mat."], return_tensors="pt")
assert math.isfinite(float(model(**ids, labels=ids["input_ids"]).loss))
out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
print("OK", type(model).__name__, out.shape[1] - ids["input_ids"].shape[1])
"""
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env(), stdin=subprocess.DEVNULL)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    ok = [line.split() for line in loaded.stdout.splitlines() if line.startswith("OK ")]
    assert ok and ok[0][1] == "BriLLMForCausalLM" and int(ok[0][2]) > 0, loaded.stdout[-2000:]


@pytest.mark.slow
def test_fsdp_keeps_the_best_model_and_resumes_exactly(tmp_path):
    """Held-out loss falls, then rises: the final folder holds the weights of the best evaluation's sharded
    checkpoint, gathered from the shards; a resume from a later checkpoint continues the same losses and keeps
    the same best model. Gradient accumulation and clipping on: 2 blocks x 2 processes x 2 micro-batches."""
    from modeling_brillm.training.best import BEST_FILE

    train, validation = overfit_files(tmp_path)
    data = ["--train_file", train, "--validation_file", validation, *OVERFIT_ARGS,
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    out = tmp_path / "kept"
    result = run([*data, "--output_dir", out], launcher=CPU2_FSDP, timeout=300)
    assert FSDP_LINE in result.stdout and "gradient norm clipped to 1" in result.stdout
    evals = {r["step"]: r["eval_loss"] for r in checkpoints.read_log(out / checkpoints.LOG_NAME)
             if "eval_loss" in r and r["step"] > 0}
    best_step = min(evals, key=evals.get)
    assert sorted(evals) == [5, 10, 15, 20, 25, 30] and best_step < 25 and evals[30] > evals[best_step] + 0.2, evals
    assert f"kept the best model: step {best_step} (validation loss {evals[best_step]:.4f}" in result.stdout
    summary = json.loads((out / "pretrain_summary.json").read_text())
    assert summary["best_step"] == best_step and summary["eval_loss"] == evals[best_step]
    saved = weights_of(out / "model.safetensors")
    assert same_weights(saved, dcp_weights(out / f"step_{best_step}" / "pytorch_model_fsdp_0"))
    assert not same_weights(saved, dcp_weights(out / "step_30" / "pytorch_model_fsdp_0"))
    assert not (out / BEST_FILE).exists()

    later = best_step + 5
    resumed = tmp_path / "resumed"
    result = run([*data, "--output_dir", resumed, "--resume_from_checkpoint", out / f"step_{later}"],
                 launcher=CPU2_FSDP, timeout=300)
    assert f"best model so far: step {best_step}" in result.stdout
    ref, got = losses(out), losses(resumed)
    assert sorted(got) == list(range(later + 1, 31))
    for step in got:
        assert got[step] == pytest.approx(ref[step], abs=1e-6, rel=0), step
        assert lrs(resumed)[step] == lrs(out)[step]
    assert same_weights(weights_of(resumed / "model.safetensors"), saved)
    assert math.isfinite(json.loads((resumed / "pretrain_summary.json").read_text())["last_eval_loss"])
    assert not any(p.name.startswith(checkpoints.TMP_PREFIX) for p in resumed.iterdir())
    assert os.path.isdir(resumed / "step_30" / "pytorch_model_fsdp_0")
