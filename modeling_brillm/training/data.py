"""Training data: files, the Hub or the embedded corpus, the validation split, sentences, the `datasets.map` functions
that cut blocks, the tokenizer, and the collate and target-count helpers of the loop."""

import copy
import itertools
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenization import build_tokenizer
from tokenization.text_files import utf8_problem

from .checkpoints import TMP_PREFIX
from .errors import UsageError, first_line
from .errors import load_tokenizer as load_saved_tokenizer

HELD_OUT = "held out for validation"  # in load_raw_data's description when the validation texts were split off
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# A line of documentation text that holds no language: a reST adornment (one of reST's 32 punctuation characters
# repeated), a rule mixing the usual ones (=-=-), or the ~~^~~ markers under a traceback's code line (newer Pythons).
_NO_LANGUAGE = re.compile(r"([!-/:-@\[-`{-~])\1{3,}|[-=~^*#]{4,}|[~^]{2,}")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|(?<=[。！？])")
BYTES_PER_WORKER = 2_000_000  # text per datasets.map process: below it, starting a process costs more than it saves


def file_builder(path: str, flag: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_BUILDERS:
        raise UsageError(f"--{flag} {path}: unknown file extension {extension or '(none)'!r}; use .txt/.text (one text "
                         "per line), .json/.jsonl (records with a text field) or .csv (a text column).")
    return FILE_BUILDERS[extension]


def doc_paragraphs(text: str) -> list[str]:
    """The paragraphs of reST-derived text without the lines that hold no language (grid tables and code stay)."""
    kept = ("\n".join(line for line in paragraph.split("\n") if not _NO_LANGUAGE.fullmatch(line.strip())).strip("\n")
            for paragraph in re.split(r"\n[ \t]*\n", text))
    return [paragraph for paragraph in kept if paragraph.strip()]


def embedded_corpus() -> list[str]:
    """The English documentation inside every CPython install (`pydoc_data.topics`), a paragraph per text: offline."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        raise UsageError("no data given and this Python has no pydoc_data (the built-in corpus); pass --train_file.") \
            from None
    return [paragraph for key in sorted(topics) for paragraph in doc_paragraphs(topics[key])]


def held_out_indices(n: int, percentage: float) -> list[int]:
    """Every k-th item, spread evenly, `percentage` % of `n` (deterministic, the same for any process count)."""
    return [i for i in range(n) if math.floor((i + 1) * percentage / 100) > math.floor(i * percentage / 100)]


def load_raw_data(args):
    """(DatasetDict of "train" and maybe "validation", a line naming it) from the Hub, files or the built-in corpus."""
    raw, description = _hub_data(args) if args.dataset_name else _file_data(args) if args.train_file else _builtin()
    for split in list(raw):
        raw[split], skipped = records_with_text(raw[split], split, args)
        if skipped:
            description += f"; {skipped:,} {split} records without a {args.text_column!r} field left out"
    texts = pc.utf8_length(pc.utf8_trim_whitespace(raw["train"].data.column(args.text_column)))
    if not pc.any(pc.greater(texts, 0)).as_py():
        raise UsageError(f"the training data ({description}) contains no text: {len(raw['train'])} rows, all empty.")
    held = held_out_indices(len(raw["train"]), args.validation_split_percentage) if "validation" not in raw else []
    if held:
        rest = sorted(set(range(len(raw["train"]))) - set(held))
        raw = datasets.DatasetDict({"train": raw["train"].select(rest), "validation": raw["train"].select(held)})
        description += f"; every {100 / args.validation_split_percentage:.0f}th text {HELD_OUT}"
    return raw, description


def records_with_text(dataset, split: str, args):
    """(the records that have the text field, how many do not): refused unless --skip_records_without_text."""
    column = args.text_column
    if column not in dataset.column_names:
        raise UsageError(f"the {split} data has no {column!r} column (columns: {dataset.column_names}); pass "
                         "--text_column NAME.")
    kind = getattr(dataset.features[column], "dtype", None)
    if kind not in ("string", "large_string"):
        raise UsageError(f"the {split} data's {column!r} field holds {kind or dataset.features[column]}, not text; "
                         "pass --text_column NAME.")
    missing = pc.is_null(dataset.data.column(column))
    count = pc.sum(missing).as_py() or 0
    if count and not args.skip_records_without_text:
        first = pc.index(missing, True).as_py()
        raise UsageError(f"{count:,} of the {len(dataset):,} {split} records have no {column!r} field (the first: "
                         f"record {first + 1}); give every record one, or pass --skip_records_without_text to train "
                         "on the others.")
    if count:
        dataset = dataset.select(np.flatnonzero(~np.asarray(missing)))
    return dataset, count


def _hub_data(args):
    name, config = args.dataset_name, args.dataset_config_name
    try:
        raw = datasets.load_dataset(name, config)
    except Exception as err:  # offline, unknown name, ...: say so in one line
        raise UsageError(f"could not load the dataset {name!r}" + (f" ({config})" if config else "")
                         + f": {first_line(err)}. Without network access pass --train_file, or no data flag for "
                         "the built-in corpus.") from None
    if "train" not in raw:
        raise UsageError(f"dataset {name!r} has no 'train' split (splits: {list(raw)}).")
    return raw, f"Hub dataset {name}" + (f"/{config}" if config else "")


def _file_data(args):
    files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
    builder = file_builder(args.train_file, "train_file")
    if args.validation_file and file_builder(args.validation_file, "validation_file") != builder:
        raise UsageError("--train_file and --validation_file must have the same format.")
    try:
        raw = datasets.load_dataset(builder, data_files=files)
    except Exception as err:  # the usual cause, found only on failure: name the file, line and byte
        problem = next(filter(None, map(utf8_problem, files.values())), None)
        raise UsageError(problem or f"could not read {', '.join(files.values())} as {builder}: "
                         f"{first_line(err)}") from None
    return raw, f"file {args.train_file}" + (f" (validation: {args.validation_file})" if args.validation_file else "")


def _builtin():
    texts = embedded_corpus()
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})})
    return raw, (f"the built-in corpus: Python's documentation text (pydoc_data.topics, {len(texts)} paragraphs, "
                 f"{sum(map(len, texts)):,} characters, Python {sys.version.split()[0]})")


def split_sentences(text: str) -> list[str]:
    """Paragraphs with their wrapped lines joined, cut after . ! ? (and white space) or 。！？; a paragraph whose lines
    are all indented (code, grammar listings) gives one sentence per line."""
    sentences = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if len(lines) > 1 and all(line[:1].isspace() for line in lines):
            sentences.extend(line.strip() for line in lines)
            continue
        joined = " ".join(line.strip() for line in lines)
        sentences.extend(s.strip() for s in _SENTENCE_END.split(joined) if s and s.strip())
    return sentences


class TokenIds:
    """texts -> their token-id lists, exactly `tokenizer(texts, add_special_tokens=False)["input_ids"]`, through the
    Rust backend in one batch where the wrapper adds nothing (its offsets and dicts cost most of the time)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.backend = tokenizer, None
        base = getattr(PreTrainedTokenizerFast, "_encode_plus", None)
        if getattr(tokenizer, "is_fast", False) and base is not None and type(tokenizer)._encode_plus is base:
            backend = copy.deepcopy(tokenizer.backend_tokenizer)  # the settings the wrapper's call would make
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
            self.backend = backend

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is None:
            return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # fast: no offsets
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


class SentenceBlocks:
    """datasets.map function: every sentence of two tokens or more as one right-padded block `<s> tokens </s>`."""

    def __init__(self, tokenizer, text_column: str, block_size: int, arrays: bool = False):
        self.encode, self.text_column, self.block_size = TokenIds(tokenizer), text_column, block_size
        self.arrays = arrays
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    def __call__(self, batch):
        T = self.block_size
        sentences = [s for text in batch[self.text_column] if text for s in split_sentences(text)]
        encoded = [tokens for tokens in self.encode(sentences) if len(tokens) >= 2]  # shorter: no bigram of its own
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        head, tail = int(self.bos is not None), int(self.eos is not None)
        kept = np.minimum(lengths, T - head)  # tokens of each sentence that fit after <s>
        cut = np.fromiter(itertools.chain.from_iterable(tokens[:T - head] for tokens in encoded), dtype=np.int64,
                          count=int(kept.sum()))
        used = np.minimum(lengths + head + tail, T)  # real tokens of each block
        ids = np.full((len(encoded), T), self.pad if self.pad is not None else 0, dtype=np.int64)
        rows = np.repeat(np.arange(len(encoded)), kept)
        within = np.arange(len(cut)) - np.repeat(np.cumsum(kept) - kept, kept)  # 0..k-1 along each sentence's k tokens
        ids[rows, head + within] = cut
        if head:
            ids[:, 0] = self.bos
        if tail:
            fits = lengths + head + tail <= T
            ids[np.flatnonzero(fits), used[fits] - 1] = self.eos
        mask = (np.arange(T) < used[:, None]).astype(np.int64)
        if self.arrays:
            return {"input_ids": ids, "attention_mask": mask}
        return {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}


def document_tokens(batch, encode: TokenIds, text_column: str):
    """datasets.map function: every text of at least two tokens as `<s> tokens </s>`."""
    bos, eos = encode.tokenizer.bos_token_id, encode.tokenizer.eos_token_id
    head, tail = ([bos] if bos is not None else []), ([eos] if eos is not None else [])
    encoded = encode([t for t in batch[text_column] if t and t.strip()])
    return {"input_ids": [head + tokens + tail for tokens in encoded if len(tokens) >= 2]}


def contiguous_blocks(batch, block_size: int):
    """datasets.map function: token lists concatenated and cut into full blocks (a batch's tail is dropped: run_clm)."""
    column, T = batch["input_ids"], block_size
    if hasattr(column, "type"):  # arrow: flattened without a Python int per token
        flat = np.asarray(pc.list_flatten(column), dtype=np.int64)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(column), dtype=np.int64)
    n = len(flat) // T
    return {"input_ids": flat[:n * T].reshape(n, T), "attention_mask": np.ones((n, T), dtype=np.int64)}


