"""Evaluation and interpretability: built-in perplexity, the `evaluate` perplexity metric's contract (offline), the
energy trace of a text and its plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _tiny import CORPUS, make_model, make_tokenizer, save_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_brillm import BriLLMForCausalLM
from modeling_brillm.evaluation import load_texts, per_text_perplexity, perplexity
from modeling_brillm.interpretability import EnergyTrace, energy_trace, plot_energy_path

ROOT = Path(__file__).resolve().parents[2]
TEXTS = CORPUS[:6] + ["the bird likes the long tree walk", "a"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer, device):
    return make_model(tokenizer).to(device)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_brillm_eval")
    save_tiny(directory)
    return directory


def manual_nll(model, sequences: list[torch.Tensor]) -> tuple[float, int]:
    """Sum of −log p(token | prefix) from the full logits (log-softmax over all V), and the token count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            logits = model(seq.unsqueeze(0)).logits[0, :-1].double().cpu()
            logp = torch.log_softmax(logits, -1).gather(1, seq[1:].unsqueeze(1))
            total -= float(logp.sum())
            count += seq.numel() - 1
    return total, count


# ----------------------------------------------------------------------------------- built-in perplexity
def test_builtin_perplexity_equals_exp_of_masked_cross_entropy(model, tokenizer):
    result = perplexity(model, tokenizer, TEXTS, batch_size=3)
    # manual: one padded batch, masked cross-entropy over every real next token
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(enc.input_ids, attention_mask=enc.attention_mask).logits.cpu()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).double(), enc.input_ids[:, 1:],
                                           reduction="none")
    mask = enc.attention_mask[:, 1:].double()
    expected = math.exp(float((ce * mask).sum() / mask.sum()))
    assert result.num_tokens == int(mask.sum())
    assert result.num_sequences == len(TEXTS)
    assert math.isclose(result.perplexity, expected, rel_tol=1e-5)
    # and per sequence, without any padding
    total, count = manual_nll(model, [torch.tensor(x) for x in tokenizer(TEXTS).input_ids])
    assert count == result.num_tokens and math.isclose(result.nll, total / count, rel_tol=1e-5)
    # batch size does not change it
    assert math.isclose(perplexity(model, tokenizer, TEXTS, batch_size=1).perplexity, result.perplexity, rel_tol=1e-5)


def test_builtin_perplexity_blocks_and_inputs(model, tokenizer, tmp_path):
    ids = [torch.tensor(x) for x in tokenizer(TEXTS).input_ids]
    by_text = perplexity(model, tokenizer, TEXTS)
    by_ids = perplexity(model, None, ids)
    assert math.isclose(by_text.perplexity, by_ids.perplexity, rel_tol=1e-6)
    # blocks of 8 tokens, each scored on its own
    blocked = perplexity(model, None, ids, block_size=8)
    blocks = [s[i:i + 8] for s in ids for i in range(0, s.numel(), 8)]
    total, count = manual_nll(model, [b for b in blocks if b.numel() >= 2])
    assert blocked.num_tokens == count and math.isclose(blocked.nll, total / count, rel_tol=1e-5)
    assert blocked.num_blocks == len([b for b in blocks if b.numel() >= 2])
    # a text file (one text per line, blank lines skipped), a datasets.Dataset, a 2-D tensor
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS[:3]) + "\n\n", encoding="utf-8")
    assert load_texts(str(path)) == TEXTS[:3]
    assert math.isclose(perplexity(model, tokenizer, str(path)).perplexity,
                        perplexity(model, tokenizer, TEXTS[:3]).perplexity, rel_tol=1e-6)
    import datasets

    ds = datasets.Dataset.from_dict({"text": TEXTS[:3]})
    assert math.isclose(perplexity(model, tokenizer, ds).perplexity,
                        perplexity(model, tokenizer, TEXTS[:3]).perplexity, rel_tol=1e-6)
    square = torch.stack([s[:5] for s in ids[:4]])
    assert perplexity(model, None, square).num_tokens == 16
    # with eos appended, one more token per text is scored
    with_eos = perplexity(model, tokenizer, TEXTS[:3], add_eos=True)
    assert with_eos.num_tokens == perplexity(model, tokenizer, TEXTS[:3]).num_tokens + 3


def test_builtin_perplexity_is_exact_for_sampled_loss_models(model, tokenizer):
    reference = perplexity(model, tokenizer, TEXTS)
    model.config.loss_type = "sampled"
    model.config.num_negatives = 3
    model.config.negative_sampling = "uniform"
    try:
        assert math.isclose(perplexity(model, tokenizer, TEXTS).perplexity, reference.perplexity, rel_tol=1e-6)
        assert model.config.loss_type == "sampled"  # restored
    finally:
        model.config.loss_type = "exact"


