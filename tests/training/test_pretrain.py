"""examples/pretrain.py: end to end, exact resume (also after SIGKILL), 1 vs 2 processes, clear errors, the
memory guard. Tiny corpora in tmp folders, tiny models (V=300 BPE, d=8, blocks of 16); every run is a
subprocess, as `accelerate launch` would start it."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from modeling_brillm.training import checkpoints, data, memory, optimizers, presets
from modeling_brillm.training import pretraining as pretrain  # parse_args, main, SUMMARY_NAME
from modeling_brillm.training.errors import UsageError
from tests._scripts import refused

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pretrain.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
CPU1 = ROOT / "configuration" / "accelerate" / "cpu_1.yaml"
CPU2 = ROOT / "configuration" / "accelerate" / "cpu_2.yaml"
CPU2_FSDP = ROOT / "configuration" / "accelerate" / "cpu_2_fsdp.yaml"

TINY = ["--vocab_size", "300", "--node_size", "8", "--block_size", "16", "--num_generations", "0",
        "--learning_rate", "0.05", "--num_warmup_steps", "2", "--eval_steps", "5"]


def env(**extra):
    e = dict(os.environ)
    e.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1")
    e.pop(memory.MEMORY_ENV, None)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR",
                "ACCELERATE_USE_CPU"):
        e.pop(key, None)
    e.update(extra)
    return e


def run(args, launcher=None, timeout=120, check=True, **env_extra):
    """Run the script (plain python, or through `accelerate launch` with a config) and return the result."""
    if launcher is None:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        cmd = [str(ACCELERATE), "launch", "--config_file", str(launcher)]
        if launcher in (CPU2, CPU2_FSDP):
            cmd += ["--main_process_port", str(random.randint(20000, 40000))]
        cmd += [str(SCRIPT)]
    result = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                            cwd=ROOT, env=env(**env_extra))
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\n"
                             f"STDERR:\n{result.stderr[-6000:]}")
    return result


def losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in checkpoints.read_log(Path(out_dir) / checkpoints.LOG_NAME) if "loss" in r}


def lrs(out_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in checkpoints.read_log(Path(out_dir) / checkpoints.LOG_NAME) if "lr" in r}


WORDS = ("the cat dog bird sat on mat log tree saw a big small red blue ran jumped over under quickly slowly and "
         "with house garden river").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~400 lines of one or two short sentences over a 25-word vocabulary."""
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".!?")
        if rng.random() < 0.5:
            line += " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))).capitalize() + "."
        lines.append(line)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# 570 training blocks / 32 = 17 steps per epoch: 24 steps cross an epoch boundary.
