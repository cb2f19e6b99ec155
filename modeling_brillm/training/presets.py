"""Presets (configuration/models/*.json) and how their sections, the flags and the built-in defaults combine.

A preset has three sections: "model" (fields of BriLLMConfig), "tokenizer" (the tokenizer to train) and
"training" (flag values). Precedence: built-in defaults < preset < command-line flags.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .errors import UsageError
from .memory import human_bytes
from .pruning import choose_signal_dropout, decide_min_count
from .recipe import (
    FREE_SHARE,
    GPU_STEP_TOKENS,
    MODEL_DEFAULTS,
    OVERRIDES,
    TOKENIZER_DEFAULTS,
    TRAINING_RECIPE,
    RecipeChoice,
    RunPlan,
    Setting,
    default_rule,
)

__all__ = ["MODEL_DEFAULTS", "MODEL_FIELDS", "TOKENIZER_DEFAULTS", "TRAINING_DEFAULTS", "StepBatch",
           "build_config_and_graph", "build_from_recipe", "choose_step_batch", "fit_step_batch", "known_presets",
           "load_preset", "plan_recipe", "resolve_settings"]

PRESET_DIR = Path(__file__).resolve().parents[2] / "configuration" / "models"

# Fields of BriLLMConfig a preset may set (vocab_size, num_edges and the special ids come from the tokenizer and graph).
MODEL_FIELDS = {
    "node_size", "max_position_embeddings", "graph", "position_encoding", "initializer_range", "loss_type",
    "num_negatives", "negative_sampling", "signal_dropout", "non_edge_bias", "node_readout", "position_recency",
    "edge_backoff", "node_embedding", "count_prior",
}
TOKENIZER_FIELDS = {"kind", "vocab_size", "min_frequency"}
# Flags a preset may set in its "training" section, with the value used when neither preset nor flag sets them.
TRAINING_DEFAULTS = {
    "per_device_eval_batch_size": 32,
    "num_train_epochs": 1,
    "max_train_steps": None,
    "gradient_accumulation_steps": 1,
    "validation_split_percentage": 5,
    "max_eval_samples": None,
    "eval_steps": None,
    "checkpointing_steps": None,
    "checkpoints_total_limit": None,
    "num_generations": 3,
    "max_new_tokens": 20,
    "seed": 42,
    "torch_threads": None,
    **TRAINING_RECIPE,  # the recipe's training values (recipe.py)
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
    """Merge built-in defaults < preset (or `--recipe FILE`) < flags. Fills the training flags on `args` in place,
    `args.setting_rules` ("section.name" -> who set it, where not the recipe's default) and
    `args.tokenizer_settings`; returns the model config fields and the tokenizer settings."""
    preset, rules = _preset_or_recipe(args)
    model = {**MODEL_DEFAULTS, **preset["model"]}
    tokenizer = {**TOKENIZER_DEFAULTS, **preset["tokenizer"]}
    sections = {"model": model, "tokenizer": tokenizer}
    for flag, (section, field) in FLAG_TO_FIELD.items():
        value = getattr(args, flag)
        if value is not None:
            sections[section][field] = value
            rules[f"{section}.{field}"] = f"flag --{flag}"
    if args.dense_graph:
        model["graph"] = "dense"
        rules["model.graph"] = "flag --dense_graph"
    # A built-in default this setup cannot train gives way; a preset's or a flag's value stays (and is refused).
    off = [rule for rule in OVERRIDES if rule.when(model)]
    for rule in off:
        field = rule.sets.split(".", 1)[1]
        if field not in preset["model"] and getattr(args, field) is None:
            model[field] = rule.value
            rules[rule.sets] = rule.name
    for name, default in TRAINING_DEFAULTS.items():
        if getattr(args, name) is not None:
            rules[f"training.{name}"] = f"flag --{name}"
        else:
            setattr(args, name, preset["training"].get(name, default))
    args.setting_rules, args.tokenizer_settings = rules, tokenizer
    return model, tokenizer


def _preset_or_recipe(args) -> tuple[dict, dict]:
    """The preset's sections, or a saved recipe's settings in their place; and who set each value they hold."""
    path = getattr(args, "recipe", None)
    if path is None:
        preset = load_preset(args.config)
        return preset, {f"{section}.{name}": f"preset {args.config}" for section, values in preset.items()
                        for name in values}
    if args.config is not None:
        raise UsageError("--recipe and --config both give the settings: pass one of them.")
    from .recipe import load_recipe

    saved = load_recipe(path)
    preset = {section: saved.section(section) for section in ("model", "tokenizer", "training")}
    flags = {**FLAG_TO_FIELD, **{name: ("training", name) for name in preset["training"]}}
    for flag, (section, field) in flags.items():
        given = getattr(args, flag, None)
        if given is not None and field in preset[section] and given != preset[section][field]:
            raise UsageError(f"--{flag} {given} differs from the recipe's {field}={preset[section][field]!r} "
                             f"({path}): drop the flag to reproduce the run, or drop --recipe.")
    if args.dense_graph and preset["model"].get("graph") != "dense":
        raise UsageError(f"--dense_graph differs from the recipe's sparse graph ({path}): drop one of them.")
    return preset, {key: setting.rule for key, setting in saved.settings.items()}


def plan_recipe(model_fields: dict, tokenizer, train_blocks, training: dict, plan: RunPlan | None = None,
                tokenizer_settings: dict | None = None, rules: dict | None = None, say=None):
    """(RecipeChoice, the blocks' token sequences or None): the recipe's every setting for these training blocks
    and this run (`choose_recipe`); the probe runs where a count or a dropout is "auto" (then the sequences
    it read come back for the graph). `say` gets what the data chose."""
    from .data import block_sequences
    from .pruning import probe_bigrams
    say = say or (lambda line: None)
    sparse = model_fields["graph"] != "dense"
    probe = sequences = None
    if (sparse and training.get("min_bigram_count") == "auto") or model_fields.get("signal_dropout") == "auto":
        sequences = list(block_sequences(train_blocks, tokenizer.pad_token_id))  # the graph below reuses them
        probe = probe_bigrams(sequences, len(tokenizer))
    requested = {"model": dict(model_fields), "training": dict(training), "tokenizer": dict(tokenizer_settings or {})}
    try:
        choice = choose_recipe(requested, rules or {}, probe, plan)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    for key in ("training.min_bigram_count", "model.signal_dropout"):
        if key in choice.settings and choice.settings[key].why:
            say(choice.settings[key].why)
    return choice, sequences


def build_from_recipe(choice: RecipeChoice, tokenizer, train_blocks, sequences=None):
    """(BriLLMConfig, the sparse BigramGraph of the training blocks or None for a dense graph): the vocabulary and
    special ids come from the tokenizer, the edges from the bigrams seen at least the recipe's count."""
    from modeling_brillm import BriLLMConfig, build_sparse_graph

    from .data import block_sequences

    V = len(tokenizer)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, unk_token_id=tokenizer.unk_token_id)
    fields = {k: v for k, v in choice.section("model").items() if k != "graph"}
    try:
        if choice.value("model", "graph") == "dense":
            return BriLLMConfig(vocab_size=V, graph="dense", **fields, **special), None
        try:
            if sequences is None:  # a fixed count streams the blocks: a large corpus is never held in memory
                sequences = block_sequences(train_blocks, tokenizer.pad_token_id)
            graph = build_sparse_graph(sequences, V, min_count=choice.value("training", "min_bigram_count"),
                                       ignore_ids=() if tokenizer.pad_token_id is None else (tokenizer.pad_token_id,),
                                       with_prior=bool(fields.get("count_prior")))
        except ValueError as err:
            raise UsageError(f"cannot build the graph: {err}") from None
        prior = {"count_prior_bigrams": graph.prior.num_bigrams} if graph.prior is not None else {}
        config = BriLLMConfig(vocab_size=V, graph="sparse", num_edges=graph.num_edges, **fields, **prior, **special)
        return config, graph
    except (ValueError, TypeError) as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from None


def build_config_and_graph(model_fields: dict, tokenizer, train_blocks, min_bigram_count: int | str,
                           planned_epochs: float | None = None, epochs_grow_with_pruning: bool = False,
                           say=None):
    """(BriLLMConfig, the sparse BigramGraph or None for a dense graph, the count used: the `PruningChoice` where
    it was "auto", which can describe itself): `plan_recipe` and `build_from_recipe` for a count and the model
    fields alone. `say` gets what the data chose."""
    plan = RunPlan(planned_epochs, epochs_grow_with_pruning)
    choice, sequences = plan_recipe(model_fields, tokenizer, train_blocks, {"min_bigram_count": min_bigram_count},
                                    plan, say=say)
    config, graph = build_from_recipe(choice, tokenizer, train_blocks, sequences)
    if graph is None:
        return config, None, None
    return config, graph, choice.pruning or choice.value("training", "min_bigram_count")


def choose_recipe(requested: dict, rules: dict, probe=None, plan: RunPlan | None = None) -> RecipeChoice:
    """Every setting of the run. `requested`: {"model": ..., "tokenizer": ..., "training": ...} as defaults <
    preset < flags left them ("auto" where the recipe decides); `rules`: "section.name" -> who set a value (default:
    its rule of RULES); `probe`: `pruning.probe_bigrams` of the training blocks (needed for an "auto" count on a
    sparse graph or an "auto" dropout); `plan`: the run's length. The count and the dropout are decided here."""
    plan = plan or RunPlan()
    choice = RecipeChoice(inputs={"plan": asdict(plan), "probe": probe.summary() if probe is not None else None})
    for section, values in requested.items():
        for name, value in values.items():
            rule = rules.get(f"{section}.{name}") or default_rule(section, name) or "default"
            choice.add(Setting(section, name, value, rule))
    model, training = requested["model"], requested["training"]
    sparse = model.get("graph") != "dense"
    if sparse and training.get("min_bigram_count") == "auto":
        pruned = decide_min_count(probe, plan.planned_epochs, plan.epochs_grow_with_pruning)
        choice.pruning = pruned
        choice.add(Setting("training", "min_bigram_count", pruned.min_count, _count_rule(pruned), pruned.describe()))
    if model.get("signal_dropout") == "auto":
        # the epochs planned at the least count: what a sparser graph buys depends on the machine (pruning.py)
        p, why = choose_signal_dropout(probe.held_out.novelty, plan.planned_epochs)
        choice.add(Setting("model", "signal_dropout", p, "MAX_DROPOUT" if p else "FIT_EPOCHS", why))
    return choice


def _count_rule(pruned) -> str:
    """The rule that set the count last."""
    if pruned.min_count <= pruned.data_count:
        return "RECURRENCE"
    return "FIT_EPOCHS" if pruned.grown else "MIN_VISITS"  # the floor where text strays, or the visits


# ------------------------------------------------------------------------------------- the step on a GPU
STEP_BATCH = "training.per_device_train_batch_size"


@dataclass
class StepBatch:
    """The batch GPU_STEP_TOKENS chose for a CUDA device: `rule_batch` blocks per process before the memory check;
    `resumed`: the checkpoint's batch, kept so that the run continues it exactly."""
    rule_batch: int
    capped: bool = False  # fewer training blocks per process than GPU_STEP_TOKENS // block_size
    resumed: bool = False


def choose_step_batch(args, device_type: str, train_blocks: int, processes: int,
                      checkpoint_global_batch: int | None = None) -> StepBatch | None:
    """GPU_STEP_TOKENS: on a CUDA device where no flag, preset or recipe file gave the batch (`args.setting_rules`
    has no rule for it), the blocks per process that make GPU_STEP_TOKENS tokens a step, at most the training blocks
    per process; a resumed run keeps its checkpoint's. Sets `args.per_device_train_batch_size` and its rule before
    the run's length is planned from it; None (nothing changed) elsewhere."""
    if device_type != "cuda" or STEP_BATCH in args.setting_rules:
        return None
    per_step = processes * args.gradient_accumulation_steps
    if checkpoint_global_batch and checkpoint_global_batch % per_step == 0:
        args.setting_rules[STEP_BATCH] = "the checkpoint's batch"
        args.per_device_train_batch_size = checkpoint_global_batch // per_step
        return StepBatch(args.per_device_train_batch_size, resumed=True)
    args.setting_rules[STEP_BATCH] = "GPU_STEP_TOKENS"
    rule = GPU_STEP_TOKENS // args.block_size
    batch = max(1, min(rule, train_blocks // max(processes, 1)))
    args.per_device_train_batch_size = batch
    return StepBatch(batch, capped=batch < rule)


def fit_step_batch(args, step: StepBatch | None, need: Callable[[int], float], free: float | None) -> str | None:
    """The memory check of the step on a CUDA device (`free`: its free bytes; None elsewhere: nothing to check).
    A batch GPU_STEP_TOKENS chose is halved until `need(batch)` (bytes) fits FREE_SHARE of `free`; a batch given
    otherwise (or a resumed run's) is kept, with a warning where it would not fit. Returns the start-up line."""
    if free is None:
        return None
    batch, L, size = args.per_device_train_batch_size, args.block_size, human_bytes
    if step is None or step.resumed:
        if need(batch) <= free:
            return None
        given = args.setting_rules.get(STEP_BATCH, "the batch given")
        return (f"warning: batch {batch} x {L} would need ~{size(need(batch))}, {size(free)} free: it may run out "
                f"of memory (kept as {given} set it; lower --per_device_train_batch_size to fit)")
    while batch > 1 and need(batch) > FREE_SHARE * free:
        batch //= 2
    args.per_device_train_batch_size = batch
    head = f"batch {step.rule_batch} x {L} (GPU_STEP_TOKENS: {GPU_STEP_TOKENS:,} tokens per step"
    head += ", capped at the training blocks)" if step.capped else ")"
    if batch == step.rule_batch:
        return f"{head} needs ~{size(need(batch))}, {size(free)} free"
    return f"{head} would need ~{size(need(step.rule_batch))}, {size(free)} free: using {batch} (~{size(need(batch))})"