def test_builtin_perplexity_bad_input(model, tokenizer):
    with pytest.raises(ValueError, match="nothing to score"):
        perplexity(model, tokenizer, ["", "   "])
    with pytest.raises(ValueError, match="need a tokenizer"):
        perplexity(model, None, ["some text"])
    with pytest.raises(ValueError, match="block_size"):
        perplexity(model, tokenizer, TEXTS, block_size=model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        perplexity(model, None, [torch.tensor([2, 5, 999])])
    # texts longer than the model reads are split, not an error
    long = perplexity(model, tokenizer, [" ".join(CORPUS)])
    assert long.num_blocks > 1


# ---------------------------------------------------------------- the `evaluate` perplexity metric, offline
def metric_steps(model_id, predictions, batch_size=4, add_start_token=True, max_length=None):
    """The `evaluate` "perplexity" metric's computation, step by step (its script is downloaded from the Hub at run
    time, so it cannot run offline): plain AutoModelForCausalLM / AutoTokenizer loading without trust_remote_code,
    pad token from the special tokens when missing, padding, BOS column, shifted masked cross-entropy, exp."""
    model = AutoModelForCausalLM.from_pretrained(model_id)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None and batch_size > 1:
        existing = list(tokenizer.all_special_tokens)  # the script reads special_tokens_map_extended (removed in v5)
        assert existing
        tokenizer.add_special_tokens({"pad_token": existing[0]})
    if add_start_token and max_length:
        assert tokenizer.bos_token is not None
        max_tokenized_len = max_length - 1
    else:
        max_tokenized_len = max_length
    encodings = tokenizer(predictions, add_special_tokens=False, padding=True, truncation=bool(max_tokenized_len),
                          max_length=max_tokenized_len, return_tensors="pt", return_attention_mask=True)
    encoded_texts, attn_masks = encodings["input_ids"], encodings["attention_mask"]
    assert torch.all(attn_masks.sum(1) >= (1 if add_start_token else 2))
    ppls = []
    loss_fct = torch.nn.CrossEntropyLoss(reduction="none")
    for start in range(0, len(encoded_texts), batch_size):
        encoded_batch = encoded_texts[start:start + batch_size]
        attn_mask = attn_masks[start:start + batch_size]
        if add_start_token:
            bos = torch.tensor([[tokenizer.bos_token_id]] * encoded_batch.size(0))
            encoded_batch = torch.cat([bos, encoded_batch], dim=1)
            attn_mask = torch.cat([torch.ones(bos.size(), dtype=torch.int64), attn_mask], dim=1)
        labels = encoded_batch
        with torch.no_grad():
            out_logits = model(encoded_batch, attention_mask=attn_mask).logits
        shift_logits = out_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        shift_mask = attn_mask[..., 1:].contiguous()
        batch_ppl = torch.exp((loss_fct(shift_logits.transpose(1, 2), shift_labels) * shift_mask).sum(1)
                              / shift_mask.sum(1))
        ppls += batch_ppl.tolist()
    return {"perplexities": ppls, "mean_perplexity": sum(ppls) / len(ppls)}, model, tokenizer


def test_evaluate_metric_contract(saved):
    texts = TEXTS[:5] + ["a"]
    result, model, tokenizer = metric_steps(str(saved), texts, batch_size=4)
    # loaded without trust_remote_code: the installed package's class, registered by `import modeling_brillm`
    assert isinstance(model, BriLLMForCausalLM)
    assert tokenizer.pad_token == "<pad>" and tokenizer.padding_side == "right"
    assert len(result["perplexities"]) == len(texts) and all(math.isfinite(p) for p in result["perplexities"])
    # per text, the metric's perplexity is our built-in one (BOS prepended, every next token scored)
    for text, ppl in zip(texts, result["perplexities"]):
        assert math.isclose(ppl, perplexity(model, tokenizer, [text]).perplexity, rel_tol=1e-4)
    # and the in-process copy used by examples/perplexity.py when the Hub is out of reach gives the same numbers
    ours = per_text_perplexity(model, tokenizer, texts, batch_size=4)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours["perplexities"], result["perplexities"]))
    assert math.isclose(ours["mean_perplexity"], result["mean_perplexity"], rel_tol=1e-5)
    # with max_length (truncation) too
    cut, _, _ = metric_steps(str(saved), texts, batch_size=4, max_length=6)
    ours_cut = per_text_perplexity(model, tokenizer, texts, batch_size=4, max_length=6)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours_cut["perplexities"], cut["perplexities"]))


def test_metric_contract_without_pad_token(saved, model):
    tokenizer = AutoTokenizer.from_pretrained(str(saved))
    tokenizer.pad_token = None
    assert tokenizer.pad_token is None
    result = per_text_perplexity(model, tokenizer, TEXTS[:4], batch_size=4)
    assert tokenizer.pad_token is not None  # borrowed from the special tokens, as the metric does
    assert len(result["perplexities"]) == 4 and all(math.isfinite(p) for p in result["perplexities"])


