"""Fine-tuning data: {"prompt", "completion"} records (TRL's SFT convention; the loss on the completion and EOS) or
{"text"} records (every token), in .jsonl, .json or .txt files, each optionally with a "signal_id"; and a built-in
prompt/completion set from Python's documentation. The prompt and the completion are tokenized apart, so the prompt
gives the tokens a user's prompt gives at generation time and the boundary is exact.
"""

from __future__ import annotations

import json
import os
import re

import torch

from .errors import UsageError

__all__ = ["SFTDataError", "builtin_pairs", "load_records", "check_records", "tokenize_records", "collate_sft",
           "split_records"]


class SFTDataError(UsageError, ValueError):
    """Unusable fine-tuning data (a missing field, an empty file): the message names the problem and the fix."""


# ------------------------------------------------------------------------------------------------ built in
_HEADING = re.compile(r"^\s*([*=~^#-])\1{3,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'][.!?])\s+(?=[A-Z\"'(])")


def builtin_pairs() -> list[dict]:
    """Topic/summary pairs from `pydoc_data.topics` (no download): the prompt names a section heading, the completion
    is the first sentence (5 to 40 words) of the prose under it; sorted topics, repeated headings dropped."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        raise SFTDataError("this Python has no pydoc_data (the built-in fine-tuning set); pass --train_file.") from None
    pairs, seen = [], set()
    for key in sorted(topics):
        lines = topics[key].split("\n")
        for i in range(len(lines) - 1):
            title = lines[i].strip()
            if not title or not _HEADING.match(lines[i + 1]) or len(lines[i + 1].strip()) != len(title):
                continue
            answer = _first_sentence(lines[i + 2:])
            title = title.strip('"').replace('"', "")
            if answer is None or title.lower() in seen or len(title) > 60:
                continue
            seen.add(title.lower())
            pairs.append({"prompt": f"Topic: {title}\nSummary:", "completion": " " + answer})
    return pairs


def _first_sentence(lines: list[str]) -> str | None:
    """The first sentence of the first prose paragraph in `lines` (before the next heading), or None."""
    paragraph: list[str] = []
    for j, line in enumerate(lines):
        if j + 1 < len(lines) and _HEADING.match(lines[j + 1]) and line.strip():
            break  # the next heading
        if not line.strip():
            if paragraph:
                break
            continue
        if line.startswith((" ", "\t")) or _HEADING.match(line):
            if paragraph:
                break
            continue  # code, grammar or a table: not prose
        paragraph.append(line.strip())
    if not paragraph:
        return None
    text = " ".join(paragraph).replace('"', "")
    sentence = _SENTENCE_END.split(text)[0]
    words = sentence.split()
    if not sentence.endswith((".", ":")) or not 5 <= len(words) <= 40:
        return None
    return sentence


# ------------------------------------------------------------------------------------------- user records
def load_records(path) -> list[dict]:
    """Records from a .jsonl / .json / .txt file, checked with `check_records`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SFTDataError(f"{path}: no such file.")
    extension = os.path.splitext(path)[1].lower()
    readers = {".txt": _text_records, ".text": _text_records, ".jsonl": _jsonl_records, ".json": _json_records}
    if extension not in readers:
        raise SFTDataError(f"{path}: unknown file extension {extension or '(none)'!r}; use .jsonl (one "
                           "{\"prompt\": ..., \"completion\": ...} object per line), .json (a list of them) "
                           "or .txt (one plain text per line).")
    with open(path, encoding="utf-8") as f:
        return check_records(readers[extension](f, path), path)


def _text_records(f, path) -> list[dict]:
    return [{"text": line.rstrip("\n")} for line in f if line.strip()]


def _jsonl_records(f, path) -> list[dict]:
    records = []
    for number, line in enumerate(f, 1):
        try:
            records += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as err:
            raise SFTDataError(f"{path}, line {number}: not valid JSON ({err.msg}); a .jsonl file holds one "
                               "JSON object per line.") from None
    return records