REF_ARGS = TINY + ["--per_device_train_batch_size", "32", "--max_train_steps", "24", "--checkpointing_steps", "4"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted run of 24 steps with a checkpoint every 4."""
    out = tmp_path_factory.mktemp("reference")
    run(["--train_file", corpus, "--output_dir", out, *REF_ARGS])
    return out


# ----------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_end_to_end_accelerate_launch(corpus, tmp_path):
    out = tmp_path / "run"
    result = run(["--train_file", corpus, "--output_dir", out, *TINY, "--per_device_train_batch_size", "16",
                  "--max_train_steps", "30", "--num_generations", "2", "--max_new_tokens", "8",
                  "--prompts", "The cat", "A dog"], launcher=CPU1)
    text = result.stdout + result.stderr
    assert "data: file" in text and "graph: sparse" in text and "training memory estimate" in text
    assert "greedy" in text and "sampled" in text
    assert "optimizer: sparse_adamw (SparseAdamW on sparse row gradients; auto: one process" in text
    assert "gradient norm clipped to 1" in text
    assert "--min_bigram_count auto chose" in text  # the built-in recipe sizes the graph to the data, and says so
    assert re.search(r"the planned [0-9.]+ epoch\(s\)", text)  # ... and to the run's length
    assert "--signal_dropout auto chose" in text  # dropout too is chosen from the data, and said
    config = json.loads((out / "config.json").read_text())
    assert config["node_readout"] is True and config["non_edge_bias"] is False
    # the count prior holds every bigram seen, the pruned ones too, and the remote-code load below adds it
    assert config["count_prior"] is True and config["count_prior_bigrams"] >= config["num_edges"]
    assert f"count prior of all {config['count_prior_bigrams']:,} bigrams seen" in text
    log = losses(out)
    assert sorted(log) == list(range(1, 31)) and all(math.isfinite(v) for v in log.values())
    summary = json.loads((out / pretrain.SUMMARY_NAME).read_text())
    assert math.isfinite(summary["perplexity"]) and summary["perplexity"] < summary["perplexity_before"]
    assert summary["steps"] == 30 and len(summary["generations"]) == 2
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "modeling_brillm.py").is_file(), "save_pretrained should ship the model code"

    # the final save writes a model card: Hub metadata, the final validation perplexity, a usage snippet
    from huggingface_hub import ModelCard

    from modeling_brillm.model_card import check_hub_ready

    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert "brillm" in meta["tags"] and "pretraining" in meta["tags"] and "datasets" not in meta
    metric = meta["model-index"][0]["results"][0]["metrics"][0]
    assert metric["type"] == "perplexity" and metric["value"] == pytest.approx(summary["perplexity"], rel=1e-4)
    assert "every 20th training text, held out" in card.text and "corpus.txt" in card.text
    assert "trust_remote_code=True" in card.text and "| optimizer steps | 30 |" in card.text
    assert str(tmp_path) not in card.text, "no local paths in a card meant for the Hub"
    assert check_hub_ready(out) == []

    # a clean process loads the folder through the Auto classes with remote code and scores text
    probe = f"""
import math, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
ids = tok(["The cat sat on the mat."], return_tensors="pt")
loss = model(**ids, labels=ids["input_ids"]).loss
assert math.isfinite(float(loss)), loss
print("OK", type(model).__name__, model.config.vocab_size, float(loss))
"""
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env(), stdin=subprocess.DEVNULL)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "OK BriLLMForCausalLM 300" in loaded.stdout


def test_contiguous_blocks_sampled_loss(corpus, tmp_path):
    out = tmp_path / "run"
    result = run(["--train_file", corpus, "--output_dir", out, *TINY, "--contiguous_blocks", "--loss", "sampled",
                  "--num_negatives", "20", "--per_device_train_batch_size", "8", "--max_train_steps", "6",
                  "--min_bigram_count", "2"])
    assert "contiguous mode" in result.stdout and "0% padding" in result.stdout
    assert "loss sampled" in result.stdout
    assert len(losses(out)) == 6 and all(math.isfinite(v) for v in losses(out).values())
    config = json.loads((out / "config.json").read_text())
    assert config["loss_type"] == "sampled" and config["num_negatives"] == 20


@pytest.mark.slow
def test_sparse_adamw_clips_accumulated_gradients(corpus, tmp_path):
    """The sparse path with gradient accumulation: uncoalesced row gradients, clipped to --max_grad_norm."""
    out = tmp_path / "run"
    result = run(["--train_file", corpus, "--output_dir", out, *TINY, "--optimizer", "sparse_adamw",
                  "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_train_steps", "8",
                  "--max_grad_norm", "0.5"])
    assert "optimizer: sparse_adamw (SparseAdamW on sparse row gradients; --optimizer sparse_adamw); gradient " \
        "norm clipped to 0.5" in result.stdout
    log = losses(out)
    assert len(log) == 8 and all(math.isfinite(v) for v in log.values()) and log[8] < log[1]


def test_optimizer_choice():
    one = optimizers.choose_optimizer("auto", 1, 1.0)
    assert one.name == "sparse_adamw" and one.sparse_gradients and one.clip and "one process" in one.reason
    two = optimizers.choose_optimizer("auto", 2, 1.0)
    assert two.name == "adamw" and not two.sparse_gradients and "2 processes" in two.reason
    assert not optimizers.choose_optimizer("adamw", 1, 0.0).clip
    assert "no gradient clipping" in optimizers.describe_optimizer(optimizers.choose_optimizer("auto", 1, 0), 0)
    with pytest.raises(UsageError, match="single process only"):
        optimizers.choose_optimizer("sparse_adamw", 2, 1.0)
    assert pretrain.parse_args([]).optimizer == "auto"
    # FSDP shards dense gradients only, with any process count
    for processes in (1, 2):
        fsdp = optimizers.choose_optimizer("auto", processes, 1.0, fsdp=True)
        assert fsdp.name == "adamw" and not fsdp.sparse_gradients and "FSDP shards dense gradients" in fsdp.reason
    with pytest.raises(UsageError, match="sparse row gradients, which FSDP cannot shard"):
        optimizers.choose_optimizer("sparse_adamw", 1, 1.0, fsdp=True)
    # the moments' dtype: bfloat16 under bf16 mixed precision with SparseAdamW on a GPU, a flag wins, dense AdamW
    # refuses it
    assert optimizers.resolve_moment_dtype(None, one, "bf16", "cuda") == "bfloat16"
    assert optimizers.resolve_moment_dtype("bfloat16", one, "no", "cpu") == "bfloat16"
    assert "float32" == optimizers.resolve_moment_dtype(None, one, "no", "cuda") \
        == optimizers.resolve_moment_dtype(None, two, "bf16", "cuda") \
        == optimizers.resolve_moment_dtype("float32", one, "bf16", "cuda") \
        == optimizers.resolve_moment_dtype(None, one, "bf16", "cpu")
    assert "moments in bfloat16" in optimizers.describe_optimizer(one, 1.0, "bfloat16")
    with pytest.raises(UsageError, match="--moment_dtype bfloat16 needs SparseAdamW"):
        optimizers.resolve_moment_dtype("bfloat16", two, "bf16")


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_clip_grad_norm_of_sparse_gradients_matches_dense(micro_batches):
    """Sparse row gradients (coalesced, or accumulated over micro-batches and so uncoalesced) are clipped by the
    norm of the dense gradient they stand for, to the same values torch's clip_grad_norm_ gives the dense one."""
    import torch

    from modeling_brillm import BriLLMForCausalLM
    from modeling_brillm.training.loop import clip_grad_norm_

    torch.manual_seed(0)
    seqs = [torch.randint(1, 12, (7,)) for _ in range(6)]
    model = BriLLMForCausalLM.from_token_sequences(seqs, 12, node_size=4)
    batches = [torch.stack(seqs[:3]), torch.stack(seqs[3:])][:micro_batches]
    grads, norms = {}, {}
    for sparse in (False, True):
        model.sparse_gradients = sparse
        model.zero_grad(set_to_none=True)
        for ids in batches:
            model(input_ids=ids, labels=ids, return_logits=False).loss.backward()
        params = list(model.parameters())
        if sparse:
            assert any(p.grad.is_sparse for p in params)
            if micro_batches > 1:
                assert any(p.grad.is_sparse and not p.grad.is_coalesced() for p in params)
            norms[sparse] = clip_grad_norm_(params, 0.1)
        else:
            norms[sparse] = float(torch.nn.utils.clip_grad_norm_(params, 0.1))
        grads[sparse] = [p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for p in params]
    assert norms[True] == pytest.approx(norms[False], rel=1e-5) and norms[False] > 0.1
    for dense, sparse in zip(grads[False], grads[True]):
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-7)