def test_perplexity_example_falls_back_offline(saved, tmp_path, capsys, monkeypatch):
    import evaluate

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(evaluate, "load", offline)
    from modeling_brillm.training.perplexity_cli import main  # what examples/perplexity.py runs

    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS[:4]), encoding="utf-8")
    assert main(["--model", str(saved), "--texts", str(path), "--json", str(tmp_path / "p.json")]) == 0
    captured = capsys.readouterr()
    assert "could not be loaded" in captured.err and "in-process" in captured.out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["metric"]["source"] == "in-process" and data["built_in"]["num_tokens"] > 0
    assert main(["--model", str(saved), "--text", "   "]) == 2
    assert "no texts" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ energy trace
def test_energy_trace_agrees_with_logits(model, tokenizer):
    text = "the cat sat on the mat"
    trace = energy_trace(model, text, tokenizer, top_k=4)
    ids = torch.tensor(tokenizer(text).input_ids)
    assert isinstance(trace, EnergyTrace) and torch.equal(trace.tokens, ids) and len(trace) == ids.numel() - 1
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0, :-1].cpu()
    V = model.config.vocab_size
    for t, step in enumerate(trace.steps()):
        row = logits[t]
        assert step.source == int(ids[t]) and step.target == int(ids[t + 1])
        assert math.isclose(step.energy, float(row[ids[t + 1]]), rel_tol=1e-6, abs_tol=1e-6)
        assert step.rank == 1 + int((row > row[ids[t + 1]]).sum()) and 1 <= step.rank <= V
        assert math.isclose(step.probability, float(torch.softmax(row, -1)[ids[t + 1]]), rel_tol=1e-5)
        assert (step.predicted == int(row.argmax())
                and math.isclose(step.predicted_energy, float(row.max()), rel_tol=1e-6))
        others = row.clone()
        others[ids[t + 1]] = float("-inf")
        assert [e for _, e in step.alternatives] == pytest.approx(others.topk(4).values.tolist(), rel=1e-6)
        assert step.target not in [a for a, _ in step.alternatives]
        assert step.real_edge == bool(model.edge_rows(ids[t:t + 1], ids[t + 1:t + 2])[0] != 0)
        assert step.source_text == tokenizer.decode([step.source])
    # the trace's perplexity is the built-in one for this text
    assert math.isclose(trace.perplexity, perplexity(model, tokenizer, [text]).perplexity, rel_tol=1e-4)
    records = trace.to_records()
    assert json.loads(json.dumps(records)) == records and records[0]["target_text"] == "t"
    tensors = trace.to_dict()
    assert tensors["energies"].shape == (len(trace),) and tensors["alternative_tokens"].shape == (len(trace), 4)
    # ids work as well as text
    same = energy_trace(model, ids.tolist())
    assert torch.equal(same.ranks, trace.ranks) and same.token_texts is None


def test_energy_trace_bad_input(model, tokenizer):
    with pytest.raises(ValueError, match="at least two"):
        energy_trace(model, [2])
    with pytest.raises(ValueError, match="at least two"):
        energy_trace(model, "", tokenizer)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        energy_trace(model, [2, 999])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        energy_trace(model, [5] * (model.config.max_position_embeddings + 1))
    with pytest.raises(ValueError, match="tokenizer"):
        energy_trace(model, "the cat")


def test_plot_energy_path_png_and_svg(model, tokenizer, tmp_path):
    trace = energy_trace(model, "the cat sat", tokenizer)
    png = plot_energy_path(trace, tmp_path / "path.png")
    assert Path(png).stat().st_size > 1000
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = plot_energy_path(trace, tmp_path / "sub" / "path.svg", top_k=2)
    assert Path(svg).read_text(encoding="utf-8").lstrip().startswith(("<?xml", "<svg"))
    with pytest.raises(ValueError, match="extension"):
        plot_energy_path(trace, tmp_path / "noext")


