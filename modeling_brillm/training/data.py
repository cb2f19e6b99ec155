"""Training data: reading files, the Hub or the embedded corpus, the validation split, sentence splitting, the
`datasets.map` functions that cut blocks, the tokenizer, and the collate / target-count helpers of the loop."""

from __future__ import annotations

import math
import os
import re
import sys
import time

from .errors import UsageError

HELD_OUT = "held out for validation"  # in load_raw_data's description when the validation texts were split off
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def file_builder(path: str, flag: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_BUILDERS:
        raise UsageError(
            f"--{flag} {path}: unknown file extension {extension or '(none)'!r}; use .txt/.text (one text per "
            "line), .json/.jsonl (records with a text field) or .csv (a text column)."
        )
    return FILE_BUILDERS[extension]


# A line of the documentation text that holds no language, whole: a reST section adornment (an underline or overline
# is one punctuation character repeated, any of reST's 32), a rule mixing the usual adornment characters (=-=-),
# or the ~~^~~ markers under a traceback's code line (the docs of newer Pythons show them: 3.13.0 has two).
_NO_LANGUAGE = re.compile(r"([!-/:-@\[-`{-~])\1{3,}|[-=~^*#]{4,}|[~^]{2,}")


def doc_paragraphs(text: str) -> list[str]:
    """The paragraphs (blank-line separated) of reST-derived documentation text, with the lines that hold no
    language removed (_NO_LANGUAGE); paragraphs left empty are dropped. Grid-table borders
    (+----+) and code are kept: they are part of the text a user reads."""
    out = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in paragraph.split("\n")
                 if not _NO_LANGUAGE.fullmatch(line.strip())]
        paragraph = "\n".join(lines).strip("\n")
        if paragraph.strip():
            out.append(paragraph)
    return out


