"""Release conversion: synthetic checkpoints in the released layout, and the released vocab/tokenizer files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spec_reference import released_edge_rows, spec_forward
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_brillm.convert_brillm05 import ConversionError, convert

# The released vocabularies and tokenizer (not part of this repository): a folder named by BRILLM05_RELEASE.
RELEASE = Path(os.environ.get("BRILLM05_RELEASE", "")) if os.environ.get("BRILLM05_RELEASE") else None
needs_release = pytest.mark.skipif(RELEASE is None or not RELEASE.is_dir(),
                                   reason="set BRILLM05_RELEASE to a folder holding the released BriLLM0.5 files")


def released_checkpoint(path, V, d, rows, seed=0):
    """A state dict exactly as the release saves it (four tensors, released shapes), with random values."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "node_bias": torch.rand(V, 1, d, generator=g) - 0.5,
        "weights": torch.rand(rows, d, d, generator=g) - 0.5,
        "biases": torch.rand(rows, 1, d, generator=g) - 0.5,
        "positions": 1 + torch.randn(1, 512, 1, generator=g),
    }
    torch.save(state, path)
    return state


def write_json(path, data):
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def test_sparse_conversion_matches_release_forward(tmp_path):
    V, d = 9, 4
    tokens = [f"t{i}" for i in range(V)]
    vocab = write_json(tmp_path / "vocab.json", {t: i for i, t in enumerate(tokens)})
    g = torch.Generator().manual_seed(1)
    frequency, zero = {}, set()
    for u in range(V):  # each source lists some pairs with count 0 (shared), some positive; the rest unlisted
        for v in range(V):
            r = torch.rand(1, generator=g).item()
            if r < 0.6:
                frequency.setdefault(tokens[u], {})[tokens[v]] = 0
                zero.add((u, v))
            elif r < 0.8:
                frequency.setdefault(tokens[u], {})[tokens[v]] = int(1 + 10 * r)
    rows, num_rows = released_edge_rows(V, zero)
    state = released_checkpoint(tmp_path / "model.bin", V, d, num_rows)
    freq_file = write_json(tmp_path / "word_frequency.json", frequency)
    convert(tmp_path / "model.bin", vocab, tmp_path / "hf", word_frequency_file=freq_file)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.graph == "sparse" and model.config.num_edges == V * V - len(zero)
    for name in state:
        assert torch.equal(getattr(model.base_model, name), state[name]), name
    # positive counts survive as bigram counts; unlisted pairs are real with count 0
    u, v = next((a, b) for (a, b) in ((a, b) for a in range(V) for b in range(V))
                if frequency.get(tokens[a], {}).get(tokens[b], 0) > 0)
    row = int(model.edge_rows(torch.tensor([u]), torch.tensor([v])))
    assert int(model.base_model.graph_counts[row - 1]) == frequency[tokens[u]][tokens[v]]
    torch.manual_seed(0)
    for _ in range(3):
        seq = torch.randint(0, V, (7,))
        torch.testing.assert_close(model(seq[None]).logits[0], spec_forward(state, rows, seq.tolist()),
                                   atol=1e-5, rtol=1e-5)


