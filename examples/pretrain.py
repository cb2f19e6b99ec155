#!/usr/bin/env python
"""Pretrain a BriLLM graph language model with `accelerate launch`.

The flags follow transformers' `run_clm_no_trainer.py` wherever the concept is the same; the BriLLM-specific
ones choose the tokenizer, the graph and the loss. What one run does, in order:

1. data: `--train_file`/`--validation_file` (.txt/.text one text per line, .json/.jsonl records, .csv rows),
   or `--dataset_name` from the Hub, or, with neither, the English documentation text embedded in every
   CPython install (`pydoc_data.topics`), so the script runs offline anywhere;
2. tokenizer: `--tokenizer_name` (a saved tokenizer folder) or one trained on the training text with
   `tokenization.build_tokenizer` (byte-level BPE or characters) and saved into `--output_dir`;
3. blocks of `--block_size` tokens (`datasets.map`, batched and cached): one sentence per block
   (`<s> sentence </s>`, truncated, padded with `<pad>` that is masked out of the loss) or contiguous blocks;
4. the graph: the sparse bigram graph of the training blocks (`--min_bigram_count`) or the dense one; the
   parameter count and the training memory are estimated first, and a model that cannot fit is refused;
5. AdamW (betas 0.9/0.999, eps 1e-8, the paper's), warmup schedule, gradient accumulation and clipping through
   accelerate, periodic validation perplexity, atomic checkpoints that resume exactly;
6. at the end: a Hugging Face folder (`save_pretrained`, safetensors, with the model's code), the validation
   perplexity, a few greedy and sampled continuations, and `--push_to_hub` if asked.

Examples:

    accelerate launch --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \\
        --config demo --output_dir outputs/demo
    accelerate launch --config_file configuration/accelerate/gpu8_ddp.yaml examples/pretrain.py \\
        --config brillm-en --train_file wiki_en.txt --output_dir outputs/brillm-en

Every optimizer step appends `{"step", "loss", "lr", "tokens", ...}` to `<output_dir>/train_log.jsonl` (and
every evaluation `{"step", "eval_loss", "perplexity"}`); the loss of a step is the token-weighted mean over the
whole global batch, so it is the same number whatever the number of processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = REPO_ROOT / "configuration" / "models"
LOG_NAME = "train_log.jsonl"
SUMMARY_NAME = "pretrain_summary.json"
STATE_NAME = "train_state.json"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
MEMORY_ENV = "BRILLM_AVAILABLE_MEMORY_GB"

# Prompts for the embedded corpus (Python's documentation); other data uses the start of validation sentences.
DEFAULT_PROMPTS = ["The return value", "An exception is raised", "If the object", "A class definition"]


class UsageError(Exception):
    """A problem the user can fix (bad flag, missing data, a model too big): printed as one line, no traceback."""


# ------------------------------------------------------------------------------------------------ presets
# Fields of BriLLMConfig a preset may set in its "model" section (vocab_size comes from the tokenizer, num_edges
# from the graph, the special ids from the tokenizer).
MODEL_FIELDS = {
    "node_size", "max_position_embeddings", "graph", "position_encoding", "initializer_range", "loss_type",
    "num_negatives", "negative_sampling",
}
MODEL_DEFAULTS = {"node_size": 32, "max_position_embeddings": 512, "graph": "sparse", "loss_type": "exact"}
TOKENIZER_FIELDS = {"kind", "vocab_size", "min_frequency"}
TOKENIZER_DEFAULTS = {"kind": "bpe", "vocab_size": 4000, "min_frequency": 2}
# Flags a preset may set in its "training" section, with the value used when neither preset nor flag sets them.
TRAINING_DEFAULTS = {
    "block_size": 32,
    "block_mode": "sentence",
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 32,
    "learning_rate": 5e-2,
    "weight_decay": 0.0,
    "num_train_epochs": 1,
    "max_train_steps": None,
    "gradient_accumulation_steps": 1,
    "lr_scheduler_type": "linear",
    "num_warmup_steps": 0,
    "max_grad_norm": 1.0,
    "min_bigram_count": 1,
    "validation_split_percentage": 5,
    "max_eval_samples": None,
    "eval_steps": None,
    "checkpointing_steps": None,
    "checkpoints_total_limit": None,
    "num_generations": 3,
    "max_new_tokens": 20,
    "seed": 42,
    "torch_threads": None,
}
# Flags that override a field of the preset's "model" / "tokenizer" section: flag -> (section, field).
FLAG_TO_FIELD = {
    "node_size": ("model", "node_size"),
    "loss": ("model", "loss_type"),
    "num_negatives": ("model", "num_negatives"),
    "negatives": ("model", "negative_sampling"),
    "vocab_size": ("tokenizer", "vocab_size"),
    "tokenizer_kind": ("tokenizer", "kind"),
    "tokenizer_min_frequency": ("tokenizer", "min_frequency"),
}


def known_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name_or_path: str | None) -> dict:
    """The preset's sections {"model", "tokenizer", "training"}; `name_or_path` is a name in
    configuration/models/ or a path to a JSON file."""
    if name_or_path is None:
        return {"model": {}, "tokenizer": {}, "training": {}}
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.is_file()):
        path = PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise UsageError(
            f"unknown preset {name_or_path!r}: known presets are {', '.join(known_presets()) or '(none)'} "
            f"(in {PRESET_DIR}), or pass the path of a JSON file."
        )
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise UsageError(f"preset {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"preset {path} must hold a JSON object with 'model', 'tokenizer' and 'training' sections.")
    allowed = {"model": MODEL_FIELDS, "tokenizer": TOKENIZER_FIELDS, "training": set(TRAINING_DEFAULTS)}
    preset = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue  # comments
        if key not in allowed:
            raise UsageError(f"preset {path}: unknown section {key!r}; sections are {sorted(allowed)}.")
        if not isinstance(value, dict):
            raise UsageError(f"preset {path}: section {key!r} must be a JSON object.")
        unknown = sorted(k for k in value if not k.startswith("_") and k not in allowed[key])
        if unknown:
            raise UsageError(f"preset {path}: unknown {key} field(s) {unknown}; allowed: {sorted(allowed[key])}.")
        preset[key] = {k: v for k, v in value.items() if not k.startswith("_")}
    for key in allowed:
        preset.setdefault(key, {})
    return preset


def resolve_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """Merge built-in defaults < preset < flags. Fills the training flags on `args` in place and returns the
    model config fields and the tokenizer settings."""
    preset = load_preset(args.config)
    model = {**MODEL_DEFAULTS, **preset["model"]}
    tokenizer = {**TOKENIZER_DEFAULTS, **preset["tokenizer"]}
    sections = {"model": model, "tokenizer": tokenizer}
    for flag, (section, field) in FLAG_TO_FIELD.items():
        value = getattr(args, flag)
        if value is not None:
            sections[section][field] = value
    if args.dense_graph:
        model["graph"] = "dense"
    for name, default in TRAINING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset["training"].get(name, default))
    return model, tokenizer


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pretrain BriLLM (a graph language model) with accelerate. Values not given on the command "
        "line come from --config (a preset), then from built-in defaults (the paper's setup).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    S = argparse.SUPPRESS
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", help="A dataset on the Hugging Face Hub (needs network access).")
    g.add_argument("--dataset_config_name", help="Its configuration name.")
    g.add_argument("--train_file", help="Training text: .txt/.text (one text per line), .json/.jsonl, .csv.")
    g.add_argument("--validation_file", help="Validation text, same formats as --train_file.")
    g.add_argument("--text_column", default="text", help="Column/field holding the text in json/csv/hub data.")
    g.add_argument("--validation_split_percentage", type=float, default=None,
                   help="Share of the training texts held out for validation when there is no validation set "
                   "(every k-th text, deterministic). [5]")
    g.add_argument("--max_eval_samples", type=int, default=None, help="Evaluate on at most this many blocks.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="Processes for datasets.map.")
    g.add_argument("--overwrite_cache", action="store_true", help="Recompute the tokenized datasets.")
    g.add_argument("--block_size", type=int, default=None, help="Tokens per training block (the paper: 32). [32]")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--sentence_blocks", dest="block_mode", action="store_const", const="sentence", default=None,
                      help="One sentence per block: <s> sentence </s>, truncated to --block_size, padding masked "
                      "(the paper's setup; the default).")
    mode.add_argument("--contiguous_blocks", dest="block_mode", action="store_const", const="contiguous",
                      help="Concatenate all texts (<s> text </s> ...) and cut blocks of --block_size tokens.")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer_name", help="A saved Hugging Face tokenizer folder; else one is trained.")
    g.add_argument("--tokenizer_kind", choices=["bpe", "char"], default=None,
                   help="Tokenizer to train: byte-level BPE (English) or characters (Chinese). [bpe]")
    g.add_argument("--vocab_size", type=int, default=None, help="Vocabulary (= graph nodes) to train. [4000]")
    g.add_argument("--tokenizer_min_frequency", type=int, default=None, help="Min count of a merge/character. [2]")

    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"A preset name ({', '.join(known_presets())}) or a JSON path.")
    g.add_argument("--node_size", type=int, default=None, help="Neurons per node, d (the paper: 32).")
    graph = g.add_mutually_exclusive_group()
    graph.add_argument("--min_bigram_count", type=int, default=None,
                       help="Sparse graph: real edges for the bigrams seen at least this often. [1]")
    graph.add_argument("--dense_graph", action="store_true", default=None,
                       help="Every ordered pair of nodes is a real edge (V^2 edges: 16.9B parameters at V=4000).")
    g.add_argument("--loss", choices=["exact", "sampled"], default=None,
                   help="exact: cross-entropy over all V nodes; sampled: the release's (true + K negatives).")
    g.add_argument("--num_negatives", type=int, default=None, help="K negatives of the sampled loss. [400]")
    g.add_argument("--negatives", choices=["frequency", "uniform"], default=None,
                   help="Negatives of the sampled loss: most frequent successors, or uniform.")

    g = p.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=int, default=None, help="Blocks per process. [32]")
    g.add_argument("--per_device_eval_batch_size", type=int, default=None, help="[32]")
    g.add_argument("--learning_rate", type=float, default=None, help="Peak learning rate (the paper: 5e-2).")
    g.add_argument("--weight_decay", type=float, default=None, help="AdamW weight decay on edge matrices. [0]")
    g.add_argument("--num_train_epochs", type=int, default=None, help="[1]")
    g.add_argument("--max_train_steps", type=int, default=None, help="Optimizer steps; overrides epochs.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=None, help="[1]")
    g.add_argument("--lr_scheduler_type", default=None,
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                            "constant_with_warmup", "inverse_sqrt", "warmup_stable_decay"], help="[linear]")
    g.add_argument("--num_warmup_steps", type=int, default=None, help="Linear warmup steps. [0]")
    g.add_argument("--max_grad_norm", type=float, default=None, help="Clip the gradient norm (0: off). [1.0]")
    g.add_argument("--optimizer", choices=["adamw", "sparse_adamw"], default="adamw",
                   help="adamw: torch AdamW on dense gradients; sparse_adamw: modeling_brillm.optimization."
                   "SparseAdamW on sparse edge gradients (single process only).")
    g.add_argument("--seed", type=int, default=None, help="Seed of initialisation and data order. [42]")
    g.add_argument("--torch_threads", type=int, default=None,
                   help="CPU threads per process (torch.set_num_threads). BriLLM's steps are many small matrix "
                   "products, which extra threads barely speed up and slow down a lot on a busy machine. "
                   "[torch's default]")
    g.add_argument("--eval_steps", type=int, default=None, help="Validate every N optimizer steps.")
    g.add_argument("--checkpointing_steps", default=None,
                   help="Save the training state every N steps, or 'epoch' at the end of every epoch.")
    g.add_argument("--checkpoints_total_limit", type=int, default=None, help="Keep only the last N checkpoints.")
    g.add_argument("--resume_from_checkpoint", help="A checkpoint folder, or 'latest' (newest in --output_dir).")
    g.add_argument("--output_dir", default="outputs/pretrain", help="Where the model, tokenizer, logs go.")
    g.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers (--report_to).")
    g.add_argument("--report_to", default="all", help="Trackers: tensorboard, wandb, ... or 'all'.")

    g = p.add_argument_group("after training")
    g.add_argument("--num_generations", type=int, default=None, help="Prompts to continue at the end. [3]")
    g.add_argument("--max_new_tokens", type=int, default=None, help="Tokens per continuation. [20]")
    g.add_argument("--prompts", nargs="+", help="Prompts to continue (default: built in or from validation).")
    g.add_argument("--push_to_hub", action="store_true", help="Upload the final folder to the Hub.")
    g.add_argument("--hub_model_id", help="Repository name for --push_to_hub (default: output_dir's name).")
    g.add_argument("--hub_token", help="Token for --push_to_hub.")

    g.add_argument("--no_malloc_tuning", action="store_true",
                   help="On CPU (Linux/glibc) the script makes malloc keep freed memory (mallopt), which avoids "
                   "page-faulting the step's large temporaries back in every step; this turns that off.")
    # Hidden: for tests. Pretend this much memory is available; sleep after every optimizer step.
    p.add_argument("--available_memory_gb", type=float, default=None, help=S)
    p.add_argument("--step_sleep", type=float, default=0.0, help=S)
    return p.parse_args(argv)


def check_args(args, model_fields: dict):
    """Flag checks that need no data (after the preset is merged in)."""
    def positive(name, value=None):
        value = getattr(args, name) if value is None else value
        if value is None or value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}.")

    for name in ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "num_train_epochs", "min_bigram_count"):
        positive(name)
    for name in ("max_train_steps", "eval_steps", "checkpoints_total_limit", "max_eval_samples"):
        if getattr(args, name) is not None:
            positive(name)
    max_positions = model_fields.get("max_position_embeddings", 512)
    if args.block_size > max_positions:
        raise UsageError(
            f"--block_size {args.block_size} is beyond the model's max_position_embeddings={max_positions}: "
            f"BriLLM has {max_positions} learned position weights; use --block_size <= {max_positions}."
        )
    if args.block_size < 2:
        raise UsageError("--block_size must be at least 2 (a block needs one bigram).")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        try:
            args.checkpointing_steps = int(args.checkpointing_steps)
        except ValueError:
            raise UsageError(f"--checkpointing_steps must be a number or 'epoch', got {args.checkpointing_steps!r}.") from None
        positive("checkpointing_steps")
    if not 0 <= args.validation_split_percentage < 100:
        raise UsageError("--validation_split_percentage must be in [0, 100).")
    if args.validation_file and not (args.train_file or args.dataset_name):
        raise UsageError("--validation_file needs --train_file (or --dataset_name) too.")
    if args.train_file and args.dataset_name:
        raise UsageError("give either --train_file or --dataset_name, not both.")
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path is not None:
            file_builder(path, flag)
            if not os.path.isfile(path):
                raise UsageError(f"--{flag} {path}: no such file.")
            if os.path.getsize(path) == 0:
                raise UsageError(f"--{flag} {path} is empty: there is no text to train on.")
    if args.tokenizer_name and not os.path.isdir(args.tokenizer_name):
        raise UsageError(f"--tokenizer_name {args.tokenizer_name}: not a folder with a saved tokenizer.")


# ---------------------------------------------------------------------------------------------------- data
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def file_builder(path: str, flag: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_BUILDERS:
        raise UsageError(
            f"--{flag} {path}: unknown file extension {extension or '(none)'!r}; use .txt/.text (one text per "
            "line), .json/.jsonl (records with a text field) or .csv (a text column)."
        )
    return FILE_BUILDERS[extension]


def embedded_corpus() -> list[str]:
    """The English documentation text inside every CPython install (`pydoc_data.topics`), one paragraph per
    text, in a fixed order: a corpus that exists offline on any machine."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        raise UsageError(
            "no data given and this Python has no pydoc_data (the built-in corpus); pass --train_file."
        ) from None
    underline = re.compile(r"^\s*([*=~^#-])\1{3,}\s*$")  # reST heading underlines: no language in them
    texts = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n[ \t]*\n", topics[key]):
            lines = [line for line in paragraph.split("\n") if not underline.match(line)]
            paragraph = "\n".join(lines).strip("\n")
            if paragraph.strip():
                texts.append(paragraph)
    return texts


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
        description = f"Hub dataset {args.dataset_name}" + (f"/{args.dataset_config_name}" if args.dataset_config_name else "")
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
            raise UsageError(
                f"could not read {', '.join(files.values())} as {builder}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            ) from None
        description = f"file {args.train_file}" + (f" (validation: {args.validation_file})" if args.validation_file else "")
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
            description += f"; every {100 / args.validation_split_percentage:.0f}th text held out for validation"
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


# -------------------------------------------------------------------------------------------------- memory
def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def training_memory(num_params: int, strategy: str = "single", world_size: int = 1,
                    mixed_precision: str = "no") -> dict:
    """Bytes one process needs to train a model of `num_params` fp32 parameters with AdamW.

    single: parameters (4 B) + gradients (4 B) + AdamW's two moments (8 B) = 16 B per parameter.
    ddp:    the same plus DDP's gradient buckets (4 B).
    fsdp:   the 16 B sharded over `world_size` processes, plus the parameters and gradients gathered whole
            for the forward/backward (BriLLM is one module: the whole edge table is gathered), in the compute
            dtype (2 B with fp16/bf16, else 4 B).
    10% is added for activations and allocator slack.
    """
    parts = {}
    if strategy == "fsdp":
        parts["sharded params+grads+AdamW"] = 16 * num_params / max(world_size, 1)
        width = 2 if mixed_precision in ("fp16", "bf16") else 4
        parts["gathered params+grads"] = 2 * width * num_params
    else:
        parts["params"] = 4 * num_params
        parts["grads"] = 4 * num_params
        parts["AdamW moments"] = 8 * num_params
        if strategy == "ddp":
            parts["DDP buckets"] = 4 * num_params
    total = sum(parts.values()) * 1.1
    return {"total": total, "parts": parts}


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process instead of returning it to the OS.

    A BriLLM step allocates and frees the same large temporaries (candidate energies and their gradients, tens
    of MB) every step; above glibc's mmap threshold each is a fresh mmap, page-faulted in and unmapped again.
    On the demo that put ~40% of the wall time in the kernel (6.3M page faults in 40 steps); with these two
    settings the same run takes 16 s instead of 26 s. Linux/glibc only; elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def available_memory(accelerator, override_gb: float | None) -> tuple[float, str]:
    """(bytes this process may use, where the figure comes from)."""
    import torch

    if override_gb is None and os.environ.get(MEMORY_ENV):
        try:
            override_gb = float(os.environ[MEMORY_ENV])
        except ValueError:
            raise UsageError(f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r} is not a number of GB.") from None
    if override_gb is not None:
        return override_gb * 1024 ** 3, "set by --available_memory_gb / " + MEMORY_ENV
    device = accelerator.device
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free), f"free memory of {torch.cuda.get_device_name(device)}"
    try:
        import psutil

        avail = psutil.virtual_memory().available
        source = "available RAM (psutil)"
    except ImportError:
        avail = None
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        avail = int(line.split()[1]) * 1024
            source = "MemAvailable (/proc/meminfo)"
        except OSError:
            pass
        if avail is None:
            return float("inf"), "unknown (no psutil, no /proc/meminfo): not checked"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes if accelerator.num_processes else 1))
    if local > 1:
        return avail / local, f"{source} shared by {local} processes on this machine"
    return float(avail), source