def _json_records(f, path) -> list[dict]:
    try:
        records = json.load(f)
    except json.JSONDecodeError as err:
        raise SFTDataError(f"{path}: not valid JSON ({err.msg}).") from None
    if isinstance(records, dict) and isinstance(records.get("data"), list):
        records = records["data"]
    if not isinstance(records, list):
        raise SFTDataError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}}).")
    return records


def check_records(records, source: str = "the data") -> list[dict]:
    """Raise `SFTDataError` naming the first bad record; returns the records."""
    if not records:
        raise SFTDataError(f"{source} holds no records: give at least one {{\"prompt\": ..., \"completion\": ...}} "
                           "(or {\"text\": ...}) record.")
    for number, record in enumerate(records, 1):
        where = f"{source}, record {number}"
        if not isinstance(record, dict):
            raise SFTDataError(f"{where} is a {type(record).__name__}, not an object with prompt/completion fields.")
        if "prompt" in record or "completion" in record:
            missing = [k for k in ("prompt", "completion") if k not in record]
            if missing:
                raise SFTDataError(
                    f"{where} has no {missing[0]!r} field: prompt/completion data needs both fields in every record "
                    "(the loss is on the completion); for plain text use {\"text\": ...} records or a .txt file.")
            fields = ("prompt", "completion")
        elif "text" in record:
            fields = ("text",)
        else:
            raise SFTDataError(f"{where} has neither 'prompt'/'completion' nor 'text' (fields: "
                               f"{sorted(record) or 'none'}); give {{\"prompt\": ..., \"completion\": ...}}.")
        for name in fields:
            if not isinstance(record[name], str):
                raise SFTDataError(f"{where}: {name!r} must be a string, got {type(record[name]).__name__}.")
        if "completion" in record and not record["completion"].strip():
            raise SFTDataError(f"{where}: the completion is empty, so there is nothing to learn from it.")
        if "text" in record and not record["text"].strip():
            raise SFTDataError(f"{where}: the text is empty.")
        sid = record.get("signal_id", 0)
        if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
            raise SFTDataError(f"{where}: signal_id must be a non-negative integer, got {sid!r}.")
    return list(records)


def split_records(records: list[dict], percentage: float) -> tuple[list[dict], list[dict]]:
    """(train, validation): every k-th record held out, `percentage` % of them, deterministically."""
    if percentage <= 0:
        return list(records), []
    held = {i for i in range(len(records)) if int((i + 1) * percentage / 100) > int(i * percentage / 100)}
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


# ----------------------------------------------------------------------------------------------- tokenize
def tokenize_records(records: list[dict], tokenizer, max_length: int, default_signal_id: int = 0
                     ) -> tuple[list[dict], int]:
    """Token ids (prompt with its special tokens + completion without + EOS), labels (-100 on the prompt) and signal
    id of every record, cut to `max_length`; (rows, records dropped for want of a scored transition)."""
    eos = tokenizer.eos_token_id
    rows, dropped = [], 0
    for record in records:
        if "completion" in record:
            prompt = tokenizer(record["prompt"])["input_ids"]
            completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        else:
            prompt, completion = [], tokenizer(record["text"])["input_ids"]
        if eos is not None:
            completion = completion + [eos]
        ids = (prompt + completion)[:max_length]
        labels = ([-100] * len(prompt) + completion)[:max_length]
        if not any(label != -100 for label in labels[1:]):  # labels[0] is never a target
            dropped += 1
            continue
        rows.append({"input_ids": ids, "labels": labels, "signal_id": record.get("signal_id", default_signal_id)})
    return rows, dropped


def collate_sft(rows: list[dict], pad_id: int, with_signal_ids: bool = False) -> dict:
    """Right-padded batch: input_ids, attention_mask, labels (-100 on prompt and padding), optionally signal_ids."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        attention_mask[i, :n] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if with_signal_ids:
        batch["signal_ids"] = torch.tensor([r["signal_id"] for r in rows], dtype=torch.long)
    return batch
