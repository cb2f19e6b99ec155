"""Data preparation: training files that are not UTF-8 are named with their line and byte, and the fast paths
(tokenization, blocks, bigram counting) give exactly what the plain per-text code gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modeling_brillm.training import data
from modeling_brillm.training.errors import UsageError
from tests.training.test_pretrain import TINY, error_of, run

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
    assert data.first_invalid_utf8(cut, chunk_bytes) == (3, len(CUT) - 1, True)
    assert data.first_invalid_utf8(bad, chunk_bytes) == (2, BAD.index(BAD_BYTE), False)
    assert data.first_invalid_utf8(good, chunk_bytes) is None


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