def test_the_planned_epochs_come_from_the_steps_or_the_epochs():
    """What `--min_bigram_count auto` is told of the run's length, before the loaders exist."""
    args = SimpleNamespace(max_train_steps=None, num_train_epochs=3, per_device_train_batch_size=8,
                           gradient_accumulation_steps=2)
    accelerator, data = SimpleNamespace(num_processes=2), SimpleNamespace(train=[None] * 320)
    assert pretrain.planned_epochs(args, data, accelerator) == 3.0
    args.max_train_steps = 10  # 10 steps of 8 x 2 processes x 2 accumulated blocks: 320 blocks, one epoch
    assert pretrain.planned_epochs(args, data, accelerator) == 1.0


def test_clipping_marks_unique_sparse_rows_coalesced_without_copying_them():
    """A gradient autograd added up is flagged uncoalesced even when its rows are unique and increasing: the clip
    then sets the flag and keeps the values where they are; duplicated rows are still summed."""
    import torch

    from modeling_brillm.training.loop import _coalesced

    values = torch.arange(12.0).view(3, 2, 2)
    unique = torch.sparse_coo_tensor(torch.tensor([[0, 2, 5]]), values, (6, 2, 2), check_invariants=True)
    assert not unique.is_coalesced()
    flagged = _coalesced(unique)
    assert flagged.is_coalesced() and flagged._values().data_ptr() == values.data_ptr()
    duplicated = torch.sparse_coo_tensor(torch.tensor([[5, 0, 5]]), values, (6, 2, 2), check_invariants=True)
    summed = _coalesced(duplicated)
    assert summed.is_coalesced() and summed._indices().tolist() == [[0, 5]]
    torch.testing.assert_close(summed.to_dense(), duplicated.to_dense())


# ------------------------------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_resume_gives_identical_loss_curve(reference, corpus, tmp_path):
    ref = losses(reference)
    assert sorted(ref) == list(range(1, 25))
    complete = [step for step, _ in checkpoints.list_checkpoints(reference)]
    assert complete == [4, 8, 12, 16, 20, 24]
    out = tmp_path / "resumed"
    # step 12 is inside the first epoch (17 steps): the resumed run skips 12 batches, then crosses into epoch 1
    result = run(["--train_file", corpus, "--output_dir", out, *REF_ARGS,
                  "--resume_from_checkpoint", reference / "step_12"])
    assert "resumed from" in result.stdout and "skipping 12 batches" in result.stdout
    got = losses(out)
    assert sorted(got) == list(range(13, 25))
    for step in got:
        assert got[step] == pytest.approx(ref[step], abs=1e-6, rel=0), step
        assert lrs(out)[step] == pytest.approx(lrs(reference)[step], abs=1e-12)
    final_ref = json.loads((reference / pretrain.SUMMARY_NAME).read_text())["eval_loss"]
    final_got = json.loads((out / pretrain.SUMMARY_NAME).read_text())["eval_loss"]
    assert final_got == pytest.approx(final_ref, abs=1e-6)


def test_an_extended_run_resumes_on_the_graph_it_was_trained_on(reference, corpus, tmp_path):
    """`--min_bigram_count auto` depends on the planned epochs; a resumed run that trains longer than planned must
    still rebuild the checkpoint's graph (its planned length is read from the checkpoint)."""
    out = tmp_path / "extended"
    result = run(["--train_file", corpus, "--output_dir", out, *REF_ARGS, "--max_train_steps", "60",
                  "--resume_from_checkpoint", reference / "step_12"])
    text = result.stdout + result.stderr
    assert "resumed from" in text and re.search(r"the planned 1\.[0-9]+ epoch\(s\)", text)  # 24 steps, not 60
    assert sorted(losses(out)) == list(range(13, 61))


@pytest.mark.slow
def test_killed_run_resumes_from_latest_complete_checkpoint(reference, corpus, tmp_path):
    out = tmp_path / "killed"
    args = [sys.executable, str(SCRIPT), "--train_file", str(corpus), "--output_dir", str(out), *REF_ARGS,
            "--step_sleep", "0.3"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            if any(step >= 8 for step, _ in checkpoints.list_checkpoints(out)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = [step for step, _ in checkpoints.list_checkpoints(out)]
    assert saved and max(saved) >= 8 and max(saved) < 24
    last = max(saved)
    logged = max(losses(out))
    assert logged < 24 and logged - last <= 4, "at most the steps since the last checkpoint are lost"

    result = run(["--train_file", corpus, "--output_dir", out, *REF_ARGS, "--resume_from_checkpoint", "latest"])
    assert f"resumed from {out / f'step_{last}'}: step {last}" in result.stdout
    ref, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, 25))
    for step in range(1, 25):
        assert got[step] == pytest.approx(ref[step], abs=1e-6, rel=0), step
    assert not any(p.name.startswith(checkpoints.TMP_PREFIX) for p in out.iterdir())


