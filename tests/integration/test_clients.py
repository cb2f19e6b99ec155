"""The Hugging Face ecosystem's clients on a tiny saved BriLLM loaded as remote code (`trust_remote_code=True`), each in
a fresh process that cannot import this package while the model loads (tests/_clients.py): transformers' `Trainer`,
TRL through `BriLLMSFTTrainer`, and lm-evaluation-harness's `HFLM`. Offline: the requests are built here, nothing is
downloaded. The loss and metrics of BriLLMSFTTrainer are checked by hand in this process."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from _tiny import CORPUS, save_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clients") / "tiny"
    save_tiny(folder)
    return folder


def load(folder):
    return (AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True),
            AutoTokenizer.from_pretrained(folder, trust_remote_code=True))


def run_client(client, folder, work):
    """tests/_clients.py CLIENT in a fresh process (this checkout first on its path, the Hub offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_", "BRILLM_"))}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_clients.py"), client, str(folder), str(work)],
                          cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_trainer_trains_saves_and_reloads(tmp_path, tiny_folder):
    result = run_client("trainer", tiny_folder, tmp_path)
    assert result["after"] < result["before"]


def test_trainer_with_gradient_checkpointing(tmp_path, tiny_folder):
    result = run_client("trainer_checkpointing", tiny_folder, tmp_path)
    assert result["after"] < result["before"]


def test_trl_sft_trainer_on_prompt_completion(tmp_path, tiny_folder):
    pytest.importorskip("trl")
    logs = run_client("sft", tiny_folder, tmp_path)["logs"]
    assert len(logs) == 6 and logs[-1]["loss"] < logs[0]["loss"]


def test_lm_eval_harness_hflm(tmp_path, tiny_folder):
    pytest.importorskip("lm_eval")
    result = run_client("lm_eval", tiny_folder, tmp_path)
    assert len(result["loglikelihood"]) == 3 and len(result["rolling"]) == 2


PROMPTS = [("the cat", " sat on the mat"), ("the dog", " sat on the log"), ("a cat", " saw a dog")]


def test_sft_loss_and_metrics_are_brillms_on_the_completion(tmp_path, tiny_folder):
    """One batch by hand: the loss is BriLLM's own loss on the completion tokens, and the metrics are its logits'."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig

    from modeling_brillm.training import BriLLMSFTTrainer

    model, tokenizer = load(tiny_folder)
    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PROMPTS])
    args = SFTConfig(output_dir=str(tmp_path / "sft"), report_to="none", use_cpu=True, bf16=False,
                     gradient_checkpointing=False)
    trainer = BriLLMSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    labels = batch["labels"]
    for row, (prompt, _) in enumerate(PROMPTS):
        n_prompt = len(tokenizer(prompt)["input_ids"])
        assert (labels[row, :n_prompt] == -100).all() and (labels[row, n_prompt:] != -100).any()
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    torch.testing.assert_close(loss.detach(), out.loss)
    scored = labels[:, 1:] != -100
    logits, targets = out.logits[:, :-1][scored], labels[:, 1:][scored]
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean().item()
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx(entropy, rel=1e-5)
    assert trainer._metrics["train"]["mean_token_accuracy"][-1] == pytest.approx(accuracy)
    # num_items_in_batch (gradient accumulation): the sum over the batch's tokens divided by the count given
    halved = trainer.compute_loss(model, dict(batch), num_items_in_batch=2 * int(scored.sum()))
    torch.testing.assert_close(halved.detach(), out.loss / 2)


def test_sft_refuses_packing(tmp_path, tiny_folder):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig

    from modeling_brillm.training import BriLLMSFTTrainer

    model, tokenizer = load(tiny_folder)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), report_to="none", use_cpu=True, packing=True,
                     gradient_checkpointing=False)
    with pytest.raises(ValueError, match="packing"):
        BriLLMSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": CORPUS[0]}]),
                         processing_class=tokenizer)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if not add_generation_prompt %}</s>{% endif %}"


@pytest.mark.parametrize("layout", ["prompt_completion", "messages"])
def test_sft_on_conversational_records(tmp_path, tiny_folder, layout):
    """Conversational records (a chat template set): prompt/completion messages train on the completion only."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig

    from modeling_brillm.training import BriLLMSFTTrainer

    model, tokenizer = load(tiny_folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    if layout == "messages":
        records = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                   for p, c in PROMPTS]
    else:
        records = [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}]}
                   for p, c in PROMPTS]
    # the README's form (bf16=False, no use_cpu): it must run on a machine without a GPU
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=3, report_to="none",
                     bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no")
    trainer = BriLLMSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                               processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0][0]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)
    n_prompt = len(prompt["input_ids"])
    scored = batch["labels"][0] != -100
    if layout == "prompt_completion":
        assert not scored[:n_prompt].any() and scored[n_prompt:].any()
    else:
        assert scored.all() or scored[batch["attention_mask"][0] == 1].all()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) and math.isfinite(e["entropy"]) for e in logs)


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


# Until then transformers' Trainer also hands the accumulation steps to accelerate, which divides the loss by them once
# more after the model has divided by `num_items_in_batch`: every model that takes it (BriLLM, Llama, ...) gets half
# the gradient at 2 steps there.
TRAINER_SCALES_ONCE = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 23)


@pytest.mark.skipif(not TRAINER_SCALES_ONCE, reason="this transformers' Trainer scales accumulated losses twice")
def test_trainer_gradient_accumulation_matches_one_batch(tmp_path):
    from _tiny import make_model, make_tokenizer
    from transformers import Trainer, TrainingArguments

    tokenizer = make_tokenizer()
    rows = [{"input_ids": tokenizer(line + tokenizer.eos_token)["input_ids"]} for line in CORPUS[:4]]
    logged = []
    for accumulation, batch_size in ((1, 4), (2, 2)):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=batch_size,
                                 gradient_accumulation_steps=accumulation, learning_rate=0.0, report_to="none",
                                 save_strategy="no", use_cpu=True, max_grad_norm=1e9, logging_steps=1)
        trainer = Trainer(model=make_model(tokenizer), args=args, train_dataset=rows, data_collator=_collate)
        trainer.train()
        logged.append([(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e][0])
    # the same four rows in one batch or in two accumulated halves: the same loss and gradient (token-weighted)
    assert logged[1] == pytest.approx(logged[0], rel=0.05)