def map_workers(dataset, requested: int | None) -> int | None:
    """`--preprocessing_num_workers`, else a process per core but at most one per BYTES_PER_WORKER (None: this one)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    table = dataset.data  # a selection (the held-out split) is a share of its table's rows
    size = table.nbytes * len(dataset) // max(table.num_rows, 1)
    workers = min(cores, size // BYTES_PER_WORKER, len(dataset))
    return workers if workers > 1 else None


def _map(dataset, function, workers, args, desc, **kw):
    """`dataset.map(function, batched=True)` on `workers` processes (None: this one), where `tokenizers` runs one
    thread per process (they share the cores) and does not warn of the fork."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    if workers:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return dataset.map(function, batched=True, num_proc=workers, load_from_cache_file=not args.overwrite_cache,
                           remove_columns=dataset.column_names, desc=desc, **kw)
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def tokenize_splits(raw, tokenizer, args, accelerator):
    """Blocks of every split, tokenized on `map_workers` processes (contiguous blocks cut here: the same for any)."""
    if args.block_mode == "sentence" and tokenizer.pad_token is None:
        missing = [name for name in ("bos_token", "eos_token", "pad_token") if getattr(tokenizer, name) is None]
        raise UsageError(f"sentence blocks need a tokenizer with a pad token (this one lacks {missing}); use "
                         "--contiguous_blocks or a tokenizer built by tokenization.build_tokenizer.")
    blocks = {}
    with accelerator.main_process_first():
        for split, dataset in raw.items():
            workers = map_workers(dataset, args.preprocessing_num_workers)
            if args.block_mode == "sentence":
                cut = SentenceBlocks(tokenizer, args.text_column, args.block_size, arrays=True)
                blocks[split] = _map(dataset, cut, workers, args, "Sentence blocks")
            else:
                docs = _map(dataset, document_tokens, workers, args, "Tokenizing",
                            fn_kwargs={"encode": TokenIds(tokenizer), "text_column": args.text_column})
                full = _map(docs.with_format("arrow"), contiguous_blocks, None, args, f"Blocks of {args.block_size}",
                            fn_kwargs={"block_size": args.block_size})
                blocks[split] = full.with_format(None)
    return datasets.DatasetDict(blocks)


