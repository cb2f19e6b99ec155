"""Fine-tuning: completion-only data and what examples/finetune.py runs
(training/finetuning.py) on a tiny saved model, in-process: every --train_only mode trains what it says and leaves
the rest bit for bit unchanged; bad input gets a one-line error."""

import copy
import json

import pytest
import torch

from modeling_brillm import BriLLMForCausalLM
from modeling_brillm.training.finetuning import (
    SFTDataError,
    builtin_pairs,
    check_records,
    collate_sft,
    load_records,
    split_records,
    tokenize_records,
)
from tests._tiny import BOS, EOS, PAD, save_tiny

PAIRS = [  # continuations the tiny model was not trained on (its corpus says "the cat sat on the mat")
    {"prompt": "the cat", "completion": " is a bird"},
    {"prompt": "the dog", "completion": " is a cat"},
    {"prompt": "a cat", "completion": " likes a tree"},
    {"prompt": "a bird", "completion": " walks on a log"},
    {"prompt": "my cat", "completion": " sang"},
    {"prompt": "your dog", "completion": " is small"},
]


@pytest.fixture(scope="module")
def finetune():
    from modeling_brillm.training import finetuning

    return finetuning


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny saved model, its tokenizer, and a prompt/completion file."""
    root = tmp_path_factory.mktemp("finetune")
    model, tokenizer = save_tiny(root / "base")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root, model, tokenizer, data


def run_script(finetune, tiny, out, *extra):
    root, _, _, data = tiny
    args = ["--model_name_or_path", str(root / "base"), "--train_file", str(data), "--validation_file", str(data),
            "--output_dir", str(out), "--max_train_steps", "6", "--per_device_train_batch_size", "3",
            "--logging_steps", "100", *map(str, extra)]
    return finetune.main(args)


# ------------------------------------------------------------------------------------------------- data
def test_completion_only_labels_and_exact_boundary(tiny):
    _, _, tok, _ = tiny
    rows, dropped = tokenize_records(PAIRS[:2] + [{"text": "a dog"}], tok, max_length=64)
    assert dropped == 0
    first = rows[0]
    prompt = tok("the cat")["input_ids"]
    completion = tok(" is a bird", add_special_tokens=False)["input_ids"]
    assert first["input_ids"] == prompt + completion + [EOS] and prompt[0] == BOS
    assert first["labels"] == [-100] * len(prompt) + completion + [EOS]
    text = rows[2]
    assert text["labels"] == text["input_ids"] == tok("a dog")["input_ids"] + [EOS]
    batch = collate_sft(rows, PAD, with_signal_ids=True)
    n = len(text["input_ids"])
    assert batch["attention_mask"][2].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert (batch["labels"][2, n:] == -100).all() and batch["signal_ids"].tolist() == [0, 0, 0]


def test_truncation_drops_rows_without_a_completion(tiny):
    _, _, tok, _ = tiny
    rows, dropped = tokenize_records([{"prompt": "the cat sat", "completion": " on"}], tok, max_length=4)
    assert rows == [] and dropped == 1


def test_loss_is_on_the_completion_only(tiny, device):
    _, model, tok, _ = tiny
    model = copy.deepcopy(model).to(device)  # the saved base stays as it is for the script tests
    batch = collate_sft(tokenize_records(PAIRS[:3], tok, 64)[0], PAD)
    with torch.no_grad():
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    targets = batch["labels"][:, 1:]
    logits = out.logits.cpu()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss.cpu(), nll, atol=1e-5)
    full = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
    assert not torch.allclose(out.loss, full)  # the prompt really is left out


def test_builtin_pairs_are_deterministic():
    pairs = builtin_pairs()
    assert len(pairs) >= 100 and pairs == builtin_pairs()
    assert all(p["prompt"].startswith("Topic: ") and p["completion"].startswith(" ") for p in pairs)
    train, val = split_records(pairs, 20)
    assert len(val) == len(pairs) // 5 and len(train) + len(val) == len(pairs)


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n', "record 1 has no 'completion' field"),
    ('{"prompt": "a", "completion": "b"}\n{"completion": "b"}\n', "record 2 has no 'prompt' field"),
    ("", "holds no records"),
    ('{"question": "a"}\n', "neither 'prompt'/'completion' nor 'text'"),
    ('{"prompt": "a", "completion": 3}\n', "'completion' must be a string"),
    ('{"prompt": "a", "completion": "b", "signal_id": -1}\n', "signal_id must be a non-negative integer"),
    ("{oops\n", "line 1: not valid JSON"),
])
def test_bad_records(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(SFTDataError, match=message):
        load_records(path)


def test_text_files_and_unknown_extensions(tmp_path):
    (tmp_path / "a.txt").write_text("one text\n\nanother\n")
    assert load_records(tmp_path / "a.txt") == [{"text": "one text"}, {"text": "another"}]
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(SFTDataError, match="unknown file extension"):
        load_records(tmp_path / "a.csv")
    assert check_records([{"prompt": "a", "completion": "b"}]) == [{"prompt": "a", "completion": "b"}]


# ----------------------------------------------------------------------------------------------- script
def load(path):
    return BriLLMForCausalLM.from_pretrained(path)


def test_train_all_lowers_the_completion_loss(finetune, tiny, tmp_path):
    root = tiny[0]
    assert run_script(finetune, tiny, tmp_path / "out", "--train_only", "all", "--learning_rate", "0.05") == 0
    results = json.loads((tmp_path / "out" / "finetune_results.json").read_text())
    assert results["after"]["loss"] < results["before"]["loss"]
    assert results["trainable_parameters"] == results["total_parameters"] == load(root / "base").num_parameters()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "completion_perplexity" in card and "fine-tuned" in card
    assert (tmp_path / "out" / "tokenizer.json").is_file() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("mode, trained", [("node_bias", "node_bias"), ("start_signal", "start_signals")])
def test_frozen_parameters_are_unchanged(finetune, tiny, tmp_path, mode, trained):
    root = tiny[0]
    assert run_script(finetune, tiny, tmp_path / mode, "--train_only", mode) == 0
    before, after = load(root / "base"), load(tmp_path / mode)
    results = json.loads((tmp_path / mode / "finetune_results.json").read_text())
    assert results["trainable_parameters"] == getattr(after.base_model, trained).numel()
    assert results["after"]["loss"] < results["before"]["loss"]
    if mode == "start_signal":
        assert after.config.start_signal == "learned" and before.base_model.start_signals is None
        signals = after.base_model.start_signals
        assert not torch.equal(signals, torch.full_like(signals, 1 / 8))
    else:
        assert not torch.equal(after.base_model.node_bias, before.base_model.node_bias)
    for name, value in before.state_dict().items():
        if name.split(".")[-1] != trained:
            assert torch.equal(value, after.state_dict()[name]), name


@pytest.mark.parametrize("optimizer", ["adamw", "sparse_adamw"])
def test_touched_edges_moves_only_the_datas_edges(finetune, tiny, tmp_path, optimizer):
    root, _, tok, _ = tiny
    out = tmp_path / optimizer
    assert run_script(finetune, tiny, out, "--train_only", "touched_edges", "--optimizer", optimizer) == 0
    before, after = load(root / "base"), load(out)
    rows, _ = tokenize_records(PAIRS, tok, 64)
    touched = finetune.touched_edge_rows(before, rows)
    mask = torch.zeros(before.base_model.weights.shape[0], dtype=torch.bool)
    mask[touched] = True
    assert 0 < touched.numel() < before.config.num_edges and not mask[0]
    for name in ("weights", "biases"):
        old, new = getattr(before.base_model, name), getattr(after.base_model, name)
        assert torch.equal(old[~mask], new[~mask]), name  # untouched rows, the shared edge included: bit for bit
        assert not torch.equal(old[mask], new[mask])
    for name in ("node_bias", "positions"):
        assert torch.equal(getattr(before.base_model, name), getattr(after.base_model, name))
    results = json.loads((out / "finetune_results.json").read_text())
    assert results["trainable_parameters"] == touched.numel() * (8 * 8 + 8)
    assert results["after"]["loss"] < results["before"]["loss"]


def test_signal_id_trains_its_own_signal(finetune, tiny, tmp_path):
    out = tmp_path / "task2"
    assert run_script(finetune, tiny, out, "--train_only", "start_signal", "--signal_id", "2") == 0
    after = load(out)
    assert after.config.num_start_signals == 3
    signals = after.base_model.start_signals
    assert torch.equal(signals[:2], torch.full((2, 8), 1 / 8))  # the other tasks' signals untouched
    assert not torch.equal(signals[2], torch.full((8,), 1 / 8))
    assert json.loads((out / "finetune_results.json").read_text())["signal_id"] == 2


def test_bad_input_gets_one_line_errors(finetune, tiny, tmp_path, capsys):
    assert run_script(finetune, tiny, tmp_path / "x", "--train_only", "everything") == 2
    assert "--train_only 'everything' is unknown: choose one of all, touched_edges" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the cat"}\n')
    root = tiny[0]
    code = finetune.main(["--model_name_or_path", str(root / "base"), "--train_file", str(bad),
                          "--output_dir", str(tmp_path / "y")])
    err = capsys.readouterr().err
    assert code == 2 and "has no 'completion' field" in err and "Traceback" not in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert finetune.main(["--model_name_or_path", str(root / "base"), "--train_file", str(empty),
                          "--output_dir", str(tmp_path / "z")]) == 2
    assert "holds no records" in capsys.readouterr().err
    assert finetune.main(["--model_name_or_path", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "w")]) == 2
    assert "not a BriLLM model folder" in capsys.readouterr().err