def check_memory(config, accelerator, args) -> str:
    """Refuse (UsageError) a model whose training state cannot fit; return a line describing the estimate."""
    import torch
    from accelerate.utils import DistributedType

    P = config.num_parameters_formula()
    dist = accelerator.distributed_type
    strategy = "fsdp" if dist == DistributedType.FSDP else ("ddp" if accelerator.num_processes > 1 else "single")
    need = training_memory(P, strategy, accelerator.num_processes, accelerator.mixed_precision)
    have, source = available_memory(accelerator, args.available_memory_gb)
    if accelerator.num_processes > 1 and math.isfinite(have):  # every process must agree
        have = float(accelerator.gather(torch.tensor([have], dtype=torch.float64, device=accelerator.device)).min())
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need["parts"].items())
    line = (f"training memory estimate: {human_bytes(need['total'])} per process ({parts}, +10%); "
            f"available: {human_bytes(have)} ({source})")
    if need["total"] > have:
        what = "dense" if config.graph == "dense" else f"sparse ({config.num_edges:,} real edges)"
        raise UsageError(
            f"refusing to build the model: the {what} graph with V={config.vocab_size}, d={config.node_size} has "
            f"{P:,} parameters and training it needs about {human_bytes(need['total'])} per process ({parts}), "
            f"but only {human_bytes(have)} is available ({source}). Use a sparse graph (drop --dense_graph) and "
            "raise --min_bigram_count to keep only frequent bigrams, or lower --node_size / --vocab_size, or shard "
            "the model over GPUs with FSDP (configuration/accelerate/gpu8_fsdp.yaml)."
        )
    return line