def block_sequences(dataset, pad_id):
    """The real tokens of every block (padding dropped) as int64 tensors: views of one tensor per 4096 blocks."""
    for batch in dataset.with_format("arrow").iter(batch_size=4096):
        ids = np.asarray(pc.list_flatten(batch["input_ids"]), dtype=np.int64)
        mask = np.asarray(pc.list_flatten(batch["attention_mask"])).astype(bool).reshape(batch.num_rows, -1)
        yield from torch.from_numpy(ids[mask.reshape(-1)]).split(mask.sum(1).tolist())


def collate(rows):
    input_ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    attention_mask = torch.tensor([r["attention_mask"] for r in rows], dtype=torch.long)
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # padding is never a target
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_targets(batch):
    """Positions scored by the loss: a real token followed by a real, labelled token (as the model counts)."""
    labels, mask = batch["labels"], batch["attention_mask"]
    return ((labels[:, 1:] != -100) & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)).sum()


def load_tokenizer(args, tok_settings: dict, raw, out_dir, checkpoint, accelerator):
    """`--tokenizer_name`, else the resumed checkpoint's, else one trained on the training texts (main process; with
    several processes shared through a temporary folder in `out_dir`). Returns (tokenizer, line)."""
    if args.tokenizer_name:
        tokenizer = load_saved_tokenizer(args.tokenizer_name, "pass a folder that holds a saved tokenizer")
        return tokenizer, f"tokenizer: {args.tokenizer_name} ({len(tokenizer)} tokens)"
    if checkpoint is not None and (checkpoint / "tokenizer").is_dir():
        tokenizer = load_saved_tokenizer(checkpoint / "tokenizer", "resume from another checkpoint")
        return tokenizer, f"tokenizer: from the checkpoint {checkpoint} ({len(tokenizer)} tokens)"
    shared = Path(out_dir) / f"{TMP_PREFIX}tokenizer" if accelerator.num_processes > 1 else None
    started = time.time()
    with accelerator.main_process_first():
        if not accelerator.is_main_process:
            tokenizer = AutoTokenizer.from_pretrained(shared)
        else:
            try:  # no model_max_length: the model enforces its own max_position_embeddings, a long text does not warn
                tokenizer = build_tokenizer(raw["train"], kind=tok_settings["kind"], output_dir=shared,
                                            vocab_size=tok_settings["vocab_size"], text_column=args.text_column,
                                            min_frequency=tok_settings["min_frequency"])
            except (ValueError, TypeError) as err:
                raise UsageError(f"could not train the tokenizer: {err}") from None
    if shared is not None:
        accelerator.wait_for_everyone()  # every process has read it
        if accelerator.is_main_process:
            shutil.rmtree(shared)
    return tokenizer, (f"tokenizer: trained {tok_settings['kind']} with {len(tokenizer)} tokens (asked "
                       f"{tok_settings['vocab_size']}) in {time.time() - started:.1f}s")