# ------------------------------------------------------------------------------------------ best model
def overfit_files(folder) -> tuple[Path, Path]:
    """40 training and 40 other validation sentences: a d=8 model at lr 0.3 memorises the training ones within
    ~15 steps, after which the held-out loss climbs."""
    paths = []
    for seed, name in ((1, "train.txt"), (2, "validation.txt")):
        rng = random.Random(seed)
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(40)]
        paths.append(folder / name)
        paths[-1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths[0], paths[1]


OVERFIT_ARGS = ["--vocab_size", "300", "--node_size", "8", "--block_size", "16", "--num_generations", "0",
                "--per_device_train_batch_size", "8", "--max_train_steps", "30", "--eval_steps", "5",
                "--learning_rate", "0.3", "--lr_scheduler_type", "constant", "--checkpointing_steps", "5",
                # a graph, dropout and extensions that let it memorise: the default recipe holds a long run on text
                # that strays
                "--min_bigram_count", "1", "--signal_dropout", "0", "--edge_backoff", "--non_edge_bias"]


def weights_of(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_best_model_is_kept_and_survives_resume(tmp_path):
    """Held-out loss falls, then rises as the model memorises: the saved folder holds the best evaluation's
    weights (those of its step's checkpoint), also after a resume from a later checkpoint; --no_keep_best saves
    the last step's."""
    from modeling_brillm.training.best import BEST_FILE

    train, validation = overfit_files(tmp_path)
    data = ["--train_file", train, "--validation_file", validation, *OVERFIT_ARGS]
    out = tmp_path / "kept"
    result = run([*data, "--output_dir", out])
    evals = {r["step"]: r["eval_loss"] for r in checkpoints.read_log(out / checkpoints.LOG_NAME)
             if "eval_loss" in r and r["step"] > 0}
    best_step = min(evals, key=evals.get)
    assert sorted(evals) == [5, 10, 15, 20, 25, 30] and best_step < 25 and evals[30] > evals[best_step] + 0.2, evals
    assert f"kept the best model: step {best_step} (validation loss {evals[best_step]:.4f}" in result.stdout
    summary = json.loads((out / pretrain.SUMMARY_NAME).read_text())
    assert summary["best_step"] == best_step and summary["eval_loss"] == evals[best_step]
    assert summary["last_eval_loss"] == evals[30]
    saved = weights_of(out / "model.safetensors")
    assert same_weights(saved, weights_of(out / f"step_{best_step}" / "model.safetensors"))
    assert not (out / BEST_FILE).exists()  # the working copy is gone; checkpoints keep theirs
    later = best_step + 5
    assert json.loads((out / f"step_{later}" / checkpoints.STATE_NAME).read_text())["best"]["step"] == best_step

    resumed = tmp_path / "resumed"
    result = run([*data, "--output_dir", resumed, "--resume_from_checkpoint", out / f"step_{later}"])
    assert f"best model so far: step {best_step}" in result.stdout
    assert same_weights(weights_of(resumed / "model.safetensors"), saved)

    last = tmp_path / "last"
    result = run([*data, "--output_dir", last, "--no_keep_best"])
    assert "keeping the last model" in result.stdout and "kept the best model" not in result.stdout
    assert same_weights(weights_of(last / "model.safetensors"), weights_of(out / "step_30" / "model.safetensors"))
    assert json.loads((last / pretrain.SUMMARY_NAME).read_text())["eval_loss"] == evals[30]


# ---------------------------------------------------------------------------------------- 1 vs 2 processes
TWO_ARGS = TINY + ["--max_train_steps", "6", "--gradient_accumulation_steps", "2", "--eval_steps", "3"]


@pytest.mark.slow
def test_two_processes_match_one(corpus, tmp_path):
    """Same global batch (8 x 1 process x 2 accumulation = 4 x 2 processes x 2): same data order, same losses, with
    signal dropout 0.3 from the first step (each row's mask is keyed by its index in the global batch and the step,
    so DDP drops what one process drops; a resume draws the same masks again). With the demo preset's recipe
    (non-edge bias, node and shared-edge rates): DDP's dense AdamW cannot give the shared edge its own rate, so a
    preset's rate yields (said at start-up) where a typed flag is an error."""
    one, two = tmp_path / "one", tmp_path / "two"
    preset = tmp_path / "recipe.json"
    preset.write_text(json.dumps({"model": {"non_edge_bias": True},
                                  "training": {"shared_edge_lr_scale": 0.5, "node_lr_scale": 2.0}}))
    args = ["--config", preset, *TWO_ARGS, "--signal_dropout", "0.3", "--signal_dropout_warmup_epochs", "0"]
    # --optimizer auto picks dense AdamW under DDP; the one-process run asks for it (auto would pick the lazy
    # SparseAdamW, which updates untouched rows differently)
    run(["--train_file", corpus, "--output_dir", one, *args, "--per_device_train_batch_size", "8",
         "--optimizer", "adamw"], ACCELERATE_USE_CPU="1")  # on the CPU like cpu_2.yaml's, also on a GPU machine
    result = run(["--train_file", corpus, "--output_dir", two, *args, "--per_device_train_batch_size", "4",
                  "--checkpointing_steps", "3"], launcher=CPU2, timeout=180)
    assert "2 process(es)" in result.stdout and "global batch 16 blocks = 4 x 2 process(es) x 2" in result.stdout
    assert "optimizer: adamw (AdamW on dense gradients; auto: 2 processes" in result.stdout
    assert "the recipe's shared-edge rate (0.5x) needs sparse edge gradients" in result.stdout
    flag = run(["--train_file", corpus, "--output_dir", tmp_path / "flag", *args, "--optimizer", "adamw",
                "--shared_edge_lr_scale", "0.5"], check=False)
    assert "--shared_edge_lr_scale needs sparse edge gradients" in error_of(flag)
    assert json.loads((two / "config.json").read_text())["signal_dropout"] == 0.3
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:  # DDP averages gradients in another order than one process sums them: float32 rounding only
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-5), (step, a[step], b[step])
    eval_a = [r for r in checkpoints.read_log(one / checkpoints.LOG_NAME) if "eval_loss" in r]
    eval_b = [r for r in checkpoints.read_log(two / checkpoints.LOG_NAME) if "eval_loss" in r]
    assert [r["step"] for r in eval_a] == [r["step"] for r in eval_b] == [0, 3, 6]
    for x, y in zip(eval_a, eval_b):
        assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)

    # the two-process checkpoint resumes exactly, with two processes
    resumed = tmp_path / "two_resumed"
    run(["--train_file", corpus, "--output_dir", resumed, *args, "--per_device_train_batch_size", "4",
         "--resume_from_checkpoint", two / "step_3"], launcher=CPU2, timeout=180)
    c = losses(resumed)
    assert sorted(c) == [4, 5, 6]
    for step in c:
        assert c[step] == pytest.approx(b[step], abs=1e-6, rel=0), step


