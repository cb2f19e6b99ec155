"""The clients of tests/integration/test_clients.py, each run in a fresh process on a saved tiny folder loaded as
remote code:

    python tests/_clients.py {trainer,trainer_checkpointing,sft,lm_eval} FOLDER WORKDIR

The model is loaded while `modeling_brillm` cannot be imported (as a Hub user meets it); the BriLLMSFTTrainer run
imports `modeling_brillm.training` afterwards, the way a user who installed the package does. Asserts inside, then
prints one line `RESULT {json}`.
"""

import json
import math
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "modeling_brillm" or name.startswith("modeling_brillm."):
            raise ImportError("modeling_brillm is hidden while the model loads as remote code")


BLOCK = _Block()
sys.meta_path.insert(0, BLOCK)

import torch  # noqa: E402  (after the block above, on purpose)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

LINES = ["the cat sat on the mat", "the dog sat on the log", "a cat saw a dog", "the dog saw the cat on the mat",
         "a bird sang in the tree"]
PROMPTS = [("the cat", " sat on the mat"), ("the dog", " sat on the log"), ("a cat", " saw a dog"),
           ("a bird", " sang in the tree"), ("my cat", " likes the warm mat"), ("your dog", " likes a long walk")]


def load(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def trainer(folder, work, gradient_checkpointing=False):
    """transformers' Trainer: a few steps, the loss falls, the saved folder reloads with the same logits."""
    from transformers import Trainer, TrainingArguments

    model, tokenizer = load(folder)
    rows = [{"input_ids": tokenizer(line + tokenizer.eos_token)["input_ids"]} for line in LINES]
    batch = collate(rows)
    with torch.no_grad():
        before = model(**batch).loss.item()
    args = TrainingArguments(output_dir=f"{work}/out", max_steps=8, per_device_train_batch_size=5, learning_rate=0.05,
                             logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                             gradient_checkpointing=gradient_checkpointing)
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
    model.eval()
    model.save_pretrained(f"{work}/saved")
    again = AutoModelForCausalLM.from_pretrained(f"{work}/saved", trust_remote_code=True)
    with torch.no_grad():
        out, reloaded = model(**batch), again(**batch)
    assert out.loss.item() < before, (before, out.loss.item())
    assert torch.equal(out.logits, reloaded.logits)
    return {"before": before, "after": out.loss.item()}


def trainer_checkpointing(folder, work):
    return trainer(folder, work, gradient_checkpointing=True)


def sft(folder, work):
    """TRL through BriLLMSFTTrainer on prompt/completion records: a few steps, TRL's metrics logged and finite."""
    from datasets import Dataset
    from trl import SFTConfig

    model, tokenizer = load(folder)
    sys.meta_path.remove(BLOCK)
    from modeling_brillm.training import BriLLMSFTTrainer

    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PROMPTS])
    # TRL's defaults, gradient checkpointing (on) included
    args = SFTConfig(output_dir=f"{work}/sft", max_steps=6, per_device_train_batch_size=6, learning_rate=0.01,
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0)
    trainer = BriLLMSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    assert "forward" not in vars(model)  # TRL's fused (linear) LM head is taken off again
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 6, logs
    for entry in logs:
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert math.isfinite(entry[key]), (key, entry)
        assert 0 <= entry["mean_token_accuracy"] <= 1 and 0 <= entry["entropy"] <= math.log(len(tokenizer)), entry
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    return {"logs": logs}


def lm_eval(folder, work):
    """lm-evaluation-harness's HFLM on requests built here: loglikelihood, loglikelihood_rolling, generate_until."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load(folder)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2)

    def requests(kind, args):
        return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]

    pairs = [("the cat sat on the", " mat"), ("the cat sat on the", " log"), ("a bird sang in the", " tree")]
    scores = lm.loglikelihood(requests("loglikelihood", pairs))
    with torch.no_grad():  # the first pair by hand: the sum of the continuation's log-probabilities
        ids = tokenizer(pairs[0][0] + pairs[0][1])["input_ids"]
        n_context = len(tokenizer(pairs[0][0])["input_ids"])
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        expected = sum(logp[t - 1, ids[t]].item() for t in range(n_context, len(ids)))
    assert abs(scores[0][0] - expected) < 1e-4, (scores[0], expected)
    assert scores[0][0] > scores[1][0]  # "mat" after "on the" is the corpus's; "log" is not after "cat"
    rolling = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(line,) for line in LINES[:2]]))
    texts = lm.generate_until(requests("generate_until", [("the cat", {"until": ["\n"], "max_gen_toks": 8,
                                                                       "do_sample": False})] * 2))
    assert all(math.isfinite(s) and s < 0 for s, _ in scores) and all(math.isfinite(r) and r < 0 for r in rolling)
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0], texts
    # what `lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True` builds: the same scores
    by_path = HFLM(pretrained=folder, trust_remote_code=True, batch_size=2, device="cpu")
    assert type(by_path.model).__module__.startswith("transformers_modules")
    assert by_path.max_length == model.config.max_position_embeddings
    again = by_path.loglikelihood(requests("loglikelihood", pairs))
    assert all(abs(a[0] - b[0]) < 1e-4 and a[1] == b[1] for a, b in zip(scores, again)), (scores, again)
    return {"loglikelihood": scores, "rolling": rolling, "generated": texts}


if __name__ == "__main__":
    client, folder, work = sys.argv[1:4]
    print("RESULT " + json.dumps(globals()[client](folder, work)))