# ---------------------------------------------------------------------------------------------- checkpoints
def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints (step_N folders holding train_state.json), oldest first."""
    found = []
    if os.path.isdir(output_dir):
        for entry in os.scandir(output_dir):
            match = CHECKPOINT_RE.match(entry.name)
            if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, STATE_NAME)):
                found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def resolve_checkpoint(args) -> Path | None:
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(args.output_dir)
        return found[-1][1] if found else None
    path = Path(args.resume_from_checkpoint)
    if not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {path}: no such folder.")
    if not (path / STATE_NAME).is_file():
        raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no {STATE_NAME}).")
    return path


def remove_dir(path: Path):
    """Delete a folder so that a crash midway never leaves something that looks like a checkpoint."""
    doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(accelerator, output_dir: str, step: int, state: dict, tokenizer, limit: int | None) -> Path:
    """accelerator.save_state into a temporary folder, then one rename: step_N is complete or absent."""
    final = Path(output_dir) / f"step_{step}"
    tmp = Path(output_dir) / f"{TMP_PREFIX}step_{step}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp / "tokenizer")
        with open(tmp / STATE_NAME, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            remove_dir(final)
        os.replace(tmp, final)
        if limit:
            for _, old in list_checkpoints(output_dir)[:-limit]:
                remove_dir(old)
    accelerator.wait_for_everyone()
    return final


def read_log(path) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# -------------------------------------------------------------------------------------------------- eval
def evaluate(model, dataloader, accelerator) -> tuple[float, float, int]:
    """(mean loss, perplexity, scored tokens) over the validation blocks: the full softmax over all V nodes
    (whatever the training loss), token-weighted, gathered over processes."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in dataloader:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        mask, labels = batch["attention_mask"], batch["labels"]
        targets = labels[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                              ignore_index=-100, reduction="none").view(targets.shape)
        per_row = torch.stack([nll.sum(1).double(), (targets != -100).sum(1).double()], 1)  # (B, 2)
        total += accelerator.gather_for_metrics(per_row).sum(0)
    model.train()
    loss_sum, count = float(total[0]), int(total[1])
    if count == 0:
        return float("nan"), float("nan"), 0
    loss = loss_sum / count
    return loss, math.exp(min(loss, 700.0)), count