def scored_tokens(blocks) -> int:
    """The positions of these blocks the loss scores: every real token but each block's first."""
    masks = (np.asarray(b["attention_mask"]) for b in blocks.with_format("numpy").iter(batch_size=4096))
    return sum(int(mask.sum()) - int(mask[:, 0].sum()) for mask in masks)


def prepare_blocks(raw, tokenizer, args, accelerator):
    """(training blocks, validation blocks or None, a line describing them); data that gives no block is refused."""
    blocks = tokenize_splits(raw, tokenizer, args, accelerator)
    train_blocks = blocks["train"]
    if len(train_blocks) == 0 and args.block_mode == "contiguous":
        raise UsageError(f"the training data gives no block of {args.block_size} tokens: every text is shorter than "
                         f"two tokens or all of them together are shorter than --block_size {args.block_size}.")
    if len(train_blocks) == 0:
        raise UsageError("every training text is shorter than two tokens: there is no bigram to learn from. Give "
                         "longer texts.")
    eval_blocks = blocks.get("validation")
    if eval_blocks is not None and len(eval_blocks) == 0 and args.validation_file:
        raise UsageError(f"--validation_file {args.validation_file} gives no validation block (every text is shorter "
                         "than two tokens, or than --block_size in contiguous mode): give longer texts, or leave it "
                         "out to hold out training texts instead.")
    if eval_blocks is not None and args.max_eval_samples:
        eval_blocks = eval_blocks.select(range(min(args.max_eval_samples, len(eval_blocks))))
    eval_blocks = eval_blocks or None
    real_tokens = sum(int(b["attention_mask"].sum()) for b in train_blocks.with_format("numpy").iter(batch_size=4096))
    line = (f"blocks: {len(train_blocks):,} training blocks of {args.block_size} ({args.block_mode} mode, "
            f"{real_tokens:,} real tokens, {1 - real_tokens / (len(train_blocks) * args.block_size):.0%} padding), "
            f"{len(eval_blocks or ()):,} validation blocks")
    return train_blocks, eval_blocks, line