# ------------------------------------------------------------------------------------------------- errors
def error_of(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines, result.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize("case", ["empty", "blank", "missing", "extension"])
def test_clear_errors_for_bad_files(case, tmp_path, monkeypatch, capsys):
    path = tmp_path / ("notes.md" if case == "extension" else "data.txt")
    if case == "empty":
        path.write_text("")
    elif case == "blank":
        path.write_text("\n   \n\n")
    elif case == "extension":
        path.write_text("Some text here.\n")
    argv = ["--train_file", path, "--output_dir", tmp_path / "out", *TINY]
    if case == "blank":  # found when the data is read, after the accelerator starts: a real run
        message = error_of(run(argv, check=False))
    else:
        message = refused(pretrain, argv, monkeypatch, capsys)
    expected = {"empty": "is empty", "blank": "contains no text", "missing": "no such file",
                "extension": "unknown file extension '.md'"}[case]
    assert expected in message


def test_clear_error_for_too_short_texts(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("a\nb\nc\nd\n")
    message = error_of(run(["--train_file", path, "--output_dir", tmp_path / "out", *TINY], check=False))
    assert "shorter than two tokens" in message and "no bigram" in message


def test_clear_error_for_block_size_and_preset(corpus, tmp_path, monkeypatch, capsys):
    def error(*argv):
        return refused(pretrain, argv, monkeypatch, capsys)

    message = error("--train_file", corpus, "--output_dir", tmp_path, *TINY, "--block_size", "600")
    assert "--block_size 600" in message and "max_position_embeddings=512" in message
    message = error("--train_file", corpus, "--output_dir", tmp_path, "--min_bigram_count", "often")
    assert "expected a positive integer or 'auto', got 'often'" in message
    preset = tmp_path / "often.json"
    preset.write_text(json.dumps({"training": {"min_bigram_count": "often"}}))
    message = error("--config", preset, "--train_file", corpus, "--output_dir", tmp_path)
    assert "--min_bigram_count must be a positive integer or 'auto', got 'often'" in message
    message = error("--config", "no-such-preset", "--output_dir", tmp_path)
    assert "unknown preset 'no-such-preset'" in message
    for name in ("brillm-en", "brillm-zh", "demo"):
        assert name in message


def test_error_through_accelerate_launch(tmp_path):
    result = run(["--config", "no-such-preset", "--output_dir", tmp_path], launcher=CPU1, check=False)
    assert result.returncode != 0
    assert "error: unknown preset 'no-such-preset'" in result.stderr


def test_cpu_launcher_with_several_processes_is_refused(corpus, tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process (several need mpirun): say so, do not
    silently train with half the global batch."""
    cmd = [str(ACCELERATE), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", str(SCRIPT), "--train_file", str(corpus), "--output_dir", str(tmp_path),
           *TINY]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert result.returncode != 0
    assert "started ONE process" in result.stderr and "cpu_2.yaml" in result.stderr


# FSDP under cpu_2_fsdp.yaml (the script shards the model on the CPU): tests/training/test_fsdp.py


def test_launch_device_follows_the_launch_config(monkeypatch):
    """cpu_2.yaml trains on the CPU wherever it runs (it hides the GPUs from its processes); a GPU launch with
    more processes than visible GPUs is refused up front (counts faked: this machine may have none)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from modeling_brillm.training.launch import launch_on_cpu

    for key in ("ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    args = launch_command_parser().parse_args(["--config_file", str(CPU2), "--main_process_port", "0", str(SCRIPT)])
    args, _, _ = _validate_launch_command(args)
    launched = prepare_multi_gpu_env(args)  # the environment accelerate's torchrun launcher gives the processes
    assert args.multi_gpu and args.num_processes == 2
    seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=launched,
                          capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == "0", seen.stderr  # no GPU visible to them, whatever this machine has
    assert launch_on_cpu({**launched, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, gpus=0)

    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert launch_on_cpu({**two, "ACCELERATE_USE_CPU": "true"}, gpus=8)  # --cpu / ACCELERATE_USE_CPU=1 as well
    assert not launch_on_cpu(two, gpus=2)
    assert not launch_on_cpu({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, gpus=8)  # two machines of 8
    with pytest.raises(UsageError, match=r"starts 2 processes on this machine, but only 1 GPU is visible: launch at "
                                         r"most 1 process \(--num_processes 1\), or train on the CPU .*cpu_2.yaml"):
        launch_on_cpu(two, gpus=1)
    with pytest.raises(UsageError, match="starts 8 processes on this machine, but no GPU is visible: train on the CPU"):
        launch_on_cpu({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, gpus=0)


@pytest.mark.slow
def test_gpu_config_with_more_processes_than_gpus_is_refused_before_any_work(tmp_path):
    """A GPU launch config (cpu_2.yaml without its GPU hiding) with one process more than this machine's GPUs:
    one clear error line from the processes, nothing written."""
    import torch

    processes = max(2, torch.cuda.device_count() + 1)
    config = tmp_path / "gpus.yaml"
    config.write_text(CPU2.read_text().replace('gpu_ids: "-1,-1"', "gpu_ids: all")
                      .replace("use_cpu: true", "use_cpu: false")
                      .replace("num_processes: 2", f"num_processes: {processes}"))
    assert "gpu_ids: all" in config.read_text()
    result = run(["--output_dir", tmp_path / "out"], launcher=config, check=False, timeout=180)
    assert result.returncode != 0
    assert (f"error: this launch asks for GPUs, one per process, and starts {processes} processes on this machine"
            in result.stderr), result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------- memory
def test_memory_guard_refuses_dense_graph_on_small_ram(corpus, tmp_path):
    result = run(["--train_file", corpus, "--output_dir", tmp_path, "--config", "brillm-en", "--vocab_size", "300",
                  "--dense_graph", "--num_generations", "0"], check=False, **{memory.MEMORY_ENV: "0.05"})
    message = error_of(result)
    assert "refusing to build the model" in message and "dense graph" in message
    assert "--min_bigram_count" in message and "FSDP" in message
    assert not (tmp_path / "model.safetensors").exists()


def fake_accelerator(processes=1, dist="NO", mixed="no"):
    import torch
    from accelerate.utils import DistributedType

    return SimpleNamespace(num_processes=processes, distributed_type=DistributedType(dist), mixed_precision=mixed,
                           device=torch.device("cpu"), gather=lambda t: t)


def test_memory_estimate_of_the_paper_models():
    from modeling_brillm import BriLLMConfig

    dense = BriLLMConfig(vocab_size=4000, node_size=32, graph="dense")
    assert dense.num_parameters_formula() == pytest.approx(16.90e9, rel=1e-3)
    args = SimpleNamespace(available_memory_gb=None)
    # 16.9B parameters x 16 bytes is ~270 GB: refused on this machine whatever its RAM
    with pytest.raises(UsageError, match="refusing to build the model.*dense graph"):
        memory.check_memory(dense, fake_accelerator(), args)
    # the paper's sparse English graph (0.96B parameters) fits a 80 GB GPU under DDP, not a 4 GB machine
    sparse = BriLLMConfig(vocab_size=4000, node_size=32, graph="sparse", num_edges=900_000)
    assert sparse.num_parameters_formula() == pytest.approx(0.95e9, rel=0.02)
    line = memory.check_memory(sparse, fake_accelerator(), SimpleNamespace(available_memory_gb=80))
    assert "training memory estimate" in line
    with pytest.raises(UsageError, match="sparse .*real edges"):
        memory.check_memory(sparse, fake_accelerator(), SimpleNamespace(available_memory_gb=4))
    # FSDP over 8 GPUs: the shard shrinks, the gathered bf16 parameters and gradients do not
    fsdp = memory.training_memory(dense.num_parameters_formula(), "fsdp", 8, "bf16")
    assert fsdp["total"] / 2 ** 30 == pytest.approx((16 / 8 + 4) * 16.9e9 * 1.1 / 2 ** 30, rel=0.01)
    single = memory.training_memory(1000, "single")
    assert single["total"] == pytest.approx(16 * 1000 * 1.1)


# ------------------------------------------------------------------------------------------ data helpers
def test_presets_load_and_flags_override():
    for name in presets.known_presets():
        preset = presets.load_preset(name)
        assert set(preset) == {"model", "tokenizer", "training"}
    args = pretrain.parse_args(["--config", "brillm-zh", "--node_size", "8", "--learning_rate", "0.01",
                                "--dense_graph"])
    choice = presets.resolve_settings(args)
    model, tok = choice.section("model"), choice.section("tokenizer")
    assert tok == {"kind": "char", "vocab_size": 4000, "min_frequency": 1}
    assert model["node_size"] == 8 and model["graph"] == "dense"
    assert args.learning_rate == 0.01 and args.block_size == 32 and args.max_train_steps == 1500
    args = pretrain.parse_args([])
    model = presets.resolve_settings(args).section("model")
    assert args.learning_rate == 2e-2 and args.block_mode == "sentence" and args.per_device_train_batch_size == 32
    assert model["node_readout"] and model["node_embedding"] and model["count_prior"]
    assert not model["non_edge_bias"] and not model["edge_backoff"]
    assert model["position_recency"] == 0.2
    assert model["signal_dropout"] == "auto"  # chosen from the data and the run's length
    assert not any(presets.resolve_settings(pretrain.parse_args(["--config", "brillm-en"])).value("model", k)
                   for k in ("non_edge_bias", "node_readout", "position_recency", "signal_dropout", "count_prior"))
    assert presets.resolve_settings(pretrain.parse_args(["--signal_dropout", "0.2"])).value("model", "signal_dropout") \
        == 0.2
    for bad in ("1", "-0.1", "some"):
        with pytest.raises(SystemExit):
            pretrain.parse_args(["--signal_dropout", bad])
    for bad in ("0", "-0.01", "inf", "fast", "auto"):
        with pytest.raises(SystemExit):
            pretrain.parse_args(["--learning_rate", bad])


@pytest.mark.parametrize("flags,off", [
    (["--loss", "sampled"], {"non_edge_bias", "node_readout", "count_prior"}),  # its negatives do not score all
    (["--edge_sharding", "source"], {"non_edge_bias"}),  # the sharded trainer trains the whole recipe
    (["--dense_graph"], {"non_edge_bias", "count_prior"}),  # the prior is built with a sparse graph's bigrams
    (["--loss", "sampled", "--non_edge_bias"], {"node_readout", "count_prior"}),  # a flag stays (the config refuses)
    (["--no-count_prior"], {"non_edge_bias", "count_prior"}),
])
def test_defaults_that_a_setup_cannot_train_give_way(flags, off):
    model = presets.resolve_settings(pretrain.parse_args(flags)).section("model")
    assert {k for k in ("non_edge_bias", "node_readout", "count_prior") if not model[k]} == off


def test_sentence_splitting_and_blocks():
    text = ("First sentence here. Second one, wrapped\nover two lines! Third?\n\n   code_line(1)\n   code_line(2)\n\n"
            "中文句子。第二句！")
    assert data.split_sentences(text) == [
        "First sentence here.", "Second one, wrapped over two lines!", "Third?", "code_line(1)", "code_line(2)",
        "中文句子。", "第二句！"]

    class Tok:  # one token per character
        bos_token_id, eos_token_id, pad_token_id = 2, 3, 0

        def __call__(self, texts, add_special_tokens=False, verbose=False):
            return {"input_ids": [[10 + (ord(c) % 50) for c in t] for t in texts]}

    blocks = data.SentenceBlocks(Tok(), "text", 8)({"text": ["Hi. A long sentence.", "x"]})
    ids, mask = blocks["input_ids"], blocks["attention_mask"]
    assert len(ids) == 2  # "x" has one token: dropped
    # "Hi." -> <s> H i . </s> <pad> x 3
    assert ids[0][0] == 2 and ids[0][4] == 3 and ids[0][5:] == [0] * 3 and mask[0] == [1] * 5 + [0] * 3
    assert ids[1][0] == 2 and 3 not in ids[1] and mask[1] == [1] * 8  # truncated to the block
    batch = data.collate([{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)])
    assert batch["labels"][0].tolist() == ids[0][:5] + [-100] * 3  # padding is never a target
    assert int(data.count_targets(batch)) == 4 + 7


def test_count_targets_matches_the_model_loss():
    import torch

    from modeling_brillm import BriLLMForCausalLM

    torch.manual_seed(0)
    seqs = [torch.tensor([2, 5, 6, 7, 3]), torch.tensor([2, 6, 5, 3]), torch.tensor([2, 7, 3])]
    model = BriLLMForCausalLM.from_token_sequences(seqs, 10, node_size=4, pad_token_id=0)
    rows = [{"input_ids": s.tolist() + [0] * (6 - len(s)), "attention_mask": [1] * len(s) + [0] * (6 - len(s))}
            for s in seqs]
    batch = data.collate(rows)
    with torch.no_grad():
        loss = model(**batch, return_logits=False).loss
        singles = [model(input_ids=s[None], labels=s[None], return_logits=False).loss * (len(s) - 1) for s in seqs]
    assert int(data.count_targets(batch)) == sum(len(s) - 1 for s in seqs)
    assert float(loss * data.count_targets(batch)) == pytest.approx(float(sum(singles)), rel=1e-5)


def test_validation_split_is_deterministic_and_spread():
    held = data.held_out_indices(100, 5)
    assert len(held) == 5 and held == [19, 39, 59, 79, 99]
    assert data.held_out_indices(10, 0) == []
    assert len(data.held_out_indices(1000, 12.5)) == 125


def test_embedded_corpus_exists_offline():
    texts = data.embedded_corpus()
    assert len(texts) > 1000 and sum(map(len, texts)) > 300_000
    assert not any(set(line.strip()) <= set("=*-~^#") and len(line.strip()) > 3
                   for t in texts for line in t.splitlines())


def test_doc_cleaning_drops_every_kind_of_markup_line_and_keeps_the_text():
    """What the pydoc_data of some Python version may hold (this one may lack some): section overlines and
    underlines in any reST adornment character, mixed rules, traceback markers; tables and code stay."""
    text = ("=========\nOverview\n=========\n\nThe *assert* statement\n**********************\n\n"
            "Notes\n\"\"\"\"\"\n  !!!!!!!!  \n\n=-=-=-=-\n\n"
            "   >>> print(1 / 0)\n   Traceback (most recent call last):\n       print(1 / 0)\n             ~~^~~\n"
            "   ZeroDivisionError: division by zero\n\n"
            "+-------+-------+\n| a     | b     |\n+=======+=======+\n\n"
            "   x = [1, 2]\n   ^\n   ...\n\n~~~~\n\n")
    assert data.doc_paragraphs(text) == [
        "Overview", "The *assert* statement", "Notes",
        "   >>> print(1 / 0)\n   Traceback (most recent call last):\n       print(1 / 0)\n"
        "   ZeroDivisionError: division by zero",
        "+-------+-------+\n| a     | b     |\n+=======+=======+",
        "   x = [1, 2]\n   ^\n   ...",
    ]


# ------------------------------------------------------------------------------------------ time budget
@pytest.mark.slow
def test_time_budget_stops_logs_the_clock_and_resumes_exactly(corpus, tmp_path):
    """--max_train_time: the run plans its epochs from timed steps, evaluates whenever the training clock passes an
    --eval_seconds point (logging the clock and the tokens), stops once the clock passes the budget; a resume from
    a checkpoint restores the clock and the planned epochs and trains the same steps (a constant schedule: the lr
    does not depend on the pace)."""
    budget = ["--max_train_time", "2.5", "--eval_seconds", "0.5", "1.5", "--checkpointing_steps", "3",
              "--lr_scheduler_type", "constant_with_warmup", "--per_device_train_batch_size", "32"]
    flags = ["--train_file", corpus, *TINY[:-2], *budget]  # no --eval_steps: the clock points alone
    out = tmp_path / "budget"
    result = run([*flags, "--output_dir", out])
    assert re.search(r"--max_train_time 2\.5s: [0-9.]+s per step .* plans [0-9.]+ epoch\(s\)", result.stdout)
    log = checkpoints.read_log(out / checkpoints.LOG_NAME)
    steps = [r for r in log if "loss" in r]
    evals = [r for r in log if "eval_loss" in r]
    last = steps[-1]
    assert last["train_seconds"] >= 2.5 and steps[-2]["train_seconds"] < 2.5  # stopped once the clock passed it
    clocks = [r["train_seconds"] for r in evals]
    assert clocks[0] == 0 and clocks[-1] == last["train_seconds"] and len(evals) == 4, clocks
    assert clocks[1] >= 0.5 > steps[evals[1]["step"] - 2]["train_seconds"]  # at the first step past 0.5 s
    assert clocks[2] >= 1.5 and all(r["eval_tokens"] == evals[0]["eval_tokens"] for r in evals)
    tokens = {r["step"]: r["train_tokens"] for r in evals}
    assert 0 < tokens[evals[1]["step"]] < tokens[evals[2]["step"]] < tokens[last["step"]]
    state = checkpoints.read_train_state(out / "step_3")
    assert state["train_seconds"] > 0 and state["train_tokens"] > 0 and state["planned_epochs"] > 0

    resumed = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(out), str(resumed)], check=True)
    result = run([*flags, "--output_dir", resumed, "--resume_from_checkpoint", resumed / "step_3"])
    assert f"training clock {state['train_seconds']:.1f}s" in result.stdout
    assert f"{state['planned_epochs']:.2f} epoch(s) planned" in result.stdout  # the checkpoint's plan, not a new timing
    assert "s per step" not in result.stdout
    again = {r["step"]: r for r in checkpoints.read_log(resumed / checkpoints.LOG_NAME) if "loss" in r}
    assert min(again) == 1 and again[4]["train_seconds"] > state["train_seconds"]
    assert max(again[s]["train_seconds"] for s in again) >= 2.5  # the budget is the whole run's, clock restored
    for r in steps:
        if r["step"] in again:
            assert again[r["step"]]["loss"] == pytest.approx(r["loss"], abs=1e-6, rel=0), r["step"]


def test_time_budget_flags_are_checked(corpus, tmp_path, monkeypatch, capsys):
    for flags, message in ((["--max_train_time", "0"], "--max_train_time must be a positive number"),
                           (["--eval_seconds", "1", "-2"], "--eval_seconds must be positive"),
                           (["--max_train_time", "5", "--lr_scheduler_type", "inverse_sqrt"], "no end to follow")):
        assert pretrain.main(["--train_file", str(corpus), "--output_dir", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
