"""Tests for tokenization.build_tokenizer (BriLLM BPE / char tokenizers).

Corpora are generated here and kept tiny so the whole file runs in seconds on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny import CORPUS, make_model
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from tokenization import build_tokenizer, load_released_char_vocab, load_released_tokenizer
from tokenization.build_tokenizer import main

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DIR = REPO_ROOT.parent / "shared" / "reference" / "brillm05"  # shared/ sits beside the clone
RELEASED_BPE_JSON = REFERENCE_DIR / "wiki_bpe_tokenizer_4000_bytelevel.json"
RELEASED_CHAR_VOCAB = REFERENCE_DIR / "vocab_wiki_4k.json"

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
PAD, UNK, BOS, EOS = range(4)

BPE_VOCAB = 300
CHAR_VOCAB = 50
N_CHAR_KEPT = CHAR_VOCAB - len(SPECIALS)

# 60 "Chinese-like" symbols (space included) with strictly decreasing counts, so
# the set of the 46 most frequent ones is unambiguous (no ties at the cut-off).
CHAR_POOL = [" "] + list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时"
                            "年得就那要下以生会自着去之过家学对可里后天多么心还看起发当没")
assert len(set(CHAR_POOL)) == 60
CHAR_COUNTS = {ch: 300 - 4 * i for i, ch in enumerate(CHAR_POOL)}
CHAR_TOP = {ch for ch, _ in sorted(CHAR_COUNTS.items(), key=lambda kv: -kv[1])[:N_CHAR_KEPT]}
CHAR_DROPPED = [ch for ch in CHAR_POOL if ch not in CHAR_TOP]


def _english_corpus(n_lines: int = 300) -> list[str]:
    rng = random.Random(0)
    words = (
        "the of and to in a is was for on that with as by it from at his an were are which this be "
        "first city river school team game year new also after world war state national history"
    ).split()
    lines = []
    for _ in range(n_lines):
        sent = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        lines.append(sent.capitalize() + rng.choice([".", ",", "!", "?"]) + f" {rng.randint(1800, 2024)}")
    return lines


def _chinese_corpus() -> list[str]:
    rng = random.Random(1)
    chars = [ch for ch, n in CHAR_COUNTS.items() for _ in range(n)]
    rng.shuffle(chars)
    # Lines of 25 shuffled characters; the space is just another frequent character.
    return ["".join(chars[i : i + 25]) for i in range(0, len(chars), 25)]


@pytest.fixture(scope="module")
def english_texts() -> list[str]:
    return _english_corpus()


@pytest.fixture(scope="module")
def chinese_texts() -> list[str]:
    return _chinese_corpus()


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, english_texts) -> Path:
    out = tmp_path_factory.mktemp("bpe_tok")
    build_tokenizer(english_texts, kind="bpe", vocab_size=BPE_VOCAB, output_dir=out, model_max_length=128)
    return out


@pytest.fixture(scope="module")
def bpe_tok(english_texts) -> PreTrainedTokenizerFast:
    return build_tokenizer(english_texts, kind="bpe", vocab_size=BPE_VOCAB)


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory, chinese_texts) -> Path:
    out = tmp_path_factory.mktemp("char_tok")
    build_tokenizer(chinese_texts, kind="char", vocab_size=CHAR_VOCAB, output_dir=out)
    return out


@pytest.fixture(scope="module")
def char_tok(chinese_texts) -> PreTrainedTokenizerFast:
    return build_tokenizer(chinese_texts, kind="char", vocab_size=CHAR_VOCAB)


def _ids(tok, text, **kw):
    return tok(text, **kw)["input_ids"]


class _TransformersWarnings(logging.Handler):
    """Collects what transformers logs (its root logger does not propagate, so caplog would miss it)."""

    def __enter__(self):
        self.messages = []
        hf_logging.get_logger("transformers").addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        hf_logging.get_logger("transformers").removeHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


TOO_LONG = "Token indices sequence length is longer"


def test_long_texts_tokenize_quietly_and_the_model_keeps_its_limit(char_dir, english_texts):
    long_zh = "".join(_chinese_corpus())  # ~9,000 characters
    long_en = " ".join(english_texts)
    built = build_tokenizer(CORPUS, kind="char", vocab_size=64, min_frequency=1)
    tokenizers = [built, AutoTokenizer.from_pretrained(char_dir), build_tokenizer(english_texts, vocab_size=BPE_VOCAB)]
    if RELEASED_BPE_JSON.is_file():
        tokenizers.append(load_released_tokenizer(RELEASED_BPE_JSON))
    if RELEASED_CHAR_VOCAB.is_file():
        tokenizers.append(load_released_char_vocab(RELEASED_CHAR_VOCAB))
    with _TransformersWarnings() as messages:
        for tok in tokenizers:
            assert tok.model_max_length > 10**20
            assert len(_ids(tok, long_zh if tok.unk_token == "<unk>" else long_en)) > 2000
    assert not [m for m in messages if TOO_LONG in m]
    with _TransformersWarnings() as messages:  # the capture works: a tokenizer given a limit still warns
        _ids(build_tokenizer(CORPUS, kind="char", vocab_size=64, min_frequency=1, model_max_length=16), long_zh)
    assert [m for m in messages if TOO_LONG in m]

    model = make_model(built, max_positions=64)  # the model enforces its own limit
    ids = torch.tensor([_ids(built, " ".join(CORPUS))[:65]])
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(ids)
    assert model(ids[:, :64]).logits.shape == (1, 64, len(built))


@pytest.mark.parametrize("overflow", ["error", "extend"])
def test_a_tokenizer_saved_beside_a_model_records_its_position_limit(tmp_path, overflow):
    """Beside a model, model_max_length is config.max_position_embeddings (reloaded through the remote config too):
    truncation cuts there; an "error" model refuses more, an "extend" model reads past it (its trained range)."""
    built = build_tokenizer(CORPUS, kind="char", vocab_size=64, min_frequency=1)
    model = make_model(built, max_positions=40)
    model.config.position_overflow = overflow
    built.model_max_length = model.config.max_position_embeddings  # what every save beside a model does
    model.save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    assert tok.model_max_length == model.config.max_position_embeddings == 40
    text = " ".join(CORPUS)
    assert len(_ids(tok, text, truncation=True)) == 40
    with _TransformersWarnings() as messages:
        ids = torch.tensor([_ids(tok, text, verbose=False)[:60]])  # blocks and long reads: no warning
    assert not [m for m in messages if TOO_LONG in m]
    with torch.no_grad():
        if overflow == "error":
            with pytest.raises(ValueError, match="max_position_embeddings=40"):
                model(ids)
        else:
            assert torch.isfinite(model(ids).logits).all()


# --------------------------------------------------------------------------- #
# BPE
# --------------------------------------------------------------------------- #
def test_bpe_special_token_ids(bpe_tok):
    assert isinstance(bpe_tok, PreTrainedTokenizerFast)
    assert bpe_tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3]
    assert (bpe_tok.pad_token_id, bpe_tok.unk_token_id, bpe_tok.bos_token_id, bpe_tok.eos_token_id) == (
        PAD,
        UNK,
        BOS,
        EOS,
    )
    assert len(bpe_tok) == BPE_VOCAB  # vocab_size counts the specials


def test_bpe_bos_prepended_never_eos(bpe_tok):
    text = "The city river was new."
    with_special = _ids(bpe_tok, text)
    without = _ids(bpe_tok, text, add_special_tokens=False)
    assert with_special[0] == BOS
    assert with_special[1:] == without
    assert EOS not in with_special and BOS not in without
    pair = _ids(bpe_tok, "first", text_pair="second")
    assert pair.count(BOS) == 2 and EOS not in pair


@pytest.mark.parametrize(
    "text",
    [
        "The first national team was in the city.",
        "  leading spaces, double  spaces\tand tabs\nnew line 1999!",
        "Café naïve über Straße — 東京 中文字符 😀 ∑ ŝ",
    ],
    ids=["ascii", "whitespace", "non_ascii"],
)
def test_bpe_round_trip(bpe_tok, text):
    ids = _ids(bpe_tok, text)
    assert UNK not in ids  # byte-level alphabet: nothing is unknown
    assert bpe_tok.decode(ids, skip_special_tokens=True) == text
    assert bpe_tok.decode(_ids(bpe_tok, text, add_special_tokens=False)) == text


def test_bpe_nfkc_normalisation(bpe_tok):
    # Documented: NFKC runs first, so compatibility characters come back normalised.
    assert bpe_tok.decode(_ids(bpe_tok, "\ufb01rst"), skip_special_tokens=True) == "first"


def test_bpe_learned_merges(bpe_tok, english_texts):
    # Only 40 merges fit in 300 tokens, but the frequent " the" must be one of
    # them, and the corpus must compress well below one token per byte.
    assert bpe_tok.tokenize(" the") == ["\u0120the"]
    assert len(_ids(bpe_tok, "xyzzyq", add_special_tokens=False)) == 6  # unseen: bytes
    n_tokens = sum(len(_ids(bpe_tok, t, add_special_tokens=False)) for t in english_texts[:50])
    n_bytes = sum(len(t.encode("utf-8")) for t in english_texts[:50])
    assert n_tokens < 0.75 * n_bytes


def test_bpe_autotokenizer_reload(bpe_dir, bpe_tok, english_texts):
    assert (bpe_dir / "tokenizer.json").is_file()
    reloaded = AutoTokenizer.from_pretrained(bpe_dir)
    assert reloaded.model_max_length == 128
    assert reloaded.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3]
    assert (reloaded.pad_token, reloaded.unk_token, reloaded.bos_token, reloaded.eos_token) == tuple(SPECIALS)
    for text in english_texts[:20] + ["Café 😀 東京"]:
        assert _ids(reloaded, text) == _ids(bpe_tok, text)
        assert reloaded.decode(_ids(reloaded, text), skip_special_tokens=True) == text


# --------------------------------------------------------------------------- #
# Char
# --------------------------------------------------------------------------- #
def test_char_special_ids_and_size(char_tok):
    assert char_tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3]
    assert char_tok.unk_token_id == UNK and char_tok.bos_token_id == BOS
    assert len(char_tok) == CHAR_VOCAB


def test_char_most_frequent_kept(char_tok):
    kept = set(char_tok.get_vocab()) - set(SPECIALS)
    assert kept == CHAR_TOP
    assert all(ch not in kept for ch in CHAR_DROPPED)


def test_char_one_id_per_character(char_tok):
    text = "的一是 不了人我 在有"
    ids = _ids(char_tok, text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert char_tok.convert_ids_to_tokens(ids) == list(text)
    assert UNK not in ids
    assert _ids(char_tok, text)[0] == BOS and EOS not in _ids(char_tok, text)


def test_char_unknown_characters(char_tok):
    rare = CHAR_DROPPED[0]  # in the corpus but beyond the vocab cap
    text = f"的{rare}是😀\t"
    ids = _ids(char_tok, text, add_special_tokens=False)
    assert ids == [char_tok.convert_tokens_to_ids("的"), UNK, char_tok.convert_tokens_to_ids("是"), UNK, UNK]


def test_char_decode_joins_without_spaces(char_tok):
    assert " " in CHAR_TOP  # the frequent space is a normal token ...
    text = "的一 是不 了"
    ids = _ids(char_tok, text)
    # ... so it round-trips, and no separator is inserted between characters.
    assert char_tok.decode(ids, skip_special_tokens=True) == text
    assert char_tok.decode(_ids(char_tok, "的一是", add_special_tokens=False)) == "的一是"


def test_char_whitespace_and_punctuation_round_trip():
    # Newlines/tabs inside the training texts are characters like any other;
    # " ," and " ." must not be "cleaned up" on decode, and no normaliser may
    # fold the full-width comma or U+00A0 into their ASCII look-alikes.
    texts = ["ab ,\tc .\n\nd !", "a\nb , c . d", "中，文\u00a0字"] * 3
    tok = build_tokenizer(texts, kind="char", vocab_size=30)
    assert {"\n", "\t", " ", "，", "\u00a0"} <= set(tok.get_vocab())
    for text in ["a\n\nb", "a , b . c ! d\t", "中，文\u00a0字,"]:
        ids = _ids(tok, text, add_special_tokens=False)
        assert len(ids) == len(text) and UNK not in ids
        assert tok.decode(ids) == text


def test_char_autotokenizer_reload(char_dir, char_tok):
    reloaded = AutoTokenizer.from_pretrained(char_dir)
    text = "的一 是不了人😀"
    assert _ids(reloaded, text) == _ids(char_tok, text)
    assert reloaded.decode(_ids(reloaded, "我在 有"), skip_special_tokens=True) == "我在 有"


# --------------------------------------------------------------------------- #
# Input forms
# --------------------------------------------------------------------------- #
def test_input_forms_give_same_vocab(tmp_path, chinese_texts):
    reference = build_tokenizer(chinese_texts, kind="char", vocab_size=CHAR_VOCAB).get_vocab()

    half = len(chinese_texts) // 2
    f1, f2 = tmp_path / "a.txt", tmp_path / "b.txt"
    f1.write_text("\n".join(chinese_texts[:half]) + "\n", encoding="utf-8")
    f2.write_text("\n".join(chinese_texts[half:]) + "\n\n", encoding="utf-8")  # blank line ignored

    from_paths = build_tokenizer([f1, f2], kind="char", vocab_size=CHAR_VOCAB)
    from_strs = build_tokenizer([str(f1), str(f2)], kind="char", vocab_size=CHAR_VOCAB)
    from_gen = build_tokenizer((t for t in chinese_texts), kind="char", vocab_size=CHAR_VOCAB)
    assert from_paths.get_vocab() == reference
    assert from_strs.get_vocab() == reference
    assert from_gen.get_vocab() == reference
    assert "\n" not in from_paths.get_vocab()  # files are one document per line
    assert build_tokenizer(str(f1), kind="char", vocab_size=CHAR_VOCAB).get_vocab() == (
        build_tokenizer(chinese_texts[:half], kind="char", vocab_size=CHAR_VOCAB).get_vocab()
    )


def test_dataset_input(chinese_texts):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": chinese_texts, "id": list(range(len(chinese_texts)))})
    tok = build_tokenizer(ds, kind="char", vocab_size=CHAR_VOCAB, text_column="content")
    assert set(tok.get_vocab()) - set(SPECIALS) == CHAR_TOP
    with pytest.raises(ValueError, match="text_column"):
        build_tokenizer(ds, kind="char", vocab_size=CHAR_VOCAB)  # default "text" is missing


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"kind": "wordpiece"}, ValueError, "Unknown tokenizer kind"),
        ({"kind": "bpe", "vocab_size": 259}, ValueError, ">= 260"),
        ({"kind": "char", "vocab_size": 4}, ValueError, ">= 5"),
        ({"kind": "char", "min_frequency": 0}, ValueError, "min_frequency"),
    ],
)
def test_bad_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build_tokenizer(["some text here"], **kwargs)


@pytest.mark.parametrize("kind", ["bpe", "char"])
@pytest.mark.parametrize("data", [[], ["", ""], iter([])], ids=["empty_list", "empty_strings", "empty_iter"])
def test_empty_corpus(kind, data):
    with pytest.raises(ValueError, match="[Ee]mpty"):
        build_tokenizer(data, kind=kind, vocab_size=300)


def test_empty_file_and_missing_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="Empty corpus"):
        build_tokenizer([empty], kind="char", vocab_size=10)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        build_tokenizer([str(tmp_path / "missing.txt")], kind="char", vocab_size=10)
    with pytest.raises(FileNotFoundError):
        build_tokenizer(tmp_path / "missing.txt", kind="char", vocab_size=10)
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        build_tokenizer("no_such_corpus", kind="char", vocab_size=10)  # a lone str is a path
    with pytest.raises(ValueError, match="mixes file paths and raw texts"):
        build_tokenizer([empty, "some raw text"], kind="char", vocab_size=10)
    with pytest.raises(TypeError):
        build_tokenizer([b"bytes are not text"], kind="char", vocab_size=10)


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first line\nsecond café line\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: line 2, byte offset 21: byte 0xe9 is not valid UTF-8; "
                                         r"re-encode the file as UTF-8 \(iconv"):
        build_tokenizer([bad], kind="char", vocab_size=10)
    cut = tmp_path / "cut.txt"
    cut.write_bytes("one\ntwo é".encode()[:-1])
    assert main(["--kind", "char", "--vocab_size", "20", "--train_file", str(cut), "--output_dir",
                 str(tmp_path / "out")]) == 2
    assert "line 2, byte offset 8: the file ends inside a multi-byte UTF-8 character" in capsys.readouterr().err


def test_package_reexports():
    import importlib

    import tokenization

    module = importlib.import_module("tokenization.build_tokenizer")

    for name in tokenization.__all__:
        assert getattr(tokenization, name) is getattr(module, name)
    assert callable(tokenization.build_tokenizer)  # the function, not the same-named submodule


# --------------------------------------------------------------------------- #
# Released BriLLM0.5 files
# --------------------------------------------------------------------------- #
needs_released_bpe = pytest.mark.skipif(
    not RELEASED_BPE_JSON.is_file(), reason=f"released BriLLM0.5 tokenizer not available at {RELEASED_BPE_JSON}"
)
needs_released_char = pytest.mark.skipif(
    not RELEASED_CHAR_VOCAB.is_file(), reason=f"released BriLLM0.5 Chinese vocab not available at {RELEASED_CHAR_VOCAB}"
)


@needs_released_bpe
def test_released_tokenizer_specials_and_ids():
    tok = load_released_tokenizer(RELEASED_BPE_JSON)
    raw = Tokenizer.from_file(str(RELEASED_BPE_JSON))
    assert (tok.pad_token, tok.unk_token, tok.bos_token, tok.eos_token, tok.mask_token) == (
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    )
    assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert len(tok) == raw.get_vocab_size() == 4000
    for text in ["Hello world", "The history of the city, 1999.", "naïve café"]:
        assert _ids(tok, text) == raw.encode(text).ids
    assert tok.decode(_ids(tok, "Hello world")).strip() == "Hello world"


@needs_released_char
def test_released_char_vocab_ids_match_json():
    vocab = json.loads(RELEASED_CHAR_VOCAB.read_text(encoding="utf-8"))
    tok = load_released_char_vocab(RELEASED_CHAR_VOCAB)
    assert len(tok) == len(vocab) == 4001
    assert tok.get_vocab() == vocab
    assert tok.unk_token == "<unk>" and tok.unk_token_id == vocab["<unk>"] == 0
    assert tok.pad_token is None and tok.bos_token is None and tok.eos_token is None
    chars = [ch for ch in vocab if ch != "<unk>"][:200]
    text = "".join(chars)
    assert _ids(tok, text) == [vocab[ch] for ch in chars]  # one id per character, no specials
    assert tok.decode(_ids(tok, text)) == text
    assert _ids(tok, "中😀国") == [vocab["中"], 0, vocab["国"]]


def test_released_loaders_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_released_tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError):
        load_released_char_vocab(tmp_path / "nope.json")


def test_released_char_vocab_rejects_gaps(tmp_path):
    bad = tmp_path / "vocab.json"
    bad.write_text(json.dumps({"<unk>": 0, "a": 2}), encoding="utf-8")
    with pytest.raises(ValueError, match="ids must be unique"):
        load_released_char_vocab(bad)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def _run_cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "tokenization.build_tokenizer", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help():
    result = _run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr  # package __init__ must not pre-import the CLI module
    for flag in ("--kind", "--vocab_size", "--output_dir", "--train_file", "--dataset_name", "--text_column"):
        assert flag in result.stdout


def test_cli_train_file_writes_loadable_folder(tmp_path, english_texts):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(english_texts) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    result = _run_cli("--kind", "bpe", "--vocab_size", str(BPE_VOCAB), "--output_dir", str(out),
                      "--train_file", str(corpus))
    assert result.returncode == 0, result.stderr
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3]
    assert len(tok) == BPE_VOCAB
    ids = _ids(tok, "The city river.")
    assert ids[0] == BOS
    assert tok.decode(ids, skip_special_tokens=True) == "The city river."


def test_cli_local_dataset(tmp_path, chinese_texts):
    pytest.importorskip("datasets")
    data_dir = tmp_path / "ds"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w", encoding="utf-8") as handle:
        for line in chinese_texts:
            handle.write(json.dumps({"body": line}, ensure_ascii=False) + "\n")
    out = tmp_path / "tok"
    args = ["--kind", "char", "--vocab_size", str(CHAR_VOCAB), "--output_dir", str(out)]
    result = _run_cli(*args, "--dataset_name", str(data_dir), "--text_column", "body")
    assert result.returncode == 0, result.stderr
    tok = AutoTokenizer.from_pretrained(out)
    assert set(tok.get_vocab()) - set(SPECIALS) == CHAR_TOP


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kind", "bpe", "--vocab_size", "300"], "no training input"),
        (["--kind", "bpe", "--vocab_size", "300", "--train_file", "does_not_exist.txt"], "not found"),
        (["--kind", "bpe", "--vocab_size", "100", "--train_file", "{corpus}"], ">= 260"),
        (["--kind", "char", "--vocab_size", "4", "--train_file", "{corpus}"], ">= 5"),
        (["--kind", "wordpiece", "--vocab_size", "300", "--train_file", "{corpus}"], "invalid choice"),
    ],
    ids=["no_input", "missing_file", "bpe_vocab_small", "char_vocab_small", "unknown_kind"],
)
def test_cli_argument_errors(tmp_path, capsys, argv, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n", encoding="utf-8")
    argv = [a.replace("{corpus}", str(corpus)) for a in argv] + ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_empty_corpus(tmp_path, capsys):
    corpus = tmp_path / "empty.txt"
    corpus.write_text("\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["--kind", "char", "--vocab_size", "20", "--train_file", str(corpus), "--output_dir", str(out)]) == 2
    assert "Empty corpus" in capsys.readouterr().err
    assert not out.exists()