def test_dense_conversion_by_command_line(tmp_path):
    V, d = 6, 3
    write_json(tmp_path / "vocab.json", {f"w{i}": i for i in range(V)})
    state = released_checkpoint(tmp_path / "model.bin", V, d, V * V + 1)
    result = subprocess.run(
        [sys.executable, "-m", "modeling_brillm.convert_brillm05", "--checkpoint", str(tmp_path / "model.bin"),
         "--vocab", str(tmp_path / "vocab.json"), "--output-dir", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "dense graph" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    seq = [0, 5, 2, 2, 4]
    torch.testing.assert_close(model(torch.tensor([seq])).logits[0],
                               spec_forward(state, released_edge_rows(V)[0], seq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [8, 32])
def test_conversion_matches_release_forward_up_to_position_511(tmp_path, d):
    """The angles grow with the position (pos · 10000^(2j/d) reaches ~5.6e3·pos at d=32): one float32 ulp of
    frequency shows at long positions, so the whole 512-token window is checked."""
    V = 5
    write_json(tmp_path / "vocab.json", {f"w{i}": i for i in range(V)})
    state = released_checkpoint(tmp_path / "model.bin", V, d, V * V + 1, seed=d)
    state["weights"] /= d ** 0.5  # keep the signal O(1) over 511 steps, as a trained model's
    torch.save(state, tmp_path / "model.bin")
    convert(tmp_path / "model.bin", tmp_path / "vocab.json", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    seq = torch.randint(0, V, (512,), generator=torch.Generator().manual_seed(d))
    expected = spec_forward(state, released_edge_rows(V)[0], seq.tolist())
    logits = model(seq[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[-12:], expected[-12:], atol=1e-5, rtol=1e-5)


def test_conversion_errors_name_the_problem(tmp_path):
    V, d = 5, 2
    vocab = write_json(tmp_path / "vocab.json", {f"w{i}": i for i in range(V)})
    released_checkpoint(tmp_path / "dense.bin", V, d, V * V + 1)
    with pytest.raises(ConversionError, match="needs 4 "):  # sparse file with 22 zero pairs: 3 real edges + shared
        convert(tmp_path / "dense.bin", vocab, tmp_path / "o1", word_frequency_file=write_json(
            tmp_path / "f.json", {f"w{u}": {f"w{v}": 0 for v in range(V)} for u in range(V) if u > 0} | {
                "w0": {"w0": 0, "w1": 0}}))
    with pytest.raises(ConversionError, match="not in the vocab"):
        convert(tmp_path / "dense.bin", vocab, tmp_path / "o2",
                word_frequency_file=write_json(tmp_path / "g.json", {"zzz": {"w1": 0}}))
    with pytest.raises(ConversionError, match="checkpoint not found"):
        convert(tmp_path / "missing.bin", vocab, tmp_path / "o3")
    (tmp_path / "junk.bin").write_bytes(b"\x00junk" * 20)
    with pytest.raises(ConversionError, match="cannot read"):
        convert(tmp_path / "junk.bin", vocab, tmp_path / "o4")
    torch.save({"weights": torch.zeros(2, 2, 2)}, tmp_path / "other.bin")
    with pytest.raises(ConversionError, match="missing"):
        convert(tmp_path / "other.bin", vocab, tmp_path / "o5")
    with pytest.raises(ConversionError, match="3 tokens"):
        convert(tmp_path / "dense.bin", write_json(tmp_path / "v3.json", {"a": 0, "b": 1, "c": 2}), tmp_path / "o6")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        convert(tmp_path / "dense.bin", tmp_path / "bad.json", tmp_path / "o7")


@needs_release
def test_released_english_vocab_and_tokenizer(tmp_path):
    """Dense English graph at the release's V=4000 (d=1 keeps the synthetic checkpoint at 64 MB)."""
    vocab_file = RELEASE / "vocab_wiki_4k_en.json"
    V = len(json.loads(vocab_file.read_text(encoding="utf-8")))
    assert V == 4000
    state = released_checkpoint(tmp_path / "model.bin", V, 1, V * V + 1)
    convert(tmp_path / "model.bin", vocab_file, tmp_path / "hf",
            tokenizer_file=RELEASE / "wiki_bpe_tokenizer_4000_bytelevel.json")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (model.config.pad_token_id, model.config.unk_token_id, model.config.bos_token_id,
            model.config.eos_token_id) == (0, 1, 2, 3)
    ids = tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2 and tokenizer.decode(ids).strip() == "The quick brown fox"  # the release adds a prefix space
    expected = spec_forward(state, _DenseRows(V), ids)
    torch.testing.assert_close(model(torch.tensor([ids])).logits[0], expected, atol=1e-5, rtol=1e-5)


@needs_release
def test_released_chinese_vocab_sparse(tmp_path):
    vocab_file = RELEASE / "vocab_wiki_4k.json"
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    V = len(vocab)
    assert V == 4001 and vocab["<unk>"] == 0
    chars = sorted(vocab, key=vocab.get)
    zero = {(1, 2), (1, 3), (5, 0), (V - 1, V - 1)}
    frequency = {chars[u]: {chars[v]: 0} for u, v in zero if u != 1}
    frequency[chars[1]] = {chars[2]: 0, chars[3]: 0, chars[4]: 17}
    write_json(tmp_path / "word_frequency.json", frequency)
    state = released_checkpoint(tmp_path / "model.bin", V, 1, V * V - len(zero) + 1)
    convert(tmp_path / "model.bin", vocab_file, tmp_path / "hf", word_frequency_file=tmp_path / "word_frequency.json")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.unk_token_id == 0 and model.config.num_edges == V * V - len(zero)
    text = "".join(chars[10:14])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [vocab[c] for c in text]
    assert model.edge_rows(torch.tensor([1, 1, 1]), torch.tensor([2, 3, 4])).tolist()[:2] == [0, 0]
    seq = [1, 2, 5, 0, 1, 4]  # walks over shared and real edges
    torch.testing.assert_close(model(torch.tensor([seq])).logits[0], spec_forward(state, _SparseRows(V, zero), seq),
                               atol=1e-5, rtol=1e-5)


class _DenseRows:
    """released_edge_rows for a large dense V without building a V² dict."""

    def __init__(self, V):
        self.V = V

    def __getitem__(self, pair):
        return 1 + pair[0] * self.V + pair[1]


class _SparseRows:
    """released_edge_rows for large V with a few shared pairs, computed on demand."""

    def __init__(self, V, zero):
        self.V, self.zero = V, sorted(zero)

    def __getitem__(self, pair):
        if pair in self.zero:
            return 0
        flat = pair[0] * self.V + pair[1]
        return 1 + flat - sum(1 for u, v in self.zero if u * self.V + v < flat)
