"""Presets (configuration/models/*.json) and how their sections, the flags and the built-in defaults combine.

A preset has three sections: "model" (fields of BriLLMConfig), "tokenizer" (the tokenizer to train) and
"training" (flag values). Precedence: built-in defaults < preset < command-line flags.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import UsageError

PRESET_DIR = Path(__file__).resolve().parents[2] / "configuration" / "models"

# Fields of BriLLMConfig a preset may set in its "model" section (vocab_size comes from the tokenizer, num_edges
# from the graph, the special ids from the tokenizer).
MODEL_FIELDS = {
    "node_size", "max_position_embeddings", "graph", "position_encoding", "initializer_range", "loss_type",
    "num_negatives", "negative_sampling", "signal_dropout", "non_edge_bias", "node_readout", "position_recency",
    "edge_backoff", "node_embedding", "count_prior",
}
# The built-in recipe (docs/training.md, "The default recipe"): the paper's model and rate, with the non-edge
# back-off, the nodes' readout of the signal, a matrix every edge shares, the nodes' own vectors in the signal, a
# mix that starts weighted to recent edges, a fixed smoothed bigram model of the data under every logit, separate
# rates for the per-node parameters and the shared edge, a graph pruned by the data, and signal dropout where the
# data and the run's length call for it.
MODEL_DEFAULTS = {"node_size": 32, "max_position_embeddings": 512, "graph": "sparse", "loss_type": "exact",
                  "non_edge_bias": True, "node_readout": True, "position_recency": 0.2, "edge_backoff": True,
                  "node_embedding": True, "count_prior": True, "signal_dropout": "auto"}
TOKENIZER_FIELDS = {"kind", "vocab_size", "min_frequency"}
TOKENIZER_DEFAULTS = {"kind": "bpe", "vocab_size": 4000, "min_frequency": 2}
# Flags a preset may set in its "training" section, with the value used when neither preset nor flag sets them.
TRAINING_DEFAULTS = {
    "block_size": 32,
    "block_mode": "sentence",
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 32,
    "learning_rate": "auto",  # training.pruning.choose_learning_rate: 1e-2 where the signal drops, else 2e-2
    "weight_decay": 0.1,
    "num_train_epochs": 1,
    "max_train_steps": None,
    "gradient_accumulation_steps": 1,
    "lr_scheduler_type": "linear",
    "num_warmup_steps": 10,
    "max_grad_norm": 1.0,
    "lazy_weight_decay": False,
    "shared_edge_lr_scale": 0.5,
    "node_lr_scale": 2.0,
    "signal_dropout_warmup_epochs": 1.0,
    "moment_dtype": None,  # None: bfloat16 under --mixed_precision bf16 with SparseAdamW on a GPU, else float32
    "min_bigram_count": "auto",  # training.pruning.choose_min_count
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
    "signal_dropout": ("model", "signal_dropout"),
    "non_edge_bias": ("model", "non_edge_bias"),
    "node_readout": ("model", "node_readout"),
    "position_recency": ("model", "position_recency"),
    "edge_backoff": ("model", "edge_backoff"),
    "node_embedding": ("model", "node_embedding"),
    "count_prior": ("model", "count_prior"),
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
    # A built-in default this setup cannot train gives way; a preset's or a flag's value stays (and is refused).
    off = {"non_edge_bias", "node_readout", "count_prior"} if model["loss_type"] == "sampled" else set()  # few scored
    if model["graph"] == "dense":
        off.add("count_prior")  # built with a sparse graph's bigrams
    for field in off:
        if field not in preset["model"] and getattr(args, field) is None:
            model[field] = False
    for name, default in TRAINING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset["training"].get(name, default))
    return model, tokenizer



def build_config_and_graph(model_fields: dict, tokenizer, train_blocks, min_bigram_count: int | str,
                           planned_epochs: float | None = None, epochs_grow_with_pruning: bool = False,
                           say=None):
    """(BriLLMConfig, the sparse BigramGraph of the training blocks or None for a dense graph, the count used):
    the vocabulary and special ids come from the tokenizer, the edges from the bigrams seen at least
    `min_bigram_count` times. `"auto"` takes the count `pruning.choose_min_count` picks for the run's
    `planned_epochs` (then the count used is its `PruningChoice`, which can describe itself); a `signal_dropout`
    of `"auto"` is chosen from the same probe (`pruning.choose_signal_dropout`). `say` gets what was chosen."""
    from modeling_brillm import BriLLMConfig, build_sparse_graph

    from .data import block_sequences
    from .pruning import choose_min_count, choose_signal_dropout

    V = len(tokenizer)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, unk_token_id=tokenizer.unk_token_id)
    fields = {k: v for k, v in model_fields.items() if k != "graph"}
    say = say or (lambda line: None)
    sparse = model_fields["graph"] != "dense"
    auto_count = sparse and min_bigram_count == "auto"
    auto_dropout = fields.get("signal_dropout") == "auto"
    try:
        used, sequences = min_bigram_count, None
        if auto_count or auto_dropout:  # the probe holds the blocks' tokens; the graph below reuses them
            sequences = list(block_sequences(train_blocks, tokenizer.pad_token_id))
            choice = choose_min_count(sequences, V, planned_epochs, epochs_grow_with_pruning)
        if auto_count:
            say(choice.describe())
            used, min_bigram_count = choice, choice.min_count
        if auto_dropout:
            # the epochs planned at the data's count: what a sparser graph buys depends on the machine (pruning.py)
            dropout = choose_signal_dropout(choice.novelty, planned_epochs)
            say(dropout.describe())
            fields["signal_dropout"] = dropout.p
        if not sparse:
            return BriLLMConfig(vocab_size=V, graph="dense", **fields, **special), None, None
        try:
            if sequences is None:  # a fixed count streams the blocks: a large corpus is never held in memory
                sequences = block_sequences(train_blocks, tokenizer.pad_token_id)
            graph = build_sparse_graph(sequences, V, min_count=min_bigram_count,
                                       ignore_ids=() if tokenizer.pad_token_id is None else (tokenizer.pad_token_id,),
                                       with_prior=bool(fields.get("count_prior")))
        except ValueError as err:
            raise UsageError(f"cannot build the graph: {err}") from None
        prior = {"count_prior_bigrams": graph.prior.num_bigrams} if graph.prior is not None else {}
        config = BriLLMConfig(vocab_size=V, graph="sparse", num_edges=graph.num_edges, **fields, **prior, **special)
        return config, graph, used
    except (ValueError, TypeError) as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from None