def embedded_corpus() -> list[str]:
    """The English documentation text inside every CPython install (`pydoc_data.topics`), one paragraph per
    text, in a fixed order: a corpus that exists offline on any machine (whose reST markup differs by version:
    `doc_paragraphs` cleans what any of them holds)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        raise UsageError(
            "no data given and this Python has no pydoc_data (the built-in corpus); pass --train_file."
        ) from None
    return [paragraph for key in sorted(topics) for paragraph in doc_paragraphs(topics[key])]


def held_out_indices(n: int, percentage: float) -> list[int]:
    """Every k-th item, spread evenly, `percentage` % of `n` (deterministic, the same for any process count)."""
    if percentage <= 0:
        return []
    return [i for i in range(n) if math.floor((i + 1) * percentage / 100) > math.floor(i * percentage / 100)]


def split_validation(dataset, percentage: float):
    """(train, validation) of a datasets.Dataset: the held-out rows and the rest."""
    held = held_out_indices(len(dataset), percentage)
    if not held:
        return dataset, None
    held_set = set(held)
    rest = [i for i in range(len(dataset)) if i not in held_set]
    return dataset.select(rest), dataset.select(held)


def first_invalid_utf8(path, chunk_bytes: int = 1 << 24) -> tuple[int, int, bool] | None:
    """(line, byte offset, whether the file ends there) of the first byte of `path` that is not valid UTF-8, or
    None when the whole file is; read in chunks, so any size fits in memory."""
    import codecs

    offset = line = 0  # bytes decoded and newlines among them, before `data`
    pending = b""  # a multi-byte character cut by the chunk boundary
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as err:
                at_end = err.reason == "unexpected end of data" and not handle.read(1)
                return line + data.count(b"\n", 0, err.start) + 1, offset + err.start, at_end
            if not chunk:
                return None
            line, offset, pending = line + data.count(b"\n", 0, used), offset + used, data[used:]


def utf8_problem(path) -> str | None:
    """One line naming where `path` stops being UTF-8 and how to fix it, or None when it is valid UTF-8."""
    found = first_invalid_utf8(path)
    if found is None:
        return None
    line, offset, at_end = found
    where = f"{path}: line {line}, byte offset {offset}"
    if at_end:
        return (f"{where}: the file ends inside a multi-byte UTF-8 character (its last line was cut); drop that "
                f"line (head -n -1 {path} > fixed.txt) or restore the file's end.")
    with open(path, "rb") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
    return (f"{where}: byte 0x{byte:02x} is not valid UTF-8; re-encode the file as UTF-8 (iconv -f <its encoding> "
            f"-t utf-8 {path} > fixed.txt) or remove the bad bytes.")


def load_raw_data(args):
    """(DatasetDict with "train" and "validation" (may be missing), a sentence naming the data)."""
    import datasets

    if args.dataset_name:
        try:
            raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        except Exception as err:  # offline, unknown name, ...: say so in one line
            raise UsageError(
                f"could not load the dataset {args.dataset_name!r}"
                + (f" ({args.dataset_config_name})" if args.dataset_config_name else "")
                + f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Without network access "
                "pass --train_file, or no data flag for the built-in corpus."
            ) from None
        if "train" not in raw:
            raise UsageError(f"dataset {args.dataset_name!r} has no 'train' split (splits: {list(raw)}).")
        description = (f"Hub dataset {args.dataset_name}"
                       + (f"/{args.dataset_config_name}" if args.dataset_config_name else ""))
    elif args.train_file:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        builder = file_builder(args.train_file, "train_file")
        if args.validation_file and file_builder(args.validation_file, "validation_file") != builder:
            raise UsageError("--train_file and --validation_file must have the same format.")
        try:
            raw = datasets.load_dataset(builder, data_files=files)
        except Exception as err:
            for path in files.values():  # the usual cause, found only on failure: name the file, line and byte
                problem = utf8_problem(path)
                if problem:
                    raise UsageError(problem) from None
            raise UsageError(
                f"could not read {', '.join(files.values())} as {builder}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            ) from None
        description = (f"file {args.train_file}"
                       + (f" (validation: {args.validation_file})" if args.validation_file else ""))
    else:
        texts = embedded_corpus()
        raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})})
        description = (f"the built-in corpus: Python's documentation text (pydoc_data.topics, {len(texts)} paragraphs, "
                       f"{sum(map(len, texts)):,} characters, Python {sys.version.split()[0]})")

    for split in list(raw):
        if args.text_column not in raw[split].column_names:
            raise UsageError(
                f"the {split} data has no {args.text_column!r} column (columns: {raw[split].column_names}); "
                "pass --text_column NAME."
            )
    if "validation" not in raw:
        train, validation = split_validation(raw["train"], args.validation_split_percentage)
        raw = datasets.DatasetDict({"train": train, **({"validation": validation} if validation is not None else {})})
        if validation is not None:
            description += f"; every {100 / args.validation_split_percentage:.0f}th text {HELD_OUT}"
    return raw, description


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|(?<=[。！？])")


def split_sentences(text: str) -> list[str]:
    """Sentences of a text. Paragraphs (split at blank lines) have their wrapped lines joined and are cut after
    . ! ? (followed by white space) or 。！？; a paragraph whose lines are all indented (code, grammar
    listings) gives one sentence per line."""
    sentences = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if not lines:
            continue
        if len(lines) > 1 and all(line[:1].isspace() for line in lines):
            sentences.extend(line.strip() for line in lines)
            continue
        joined = " ".join(line.strip() for line in lines)
        sentences.extend(s.strip() for s in _SENTENCE_END.split(joined) if s and s.strip())
    return sentences


class SentenceBlocks:
    """datasets.map function: every sentence of at least two tokens becomes one block
    `<s> tokens </s>` truncated to `block_size`, right-padded with `<pad>` (attention_mask 0)."""

    def __init__(self, tokenizer, text_column: str, block_size: int):
        self.tokenizer, self.text_column, self.block_size = tokenizer, text_column, block_size
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    def __call__(self, batch):
        T = self.block_size
        sentences = [s for text in batch[self.text_column] if text for s in split_sentences(text)]
        encoded = self.tokenizer(sentences, add_special_tokens=False, verbose=False)["input_ids"] if sentences else []
        ids, masks = [], []
        for tokens in encoded:
            if len(tokens) < 2:
                continue  # no bigram of its own
            seq = ([self.bos] if self.bos is not None else []) + tokens + ([self.eos] if self.eos is not None else [])
            seq = seq[:T]
            ids.append(seq + [self.pad] * (T - len(seq)))
            masks.append([1] * len(seq) + [0] * (T - len(seq)))
        return {"input_ids": ids, "attention_mask": masks}


class DocumentTokens:
    """datasets.map function: every text of at least two tokens as `<s> tokens </s>`."""

    def __init__(self, tokenizer, text_column: str):
        self.tokenizer, self.text_column = tokenizer, text_column
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def __call__(self, batch):
        texts = [t for t in batch[self.text_column] if t and t.strip()]
        encoded = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        head = [self.bos] if self.bos is not None else []
        tail = [self.eos] if self.eos is not None else []
        return {"input_ids": [head + tokens + tail for tokens in encoded if len(tokens) >= 2]}


class ContiguousBlocks:
    """datasets.map function: concatenate token lists and cut full blocks of `block_size` (the tail of each
    map batch that does not fill a block is dropped, as in run_clm)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __call__(self, batch):
        T = self.block_size
        flat = [t for seq in batch["input_ids"] for t in seq]
        n = len(flat) // T * T
        return {"input_ids": [flat[i:i + T] for i in range(0, n, T)],
                "attention_mask": [[1] * T for _ in range(0, n, T)]}


