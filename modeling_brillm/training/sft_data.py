"""Fine-tuning data: prompt/completion records (TRL's SFT convention) or plain text, tokenized with the loss on the
completion only, and a small built-in prompt/completion set made from Python's own documentation.

Records (one JSON object per line of a .jsonl file, a list of them in a .json file, or one text per line of a .txt):
  {"prompt": "...", "completion": "..."}   loss on the completion tokens only (and the end-of-sequence token)
  {"text": "..."}                          plain text: loss on every token after the first
Either kind may carry `"signal_id": k` (the learned start signal of its task; `start_signal="learned"` models).

The prompt and the completion are joined as TRL does (prompt + completion, then EOS), but each part is tokenized
on its own: the prompt gives exactly the tokens a user's prompt gives at generation time and the boundary between
the two is exact (TRL tokenizes the joined text and only warns when a merge crosses the boundary). Labels are the
input ids with -100 on the prompt; the model shifts them inside, so the first scored transition is the last prompt
token → the first completion token.
"""

from __future__ import annotations

import json
import os
import re

from .errors import UsageError

__all__ = ["SFTDataError", "builtin_pairs", "load_records", "check_records", "tokenize_records", "collate_sft",
           "split_records"]


class SFTDataError(UsageError, ValueError):
    """Unusable fine-tuning data (a missing field, an empty file): the message names the problem and the fix."""


# ------------------------------------------------------------------------------------------------ built in
_HEADING = re.compile(r"^\s*([*=~^#-])\1{3,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'][.!?])\s+(?=[A-Z\"'(])")


def builtin_pairs() -> list[dict]:
    """Topic/summary pairs from `pydoc_data.topics` (shipped with CPython, so no download): for every section
    heading of the documentation, the prompt names the heading and the completion is the first sentence of the
    prose under it (5 to 40 words). Deterministic: sorted topics, document order, repeated headings dropped.

        {"prompt": "Topic: The assert statement\\nSummary:", "completion": " Assert statements are a convenient ..."}
    """
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
    """Records from a .jsonl / .json / .txt file (see the module docstring), checked with `check_records`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SFTDataError(f"{path}: no such file.")
    extension = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8") as f:
        if extension in (".txt", ".text"):
            records = [{"text": line.rstrip("\n")} for line in f if line.strip()]
        elif extension == ".jsonl":
            records = []
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SFTDataError(f"{path}, line {number}: not valid JSON ({err.msg}); a .jsonl file holds one "
                                       "JSON object per line.") from None
        elif extension == ".json":
            try:
                records = json.load(f)
            except json.JSONDecodeError as err:
                raise SFTDataError(f"{path}: not valid JSON ({err.msg}).") from None
            if isinstance(records, dict) and isinstance(records.get("data"), list):
                records = records["data"]
            if not isinstance(records, list):
                raise SFTDataError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}}).")
        else:
            raise SFTDataError(f"{path}: unknown file extension {extension or '(none)'!r}; use .jsonl (one "
                               "{\"prompt\": ..., \"completion\": ...} object per line), .json (a list of them) "
                               "or .txt (one plain text per line).")
    return check_records(records, path)


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
    """Token ids, completion-only labels and signal id of every record; (rows, records dropped).

    prompt/completion: ids = tokenizer(prompt) (its special tokens, e.g. BOS) + tokenizer(completion, no special
    tokens) + [EOS]; labels -100 on the prompt. text: ids = tokenizer(text) + [EOS], every token labelled.
    Rows longer than `max_length` are cut at the end; a row left with no scored transition is dropped.
    """
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
    import torch

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