def choose_prompts(args, raw_validation, used_builtin: bool) -> list[str]:
    if args.prompts:
        return args.prompts[: max(args.num_generations, len(args.prompts))]
    if used_builtin:
        return DEFAULT_PROMPTS[: args.num_generations]
    prompts = []
    if raw_validation is not None:
        for text in raw_validation[args.text_column]:
            for sentence in split_sentences(text or ""):
                words = sentence.split()
                if len(words) >= 4:
                    prompts.append(" ".join(words[:3]))
                elif len(sentence) >= 4 and len(words) == 1:  # e.g. Chinese: the first characters
                    prompts.append(sentence[:4])
                if len(prompts) >= args.num_generations:
                    return prompts
    return prompts


def generate_samples(model, tokenizer, prompts, args, device) -> list[dict]:
    import torch

    out = []
    for i, prompt in enumerate(prompts):
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            greedy = model.generate(**enc, do_sample=False, **common)
            torch.manual_seed(args.seed + i)
            sampled = model.generate(**enc, do_sample=True, top_k=40, temperature=0.8, **common)
        n = enc["input_ids"].shape[1]
        out.append({
            "prompt": prompt,
            "greedy": tokenizer.decode(greedy[0, n:], skip_special_tokens=True),
            "sampled": tokenizer.decode(sampled[0, n:], skip_special_tokens=True),
        })
    return out