def test_visualize_example(saved, tmp_path, capsys):
    from modeling_brillm.explorer.cli import main  # what examples/visualize.py runs

    out = tmp_path / "v.png"
    assert main(["--model", str(saved), "--text", "a dog saw the cat", "--output", str(out),
                 "--json", str(tmp_path / "v.json")]) == 0
    assert out.stat().st_size > 1000
    assert "perplexity" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "v.json").read_text())["steps"]) == len("a dog saw the cat")
    assert main(["--model", str(saved), "--text", "", "--output", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err == "error: the text is empty: give --text some words to trace\n"


# ----------------------------------------------------------------- past max_position_embeddings ("extend")

def long_ids(tokenizer, lines: int = 8) -> torch.Tensor:
    """<s> and several corpus lines joined by spaces: ~200 tokens, past the tiny model's 64 positions."""
    return torch.tensor(tokenizer(" ".join(CORPUS[:lines]))["input_ids"])


def test_builtin_perplexity_reads_past_the_range_only_with_extend(model, tokenizer, monkeypatch):
    seq = long_ids(tokenizer)
    M = model.config.max_position_embeddings
    assert seq.numel() > 2 * M
    with pytest.raises(ValueError, match=rf"block_size=100 is beyond max_position_embeddings={M}.*position_overflow"):
        perplexity(model, data=[seq], block_size=100)
    with pytest.raises(ValueError, match="block_size must be at least 2, got 0"):
        perplexity(model, data=[seq], block_size=0)
    monkeypatch.setattr(model.config, "position_overflow", "extend")
    whole = perplexity(model, data=[seq, seq[:10]], block_size=0)  # every text in one block
    assert (whole.num_blocks, whole.block_size, whole.num_tokens) == (2, seq.numel(), seq.numel() - 1 + 9)
    total, count = manual_nll(model, [seq, seq[:10]])
    assert count == whole.num_tokens and whole.nll == pytest.approx(total / count, rel=1e-5)
    longer = perplexity(model, data=[seq], block_size=M + 36)  # blocks longer than the range, cut as asked
    blocks = [b for b in seq.split(M + 36) if b.numel() >= 2]  # a 1-token tail block predicts nothing
    assert longer.num_blocks == len(blocks) >= 2 and longer.block_size == M + 36
    total, count = manual_nll(model, blocks)
    assert longer.nll == pytest.approx(total / count, rel=1e-5)
    default = perplexity(model, data=[seq])  # the default stays the trained range
    assert default.block_size == M and default.num_blocks == -(-seq.numel() // M)


def test_energy_trace_reads_past_the_range_only_with_extend(model, tokenizer, monkeypatch):
    seq = long_ids(tokenizer)
    with pytest.raises(ValueError, match='more than max_position_embeddings=64.*position_overflow="extend"'):
        energy_trace(model, seq)
    monkeypatch.setattr(model.config, "position_overflow", "extend")
    trace = energy_trace(model, seq)
    logits = model(seq.unsqueeze(0)).logits[0, :-1].cpu()
    assert trace.energies.shape == (seq.numel() - 1,)
    torch.testing.assert_close(trace.energies, logits.gather(1, seq[1:].unsqueeze(1)).squeeze(1))


def test_model_card_states_the_length_the_config_allows(model, monkeypatch):
    from modeling_brillm.model_card import model_card_text

    card = model_card_text(model)
    assert "Sequences hold at most 64 tokens" in card and "| max sequence length | 64 |" in card
    monkeypatch.setattr(model.config, "position_overflow", "extend")
    card = model_card_text(model)
    assert "at most 64 tokens" not in card and "Sequences of any length are read and generated" in card
    assert "unbounded" in card


def test_perplexity_example_extend_scores_whole_texts(saved, tmp_path, capsys):
    from modeling_brillm.training.perplexity_cli import main  # what examples/perplexity.py runs

    text = " ".join(CORPUS[:8])
    args = ["--model", str(saved), "--text", text, "--block_size", "0", "--json", str(tmp_path / "p.json")]
    assert main(args) == 2 and "block_size must be at least 2" in capsys.readouterr().err
    assert main(args + ["--extend"]) == 0
    out = capsys.readouterr()
    assert "in-process" in out.err and "whole texts" in out.out
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["built_in"]["num_blocks"] == 1 and result["built_in"]["block_size"] > 64
    # one text scored whole both ways: the metric's per-text perplexity is the built-in one
    assert result["metric"]["perplexities"][0] == pytest.approx(result["built_in"]["perplexity"], rel=1e-4)


def test_visualize_example_extend_traces_long_texts(saved, tmp_path, capsys):
    from modeling_brillm.explorer.cli import main  # what examples/visualize.py runs

    text = " ".join(CORPUS[:4])  # one token a character, and <s>: 93 tokens
    args = ["--model", str(saved), "--text", text, "--output", str(tmp_path / "v.svg"),
            "--json", str(tmp_path / "v.json"), "--max_steps", "4"]  # draw little: the trace is what is tested
    assert main(args) == 2 and capsys.readouterr().err == (
        f"error: the text holds {len(text) + 1} tokens, more than the 64 positions this model was trained on: pass "
        "--extend to read past them.\n")
    assert main(args + ["--extend"]) == 0
    steps = json.loads((tmp_path / "v.json").read_text())["steps"]
    assert len(steps) == len(text) and steps[-1]["position"] == len(text) - 1
