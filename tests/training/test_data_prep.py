"""Data preparation: training files that are not UTF-8 are named with their line and byte, and the fast paths
(tokenization, blocks, bigram counting) give exactly what the plain per-text code gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modeling_brillm.training import data
from modeling_brillm.training.errors import UsageError
from tests.training.test_pretrain import TINY, error_of, run
from tokenization.text_files import first_invalid_utf8

CUT = "Hello world. This is fine.\nAnother line, café.\n".encode() + "naïve".encode()[:3]  # ends inside "ï"
BAD_BYTE = b"\xff"
BAD = b"Hello world.\nA bad " + BAD_BYTE + b" byte here.\nMore text.\n"


def raw_args(path, validation_file=None):
    return SimpleNamespace(dataset_name=None, train_file=str(path), validation_file=validation_file,
                           text_column="text", validation_split_percentage=5)


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 1 << 20])  # chunk edges inside multi-byte characters too
def test_first_invalid_utf8_finds_line_and_byte(tmp_path, chunk_bytes):
    cut, bad, good = tmp_path / "cut.txt", tmp_path / "bad.txt", tmp_path / "good.txt"
    cut.write_bytes(CUT)
    bad.write_bytes(BAD)
    good.write_text("Grüße, 世界.\nnaïve café\n", encoding="utf-8")
    assert first_invalid_utf8(cut, chunk_bytes) == (3, len(CUT) - 1, True)
    assert first_invalid_utf8(bad, chunk_bytes) == (2, BAD.index(BAD_BYTE), False)
    assert first_invalid_utf8(good, chunk_bytes) is None


def test_load_raw_data_names_the_cut_last_line(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_bytes(CUT)
    with pytest.raises(UsageError) as caught:
        data.load_raw_data(raw_args(path))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{path}: line 3, byte offset {len(CUT) - 1}" in message
    assert "ends inside a multi-byte UTF-8 character" in message and "head -n -1" in message


def test_load_raw_data_names_a_bad_byte_mid_file(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(BAD)
    good = tmp_path / "good.txt"
    good.write_text("Valid text.\n")
    args = raw_args(good, validation_file=str(path))  # the validation file is checked too
    with pytest.raises(UsageError) as caught:
        data.load_raw_data(args)
    message = str(caught.value)
    assert f"{path}: line 2, byte offset {BAD.index(BAD_BYTE)}: byte 0xff is not valid UTF-8" in message
    assert "iconv -f <its encoding> -t utf-8" in message and "\n" not in message


def test_pretrain_names_the_invalid_byte(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_bytes(CUT)
    message = error_of(run(["--train_file", path, "--output_dir", tmp_path / "out", *TINY], check=False))
    assert f"line 3, byte offset {len(CUT) - 1}: the file ends inside a multi-byte UTF-8 character" in message


# --------------------------------------------------------------------------------- the fast paths, as before
# The per-text implementations the fast paths replaced, kept here as the reference they must equal exactly.
def reference_sentence_blocks(tokenizer, texts, T, bos, eos, pad):
    sentences = [s for text in texts if text for s in data.split_sentences(text)]
    encoded = tokenizer(sentences, add_special_tokens=False, verbose=False)["input_ids"] if sentences else []
    ids, masks = [], []
    for tokens in encoded:
        if len(tokens) < 2:
            continue
        seq = ([bos] if bos is not None else []) + tokens + ([eos] if eos is not None else [])
        seq = seq[:T]
        ids.append(seq + [pad] * (T - len(seq)))
        masks.append([1] * len(seq) + [0] * (T - len(seq)))
    return {"input_ids": ids, "attention_mask": masks}


def reference_document_tokens(tokenizer, texts):
    texts = [t for t in texts if t and t.strip()]
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    return [[tokenizer.bos_token_id] + tokens + [tokenizer.eos_token_id] for tokens in encoded if len(tokens) >= 2]


def reference_contiguous_blocks(rows, T):
    flat = [t for seq in rows for t in seq]
    n = len(flat) // T * T
    return [flat[i:i + T] for i in range(0, n, T)]


def reference_bigrams(sequences, V, ignore=()):
    from collections import Counter

    counter = Counter((int(u), int(v)) for seq in sequences for u, v in zip(list(seq)[:-1], list(seq)[1:])
                      if int(u) not in ignore and int(v) not in ignore)
    keys = sorted(u * V + v for u, v in counter)
    return keys, [counter[divmod(k, V)] for k in keys]


@pytest.fixture(scope="module")
def texts():
    corpus = data.embedded_corpus()
    return [corpus[i] for i in range(0, len(corpus), 7)][:300] + ["", "   ", "x", "Hi. <s> A </s> special."]


@pytest.fixture(scope="module")
def tokenizers(texts, tmp_path_factory):
    from tokenization import build_tokenizer

    return {kind: build_tokenizer(texts, kind=kind, vocab_size=300 if kind == "bpe" else 120) for kind in
            ("bpe", "char")}


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_token_ids_equal_the_tokenizer_call(kind, texts, tokenizers):
    tok = tokenizers[kind]
    ids = data.TokenIds(tok)
    assert ids.backend is not None  # the fast path is the one tested
    assert ids(texts) == tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    assert ids([]) == []
    tok.backend_tokenizer.enable_truncation(5)  # a setting the wrapper's call clears: the fast path too
    try:
        assert data.TokenIds(tok)(texts) == tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    finally:
        tok.backend_tokenizer.no_truncation()


@pytest.mark.parametrize("block_size", [2, 5, 16, 64])
@pytest.mark.parametrize("specials", ["both", "no_bos", "no_eos", "none"])
def test_sentence_blocks_equal_the_per_sentence_blocks(block_size, specials, texts, tokenizers):
    tok = tokenizers["bpe"]
    cut = data.SentenceBlocks(tok, "text", block_size)
    if specials in ("no_bos", "none"):
        cut.bos = None
    if specials in ("no_eos", "none"):
        cut.eos = None
    expected = reference_sentence_blocks(tok, texts, block_size, cut.bos, cut.eos, cut.pad)
    assert len(expected["input_ids"]) > 500
    assert cut({"text": texts}) == expected
    cut.arrays = True
    arrays = cut({"text": texts})
    assert arrays["input_ids"].dtype.name == arrays["attention_mask"].dtype.name == "int64"
    assert arrays["input_ids"].tolist() == expected["input_ids"]
    assert arrays["attention_mask"].tolist() == expected["attention_mask"]
    empty = cut({"text": ["", "x"]})
    assert empty["input_ids"].shape == (0, block_size)


def test_contiguous_blocks_from_lists_and_arrow_equal_the_per_token_blocks():
    import pyarrow as pa

    rows = [[2, 5, 6, 3], [2, 7, 8, 9, 3], [], [2, 4, 3]]
    for T in (2, 3, 5, 13):
        expected = reference_contiguous_blocks(rows, T)
        for batch in ({"input_ids": rows}, pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))})):
            out = data.contiguous_blocks(batch, T)
            assert out["input_ids"].tolist() == expected
            assert out["attention_mask"].tolist() == [[1] * T] * len(expected)


class OneProcess:
    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def reference_splits(raw, tok, mode, T):
    """The blocks of every split as the code before the fast paths cut them (one process)."""
    out = {}
    for split, dataset in raw.items():
        if mode == "sentence":
            rows = reference_sentence_blocks(tok, dataset["text"], T, tok.bos_token_id, tok.eos_token_id,
                                             tok.pad_token_id)["input_ids"]
        else:
            docs = [d for i in range(0, len(dataset), 1000)
                    for d in reference_document_tokens(tok, dataset["text"][i:i + 1000])]
            rows = [b for i in range(0, len(docs), 1000) for b in reference_contiguous_blocks(docs[i:i + 1000], T)]
        out[split] = rows
    return out


@pytest.mark.parametrize("mode", ["sentence", "contiguous"])
def test_tokenize_splits_equal_the_per_text_code_on_any_process_count(mode, texts, tokenizers, monkeypatch):
    import datasets

    tok = tokenizers["bpe"]
    many = texts * 8  # more than one map batch of 1000 texts, so contiguous blocks drop several tails
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": many}),
                                "validation": datasets.Dataset.from_dict({"text": texts[:40]})})
    expected = reference_splits(raw, tok, mode, 16)
    for workers in (None, 2):
        args = SimpleNamespace(block_mode=mode, text_column="text", block_size=16,
                               preprocessing_num_workers=workers, overwrite_cache=True)
        blocks = data.tokenize_splits(raw, tok, args, OneProcess())
        for split in ("train", "validation"):
            assert blocks[split]["input_ids"] == expected[split], (split, workers)
            features = blocks[split].features  # as datasets stores the lists the code before returned
            assert [str(features[c].feature) for c in ("input_ids", "attention_mask")] == ["Value('int32')",
                                                                                        "Value('int8')"]
            assert blocks[split].format["type"] is None
    monkeypatch.setattr(data, "BYTES_PER_WORKER", 1)  # the default count: one process per core here
    args.preprocessing_num_workers = None
    assert data.tokenize_splits(raw, tok, args, OneProcess())["train"]["input_ids"] == expected["train"]


def test_map_workers_default_follows_the_cores_and_the_data(monkeypatch):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": ["a" * 1000] * 50})
    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert data.map_workers(dataset, 3) == 3  # --preprocessing_num_workers wins
    assert data.map_workers(dataset, None) is None  # 50 KB: not worth a process
    monkeypatch.setattr(data, "BYTES_PER_WORKER", 10_000)
    assert data.map_workers(dataset, None) == dataset.data.nbytes // 10_000
    held_out = dataset.select(range(0, 50, 10))  # 5 of the table's 50 rows: a tenth of its bytes
    assert data.map_workers(held_out, None) is None
    monkeypatch.setattr(data, "BYTES_PER_WORKER", 1)
    assert data.map_workers(dataset, None) == 16
    assert data.map_workers(held_out, None) == 5  # never more processes than rows


def test_serial_tokenizers_restores_the_setting(monkeypatch):
    """A map on several processes runs `tokenizers` serially inside, and restores the setting after; one process
    leaves it alone."""
    from types import SimpleNamespace

    seen = []
    dataset = SimpleNamespace(column_names=[], map=lambda *a, **k: seen.append(data.os.environ.get(
        "TOKENIZERS_PARALLELISM")))
    args = SimpleNamespace(overwrite_cache=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    data._map(dataset, None, 2, args, "test")
    assert seen == ["false"] and "TOKENIZERS_PARALLELISM" not in data.os.environ
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    data._map(dataset, None, 2, args, "test")
    assert seen[-1] == "false" and data.os.environ["TOKENIZERS_PARALLELISM"] == "true"
    data._map(dataset, None, None, args, "test")
    assert seen[-1] == "true"


def test_block_sequences_and_graph_equal_the_per_block_code(texts, tokenizers):
    import datasets
    import torch

    from modeling_brillm import build_sparse_graph

    tok = tokenizers["bpe"]
    rows = reference_sentence_blocks(tok, texts, 12, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    blocks = datasets.Dataset.from_dict(rows)
    sequences = list(data.block_sequences(blocks, tok.pad_token_id))
    expected = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(rows["input_ids"], rows["attention_mask"])]
    assert [s.tolist() for s in sequences] == expected and all(s.dtype == torch.int64 for s in sequences)
    V, pad = len(tok), tok.pad_token_id
    graph = build_sparse_graph(data.block_sequences(blocks, pad), V, ignore_ids=(pad,))
    keys, counts = reference_bigrams(expected, V, ignore={pad})
    sources = torch.repeat_interleave(torch.arange(V), graph.indptr.diff())
    assert (sources * V + graph.indices).tolist() == keys and graph.counts.tolist() == counts


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1 << 22])
def test_count_bigrams_equals_counting_pair_by_pair(chunk_tokens):
    import torch

    from modeling_brillm.graph import count_bigrams

    g = torch.Generator().manual_seed(0)
    V = 9
    sequences = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(0, 12, (60,), generator=g)]
    sequences += [[], [V + 5], [1, 2, 1, 2], (3, 3, 3), torch.tensor([[4, 5], [6, 7]])]  # 2-D: read flat
    expected = reference_bigrams([torch.as_tensor(s).reshape(-1).tolist() for s in sequences], V, ignore={0})
    keys, counts = count_bigrams(sequences, V, ignore_ids=[0], chunk_tokens=chunk_tokens)
    assert (keys.tolist(), counts.tolist()) == expected  # a 1-token sequence is never checked, as before
    with pytest.raises(ValueError, match=r"token id out of range: .* found \d\.\.12"):
        count_bigrams([[1, 2], [3, 12]], V, chunk_tokens=chunk_tokens)