def tokenize_splits(raw, tokenizer, args, accelerator):
    """Blocks of every split: DatasetDict of input_ids / attention_mask rows of length block_size."""
    common = dict(batched=True, num_proc=args.preprocessing_num_workers,
                  load_from_cache_file=not args.overwrite_cache)
    with accelerator.main_process_first():
        if args.block_mode == "sentence":
            missing = [name for name in ("bos_token", "eos_token", "pad_token") if getattr(tokenizer, name) is None]
            if tokenizer.pad_token is None:
                raise UsageError(
                    f"sentence blocks need a tokenizer with a pad token (this one lacks {missing}); use "
                    "--contiguous_blocks or a tokenizer built by tokenization.build_tokenizer."
                )
            blocks = raw.map(SentenceBlocks(tokenizer, args.text_column, args.block_size),
                             remove_columns=raw["train"].column_names, desc="Sentence blocks", **common)
        else:
            docs = raw.map(DocumentTokens(tokenizer, args.text_column), remove_columns=raw["train"].column_names,
                           desc="Tokenizing", **common)
            blocks = docs.map(ContiguousBlocks(args.block_size), remove_columns=docs["train"].column_names,
                              desc=f"Blocks of {args.block_size}", **common)
    return blocks


def text_stats(dataset, text_column) -> tuple[int, int]:
    """(texts, non-blank texts) of a raw split."""
    n = nonblank = 0
    for batch in dataset.iter(batch_size=1000):
        for text in batch[text_column]:
            n += 1
            nonblank += bool(text and text.strip())
    return n, nonblank


def block_sequences(dataset, pad_id):
    """The real tokens of every block (padding dropped), as int64 tensors, for bigram counting."""
    import numpy as np
    import torch

    for batch in dataset.with_format("numpy").iter(batch_size=4096):
        ids, mask = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
        for row, keep in zip(ids, mask):
            yield torch.from_numpy(row[keep.astype(bool)].astype(np.int64))


def collate(rows):
    import torch

    input_ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    attention_mask = torch.tensor([r["attention_mask"] for r in rows], dtype=torch.long)
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # padding is never a target
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_targets(batch):
    """Positions scored by the loss: a real token followed by a real, labelled token (as the model counts)."""
    labels, mask = batch["labels"], batch["attention_mask"]
    return ((labels[:, 1:] != -100) & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)).sum()



def load_tokenizer(args, tok_settings: dict, raw, out_dir, checkpoint, accelerator):
    """`--tokenizer_name`, else the tokenizer saved in the checkpoint being resumed, else one trained on the
    training texts (main process, saved into `out_dir`, then loaded by the others). Returns (tokenizer, line)."""
    from transformers import AutoTokenizer

    if args.tokenizer_name:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        except Exception as err:
            raise UsageError(f"could not load the tokenizer {args.tokenizer_name}: {err}") from None
        return tokenizer, f"tokenizer: {args.tokenizer_name} ({len(tokenizer)} tokens)"
    if checkpoint is not None and (checkpoint / "tokenizer").is_dir():
        tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
        return tokenizer, f"tokenizer: from the checkpoint {checkpoint} ({len(tokenizer)} tokens)"

    from tokenization import build_tokenizer

    line = None
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            started = time.time()
            try:
                # no model_max_length: tokenization's default is kept (the model enforces its own
                # max_position_embeddings), so tokenizing a long text with the saved tokenizer does not warn
                tokenizer = build_tokenizer(
                    raw["train"], kind=tok_settings["kind"], vocab_size=tok_settings["vocab_size"],
                    output_dir=str(out_dir), text_column=args.text_column,
                    min_frequency=tok_settings["min_frequency"],
                )
            except (ValueError, TypeError) as err:
                raise UsageError(f"could not train the tokenizer: {err}") from None
            line = (f"tokenizer: trained {tok_settings['kind']} with {len(tokenizer)} tokens (asked "
                    f"{tok_settings['vocab_size']}) in {time.time() - started:.1f}s, saved to {out_dir}")
        else:
            tokenizer = AutoTokenizer.from_pretrained(out_dir)
    return tokenizer, line


def prepare_blocks(raw, tokenizer, args, accelerator):
    """(training blocks, validation blocks or None, a line describing them): the blocks of every split, with the
    cases that leave nothing to train on refused and the validation set cut to `--max_eval_samples`."""
    blocks = tokenize_splits(raw, tokenizer, args, accelerator)
    train_blocks = blocks["train"]
    if len(train_blocks) == 0:
        if args.block_mode == "contiguous":
            raise UsageError(
                f"the training data gives no block of {args.block_size} tokens: every text is shorter than two "
                f"tokens or all of them together are shorter than --block_size {args.block_size}."
            )
        raise UsageError(
            "every training text is shorter than two tokens: there is no bigram to learn from. Give longer texts."
        )
    eval_blocks = blocks["validation"] if "validation" in blocks else None
    if eval_blocks is not None and args.max_eval_samples:
        eval_blocks = eval_blocks.select(range(min(args.max_eval_samples, len(eval_blocks))))
    if eval_blocks is not None and len(eval_blocks) == 0:
        eval_blocks = None
    real_tokens = sum(int(b["attention_mask"].sum()) for b in train_blocks.with_format("numpy").iter(batch_size=4096))
    line = (f"blocks: {len(train_blocks):,} training blocks of {args.block_size} ({args.block_mode} mode, "
            f"{real_tokens:,} real tokens, {1 - real_tokens / (len(train_blocks) * args.block_size):.0%} padding), "
            f"{len(eval_blocks) if eval_blocks is not None else 0:,} validation blocks")
    return train_blocks, eval_blocks, line