# ------------------------------------------------------------------------------------------------- main
def run(args) -> int:
    model_fields, tok_settings = resolve_settings(args)
    check_args(args, model_fields)

    import datasets
    import torch
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, get_scheduler

    import modeling_brillm  # noqa: F401  (registers BriLLM with the Auto classes)
    from modeling_brillm import BriLLMConfig, BriLLMForCausalLM, build_sparse_graph

    # A multi-process launch on a machine without CUDA must use CPU/gloo: without cpu=True accelerate would
    # start every process as an independent single-process run.
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        cpu=multi and not torch.cuda.is_available(),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,  # stepped by hand, once per optimizer step, whatever the processes
        log_with=args.report_to if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    say = accelerator.print
    if multi and accelerator.num_processes == 1:
        raise UsageError("WORLD_SIZE > 1 but accelerate did not form a process group.")
    if (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") and os.environ.get("MASTER_PORT")
            and not multi and "LOCAL_RANK" not in os.environ):
        # accelerate's CPU launcher sets MASTER_PORT when asked for several processes but starts them only through
        # mpirun; without it this is one process, and silently training with a smaller global batch is worse.
        raise UsageError(
            "`accelerate launch --cpu --num_processes N` (N > 1) started ONE process: accelerate starts several CPU "
            "processes only through mpirun. Use `accelerate launch --config_file configuration/accelerate/cpu_2.yaml "
            "...` (torchrun + gloo), or `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`."
        )
    if accelerator.is_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    if args.torch_threads and accelerator.device.type == "cpu":
        torch.set_num_threads(args.torch_threads)
    kept = accelerator.device.type == "cpu" and not args.no_malloc_tuning and keep_freed_memory()
    W, G = accelerator.num_processes, args.gradient_accumulation_steps
    say(f"BriLLM pretraining: {W} process(es) [{accelerator.distributed_type.value}] on {accelerator.device}"
        + (f" ({torch.get_num_threads()} threads{', malloc keeps freed memory' if kept else ''})"
           if accelerator.device.type == "cpu" else "") + ", "
        f"mixed precision {accelerator.mixed_precision}, preset {args.config or '(none: built-in defaults)'}")

    out_dir = Path(args.output_dir)
    checkpoint = resolve_checkpoint(args)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        for entry in out_dir.glob(TMP_PREFIX + "*"):  # debris of a run killed while saving
            shutil.rmtree(entry, ignore_errors=True)
        if args.resume_from_checkpoint and checkpoint is None:
            say(f"--resume_from_checkpoint latest: no checkpoint in {out_dir}, starting from scratch.")
        if checkpoint is None:
            stale = list_checkpoints(out_dir)
            if stale:
                say(f"removing {len(stale)} checkpoint(s) of an earlier run in {out_dir} (this run starts over; "
                    "use --resume_from_checkpoint latest to continue one).")
                for _, path in stale:
                    remove_dir(path)
            if os.path.exists(out_dir / LOG_NAME):
                os.remove(out_dir / LOG_NAME)
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------- data and tokenizer
    raw, description = load_raw_data(args)
    say(f"data: {description}")
    n_texts, n_nonblank = text_stats(raw["train"], args.text_column)
    if n_nonblank == 0:
        raise UsageError(f"the training data ({description}) contains no text: {n_texts} rows, all empty.")

    if args.tokenizer_name:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        except Exception as err:
            raise UsageError(f"could not load the tokenizer {args.tokenizer_name}: {err}") from None
        say(f"tokenizer: {args.tokenizer_name} ({len(tokenizer)} tokens)")
    elif checkpoint is not None and (checkpoint / "tokenizer").is_dir():
        tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
        say(f"tokenizer: from the checkpoint {checkpoint} ({len(tokenizer)} tokens)")
    else:
        from tokenization import build_tokenizer

        with accelerator.main_process_first():
            if accelerator.is_main_process:
                started = time.time()
                try:
                    tokenizer = build_tokenizer(
                        raw["train"], kind=tok_settings["kind"], vocab_size=tok_settings["vocab_size"],
                        output_dir=str(out_dir), text_column=args.text_column,
                        min_frequency=tok_settings["min_frequency"],
                        model_max_length=model_fields.get("max_position_embeddings", 512),
                    )
                except (ValueError, TypeError) as err:
                    raise UsageError(f"could not train the tokenizer: {err}") from None
                say(f"tokenizer: trained {tok_settings['kind']} with {len(tokenizer)} tokens (asked "
                    f"{tok_settings['vocab_size']}) in {time.time() - started:.1f}s, saved to {out_dir}")
            else:
                tokenizer = AutoTokenizer.from_pretrained(out_dir)

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
    say(f"blocks: {len(train_blocks):,} training blocks of {args.block_size} ({args.block_mode} mode, "
        f"{real_tokens:,} real tokens, {1 - real_tokens / (len(train_blocks) * args.block_size):.0%} padding), "
        f"{len(eval_blocks) if eval_blocks is not None else 0:,} validation blocks")

    # ---------------------------------------------------------------- graph, memory check, model
    V = len(tokenizer)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, unk_token_id=tokenizer.unk_token_id)
    fields = {k: v for k, v in model_fields.items() if k != "graph"}
    try:
        if model_fields["graph"] == "dense":
            graph = None
            config = BriLLMConfig(vocab_size=V, graph="dense", **fields, **special)
        else:
            try:
                graph = build_sparse_graph(block_sequences(train_blocks, tokenizer.pad_token_id), V,
                                           min_count=args.min_bigram_count,
                                           ignore_ids=() if tokenizer.pad_token_id is None else (tokenizer.pad_token_id,))
            except ValueError as err:
                raise UsageError(f"cannot build the graph: {err}") from None
            config = BriLLMConfig(vocab_size=V, graph="sparse", num_edges=graph.num_edges, **fields, **special)
    except (ValueError, TypeError) as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from None
    P = config.num_parameters_formula()
    edges = config.num_edges
    say(f"graph: {config.graph}, V={V} nodes, {edges:,} real edges of {V * V:,} possible ({edges / (V * V):.2%})"
        + (f", bigrams seen >= {args.min_bigram_count} times" if graph is not None else "")
        + f"; d={config.node_size}; parameters {P:,} ({human_bytes(4 * P)} fp32)")
    say(check_memory(config, accelerator, args))

    model = BriLLMForCausalLM.from_graph(graph, config=config)
    sparse_opt = args.optimizer == "sparse_adamw"
    if sparse_opt:
        try:
            from modeling_brillm.optimization import SparseAdamW
        except ImportError:
            raise UsageError("--optimizer sparse_adamw needs modeling_brillm.optimization.SparseAdamW, "
                             "which this installation lacks; use --optimizer adamw.") from None
        if W > 1:
            raise UsageError("--optimizer sparse_adamw supports a single process only; use --optimizer adamw.")
        model.sparse_gradients = True
        if args.max_grad_norm:
            say("note: --optimizer sparse_adamw trains without gradient clipping (the norm of sparse row "
                "gradients would need them coalesced); --max_grad_norm is ignored.")

    # ---------------------------------------------------------------- loaders, optimizer, schedule
    train_loader = DataLoader(train_blocks, shuffle=True, collate_fn=collate, drop_last=True,
                              batch_size=args.per_device_train_batch_size)
    eval_loader = (DataLoader(eval_blocks, collate_fn=collate, batch_size=args.per_device_eval_batch_size)
                   if eval_blocks is not None else None)
    if len(train_blocks) < args.per_device_train_batch_size * W:
        raise UsageError(
            f"{len(train_blocks)} training blocks cannot fill one global batch of "
            f"{args.per_device_train_batch_size} x {W} process(es); lower --per_device_train_batch_size."
        )
    decay = [p for n, p in model.named_parameters() if n.endswith("weights")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weights")]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if sparse_opt:
        optimizer = SparseAdamW(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8)
    else:
        # torch's fused kernel: one pass over parameter, gradient and moments (7x faster than the default on CPU)
        fused = accelerator.device.type in ("cpu", "cuda") and accelerator.distributed_type.value != "DEEPSPEED"
        optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, fused=fused)

    if eval_loader is not None:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    else:
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    steps_per_epoch = math.ceil(len(train_loader) / G)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps, num_training_steps=args.max_train_steps)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        hparams = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("brillm_pretrain", {**hparams, **{f"model_{k}": v for k, v in model_fields.items()
                                                                   if isinstance(v, (int, float, str, bool))}})

    global_batch = args.per_device_train_batch_size * W * G
    run_signature = {"global_batch": global_batch, "block_size": args.block_size, "block_mode": args.block_mode,
                     "seed": args.seed, "num_edges": edges, "vocab_size": V, "max_train_steps": args.max_train_steps}

    # ---------------------------------------------------------------- resume
    completed_steps, start_epoch, skip_batches = 0, 0, 0
    log_path = out_dir / LOG_NAME
    if checkpoint is not None:
        try:
            accelerator.load_state(str(checkpoint))
        except Exception as err:
            raise UsageError(
                f"could not restore {checkpoint}: {type(err).__name__}: {str(err).splitlines()[0]}. Was it saved "
                "by a run with the same data, tokenizer and graph?"
            ) from None
        with open(checkpoint / STATE_NAME, encoding="utf-8") as handle:
            state = json.load(handle)
        completed_steps, start_epoch, skip_batches = state["completed_steps"], state["epoch"], state["batches_in_epoch"]
        if skip_batches >= len(train_loader):
            start_epoch, skip_batches = start_epoch + 1, 0
        changed = {k: (state.get("signature", {}).get(k), v) for k, v in run_signature.items()
                   if state.get("signature", {}).get(k) != v and k != "max_train_steps"}
        if changed:
            say(f"warning: this run differs from the checkpoint's in {changed}: not an exact continuation.")
        say(f"resumed from {checkpoint}: step {completed_steps}, epoch {start_epoch}, "
            f"skipping {skip_batches} batches of that epoch")
        if accelerator.is_main_process:  # the log keeps what happened up to the checkpoint
            kept = [r for r in read_log(log_path) if r.get("step", 0) <= completed_steps]
            with open(log_path, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in kept)

    def log(record: dict):
        if accelerator.is_main_process:
            with open(log_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if args.with_tracking:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    say(f"training: {args.max_train_steps} steps ({steps_per_epoch} per epoch, {args.num_train_epochs} epoch(s)), "
        f"global batch {global_batch} blocks = {args.per_device_train_batch_size} x {W} process(es) x {G} "
        f"accumulation, lr {args.learning_rate} ({args.lr_scheduler_type}, {args.num_warmup_steps} warmup), "
        f"loss {config.loss_type}")

    summary = {"data": description, "vocab_size": V, "num_edges": edges, "num_parameters": P,
               "node_size": config.node_size, "graph": config.graph, "processes": W, "global_batch": global_batch}
    if eval_loader is not None and checkpoint is None:
        started = time.time()
        loss0, ppl0, n0 = evaluate(model, eval_loader, accelerator)
        say(f"step 0: validation loss {loss0:.4f}, perplexity {ppl0:,.1f} ({n0:,} tokens, {time.time() - started:.1f}s)")
        log({"step": 0, "eval_loss": loss0, "perplexity": ppl0})
        summary.update(perplexity_before=ppl0, eval_loss_before=loss0)

    # ---------------------------------------------------------------- train
    progress = tqdm(total=args.max_train_steps, initial=completed_steps, desc="train",
                    disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = float(args.per_device_train_batch_size * args.block_size)  # keeps backward's loss near the mean's scale
    train_time, train_tokens, last_loss, lr_used = 0.0, 0, float("nan"), args.learning_rate
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, targets, real tokens
    model.train()
    done = completed_steps >= args.max_train_steps
    for epoch in range(start_epoch, args.num_train_epochs):
        if done:
            break
        train_loader.set_epoch(epoch)
        if epoch == start_epoch and skip_batches:
            loader, batches_in_epoch = accelerator.skip_first_batches(train_loader, skip_batches), skip_batches
        else:
            loader, batches_in_epoch = train_loader, 0
        step_started = time.time()
        for batch in loader:
            with accelerator.accumulate(model):
                n_local = count_targets(batch)
                out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            labels=batch["labels"], return_logits=False)
                # backward of (sum of this batch's token losses) / ref; rescaled below to / (global targets)
                accelerator.backward(out.loss * (n_local / ref))
                sums += torch.stack([out.loss.detach().double() * n_local, n_local.double(),
                                     batch["attention_mask"].sum().double()])
                if accelerator.sync_gradients:
                    totals = accelerator.reduce(sums.clone(), reduction="sum")
                    # accelerate divided by G, DDP averaged over W: undo both and divide by the global targets
                    scale = G * W * ref / max(float(totals[1]), 1.0)
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(scale)
                    if args.max_grad_norm and not sparse_opt:
                        accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_used = lr_scheduler.get_last_lr()[0]
                    lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue

            # ------------------------------------------------ one optimizer step done
            completed_steps += 1
            sums.zero_()
            last_loss = float(totals[0] / totals[1].clamp_min(1))
            elapsed = time.time() - step_started
            train_time += elapsed
            train_tokens += int(totals[2])
            log({"step": completed_steps, "loss": last_loss, "lr": lr_used, "tokens": int(totals[1]),
                 "epoch": epoch, "seconds": round(elapsed, 4)})
            progress.update(1)
            progress.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{train_tokens / max(train_time, 1e-9):,.0f}",
                                 refresh=False)
            if args.step_sleep:
                time.sleep(args.step_sleep)

            if args.eval_steps and eval_loader is not None and completed_steps % args.eval_steps == 0 \
                    and completed_steps < args.max_train_steps:
                loss_v, ppl_v, _ = evaluate(model, eval_loader, accelerator)
                if accelerator.is_local_main_process:
                    progress.write(f"step {completed_steps}: train loss {last_loss:.4f}, validation loss "
                                   f"{loss_v:.4f}, perplexity {ppl_v:,.2f}")
                log({"step": completed_steps, "eval_loss": loss_v, "perplexity": ppl_v})
            epoch_end = batches_in_epoch >= len(train_loader)
            if (isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0) or \
                    (args.checkpointing_steps == "epoch" and epoch_end):
                state = {"completed_steps": completed_steps, "epoch": epoch, "batches_in_epoch": batches_in_epoch,
                         "signature": run_signature}
                path = save_checkpoint(accelerator, args.output_dir, completed_steps, state, tokenizer,
                                       args.checkpoints_total_limit)
                if accelerator.is_local_main_process:
                    progress.write(f"step {completed_steps}: checkpoint {path}")
            step_started = time.time()
            if completed_steps >= args.max_train_steps:
                done = True
                break
    progress.close()

    # ---------------------------------------------------------------- evaluate, save, generate
    if train_time > 0:
        say(f"trained to step {completed_steps}: {train_tokens:,} real tokens in {train_time:.1f}s of training "
            f"= {train_tokens / train_time:,.0f} tokens/s; last train loss {last_loss:.4f}")
    summary.update(steps=completed_steps, train_seconds=round(train_time, 2), train_tokens=train_tokens,
                   tokens_per_second=round(train_tokens / train_time, 1) if train_time else None, last_loss=last_loss)
    if eval_loader is not None:
        loss1, ppl1, n1 = evaluate(model, eval_loader, accelerator)
        say(f"validation loss {loss1:.4f}, perplexity {ppl1:,.2f} ({n1:,} tokens)"
            + (f"; before training: {summary['perplexity_before']:,.1f}" if "perplexity_before" in summary else ""))
        log({"step": completed_steps, "eval_loss": loss1, "perplexity": ppl1})
        summary.update(perplexity=ppl1, eval_loss=loss1)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.sparse_gradients = False
    state_dict = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(out_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
                              state_dict=state_dict, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out_dir)
    say(f"saved the model and tokenizer to {out_dir} (AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))")

    prompts = choose_prompts(args, raw["validation"] if "validation" in raw else None, not (args.train_file or args.dataset_name))
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if prompts and args.num_generations > 0 and (accelerator.is_main_process or fsdp):
        samples = generate_samples(model if fsdp else unwrapped, tokenizer, prompts, args, accelerator.device)
        say("generations (greedy | sampled, top-k 40, temperature 0.8):")
        for s in samples:
            say(f"  {s['prompt']!r}\n    greedy : {s['prompt']}{s['greedy']}\n    sampled: {s['prompt']}{s['sampled']}")
        summary["generations"] = samples
    if accelerator.is_main_process:
        with open(out_dir / SUMMARY_NAME, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
    if args.with_tracking:
        accelerator.end_training()

    if args.push_to_hub and accelerator.is_main_process:
        from huggingface_hub import HfApi

        repo_id = args.hub_model_id or out_dir.resolve().name
        try:
            api = HfApi(token=args.hub_token)
            repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
            api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, commit_message="BriLLM pretraining",
                              ignore_patterns=["step_*", "step_*/**", TMP_PREFIX + "*"])
        except Exception as err:
            raise UsageError(f"push to the Hub ({repo_id}) failed: {type(err).__name__}: {err}. The model is "
                             f"saved in {out_dir}.") from None
        say(f"pushed to https://huggingface.co/{repo_id}")
    accelerator.wait_for_everyone()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
