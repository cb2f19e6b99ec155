"""A run's settings: the default preset (recipe.DEFAULT_PRESET) with a preset's changes (configuration/README.md)
or a saved recipe, then the flags (`resolve_settings`); the "auto" values (`choose_auto`); the config and graph they
give; the batch on a GPU."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from modeling_brillm import BriLLMConfig, build_sparse_graph

from .data import block_sequences
from .errors import UsageError
from .memory import human_bytes
from .pruning import choose_signal_dropout, decide_min_count, probe_bigrams
from .recipe import DEFAULT_PRESET, FREE_SHARE, GIVES_WAY, GPU_STEP_TOKENS, RecipeChoice, RunPlan, Setting, load_recipe

PRESET_DIR = Path(__file__).resolve().parents[2] / "configuration" / "models"
SECTIONS = ("model", "training", "tokenizer")
# the flags whose names are not their setting's (every other setting's flag is --NAME; --dense_graph sets the graph)
FLAG_OF = {"model.loss_type": "loss", "model.negative_sampling": "negatives", "tokenizer.kind": "tokenizer_kind",
           "tokenizer.min_frequency": "tokenizer_min_frequency"}
STEP_BATCH = "training.per_device_train_batch_size"
# BriLLMConfig's fields a preset's "model" section or --config_overrides may set besides the default preset's; the
# config's own default (the release's) holds where none does. The run makes the rest (the graph's size, token ids).
RUN_MADE = {"vocab_size", "num_edges", "count_prior_bigrams", "bos_token_id", "eos_token_id", "pad_token_id",
            "unk_token_id", "tie_word_embeddings", "use_cache"}
MODEL_FIELDS = sorted(set(BriLLMConfig.__annotations__) - RUN_MADE)


def flag_of(key: str) -> str:
    return FLAG_OF.get(key, key.split(".", 1)[1])


def known_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name_or_path: str | None) -> dict:
    """What a preset (a name in configuration/models/ or a JSON file's path) changes in the default, by section."""
    preset = {section: {} for section in SECTIONS}
    if name_or_path is None:
        return preset
    path = Path(name_or_path)
    path = path if path.suffix == ".json" and path.is_file() else PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise UsageError(f"unknown preset {name_or_path!r}: known presets are {', '.join(known_presets()) or '(none)'}"
                         f" (in {PRESET_DIR}), or pass the path of a JSON file.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UsageError(f"preset {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"preset {path} must hold a JSON object with 'model', 'tokenizer' and 'training' sections.")
    for key, value in ((k, v) for k, v in data.items() if not k.startswith("_")):  # "_..." keys are comments
        if key not in preset or not isinstance(value, dict):
            raise UsageError(f"preset {path}: section {key!r} is not one of {sorted(preset)} holding a JSON object.")
        allowed = {name.split(".", 1)[1] for name in DEFAULT_PRESET if name.startswith(key + ".")}
        allowed |= set(MODEL_FIELDS) if key == "model" else set()
        preset[key] = {k: v for k, v in value.items() if not k.startswith("_")}
        if unknown := sorted(set(preset[key]) - allowed):
            raise UsageError(f"preset {path}: unknown {key} field(s) {unknown}; allowed: {sorted(allowed)}.")
    return preset


def resolve_settings(args) -> RecipeChoice:
    """Every setting: the default preset < a preset's changes (or `--recipe FILE`) < the flags, then recipe.GIVES_WAY;
    the training ones set on `args`, the choice as `args.recipe_choice` and returned ("auto" values still to choose)."""
    choice = _preset_or_recipe(args)
    for key in list(choice.settings):
        value = getattr(args, flag_of(key), None)
        if value is not None:
            _set(choice, key, value, f"flag --{flag_of(key)}")
    if getattr(args, "dense_graph", None):
        _set(choice, "model.graph", "dense", "flag --dense_graph")
    for name, value in config_overrides(getattr(args, "config_overrides", None)).items():
        earlier = choice.settings.get(f"model.{name}")
        flag = getattr(args, flag_of(f"model.{name}"), None)
        if (flag is not None or getattr(args, "recipe", None)) and earlier is not None and earlier.value != value:
            raise UsageError(f"--config_overrides {name}={value!r} differs from {earlier.rule}'s {earlier.value!r}: "
                             "drop one of them.")
        _set(choice, f"model.{name}", value, "flag --config_overrides")
    for rule in GIVES_WAY:
        field, value = rule.when
        if choice.value("model", field) == value and rule.sets not in choice.given:
            _set(choice, rule.sets, rule.value, rule.name, given=False)
    vars(args).update({s.name: s.value for s in choice.settings.values() if s.section == "training"})
    args.recipe_choice = choice
    return choice


def config_overrides(text: str | None) -> dict:
    """`--config_overrides "edge_rank=4,node_readout=true"` (as transformers' run_clm.py) as {field: value}."""
    overrides = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, raw = item.strip().partition("=")
        if not sep or name not in MODEL_FIELDS:
            raise UsageError(f"--config_overrides {item!r}: expected FIELD=VALUE with FIELD one of {MODEL_FIELDS}.")
        try:
            overrides[name] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[name] = raw
    return overrides


def _set(choice: RecipeChoice, key: str, value, rule: str, given: bool = True):
    section, name = key.split(".", 1)
    choice.add(Setting(section, name, value, rule))
    if given:
        choice.given.add(key)


def default_choice() -> RecipeChoice:
    """The default preset as a choice: every setting with the rule that gives it (model, training, tokenizer)."""
    choice = RecipeChoice()
    for key, rule in sorted(DEFAULT_PRESET.items(), key=lambda item: SECTIONS.index(item[0].split(".")[0])):
        _set(choice, key, rule.value, rule.name, given=False)
    return choice


def _preset_or_recipe(args) -> RecipeChoice:
    """The default preset with the preset's changes, or with a saved recipe's settings in their place."""
    choice, path = default_choice(), getattr(args, "recipe", None)
    if path is None:
        for section, values in load_preset(args.config).items():
            for name, value in values.items():
                _set(choice, f"{section}.{name}", value, f"preset {args.config}")
        return choice
    if args.config is not None:
        raise UsageError("--recipe and --config both give the settings: pass one of them.")
    for key, setting in load_recipe(path).settings.items():
        given = getattr(args, flag_of(key), None)
        if given is not None and given != setting.value:
            raise UsageError(f"--{flag_of(key)} {given} differs from the recipe's {setting.name}={setting.value!r} "
                             f"({path}): drop the flag to reproduce the run, or drop --recipe.")
        _set(choice, key, setting.value, setting.rule)
    if getattr(args, "dense_graph", None) and choice.value("model", "graph") != "dense":
        raise UsageError(f"--dense_graph differs from the recipe's sparse graph ({path}): drop one of them.")
    return choice


# ------------------------------------------------------------------------------------------ the auto values
def _auto_count(choice) -> bool:
    return choice.value("model", "graph") != "dense" and choice.value("training", "min_bigram_count") == "auto"


def choose_auto(choice: RecipeChoice, probe=None, plan: RunPlan | None = None) -> RecipeChoice:
    """A copy of `choice` with the "auto" count and dropout decided from `probe` (pruning.probe_bigrams) and `plan`."""
    plan = plan or RunPlan()
    out = RecipeChoice(dict(choice.settings), {"plan": asdict(plan), "probe": probe.summary() if probe else None},
                       given=set(choice.given))
    if _auto_count(choice):
        pruned = out.pruning = decide_min_count(probe, plan.planned_epochs, plan.epochs_grow_with_pruning)
        rule = "RECURRENCE" if pruned.min_count <= pruned.data_count else "FIT_EPOCHS" if pruned.grown else "MIN_VISITS"
        out.add(Setting("training", "min_bigram_count", pruned.min_count, rule, pruned.describe()))
    if choice.value("model", "signal_dropout") == "auto":
        p, why = choose_signal_dropout(probe.held_out.novelty, plan.planned_epochs)
        out.add(Setting("model", "signal_dropout", p, "MAX_DROPOUT" if p else "FIT_EPOCHS", why))
    return out


def choose_recipe(requested: dict, rules: dict, probe=None, plan: RunPlan | None = None) -> RecipeChoice:
    """`choose_auto` over {"model": {...}, ...} settings, each with rule `rules["section.name"]` or the default's."""
    choice = RecipeChoice()
    for section, values in requested.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            default = DEFAULT_PRESET[key].name if key in DEFAULT_PRESET else "default"
            choice.add(Setting(section, name, value, rules.get(key) or default))
    return choose_auto(choice, probe, plan)


def plan_recipe(choice: RecipeChoice, tokenizer, train_blocks, plan: RunPlan | None = None, say=None):
    """(the choice with its auto values, the blocks' token sequences or None): the probe runs where a count or a
    dropout is "auto" (the sequences it read then come back for the graph). `say` gets what the data chose."""
    probe = sequences = None
    if _auto_count(choice) or choice.value("model", "signal_dropout") == "auto":
        sequences = list(block_sequences(train_blocks, tokenizer.pad_token_id))  # the graph below reuses them
        probe = probe_bigrams(sequences, len(tokenizer))
    try:
        chosen = choose_auto(choice, probe, plan)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    for key in ("training.min_bigram_count", "model.signal_dropout"):
        if key in chosen.settings and chosen.settings[key].why and say is not None:
            say(chosen.settings[key].why)
    return chosen, sequences


def build_from_recipe(choice: RecipeChoice, tokenizer, train_blocks, sequences=None):
    """(BriLLMConfig, the sparse BigramGraph of the training blocks or None for a dense graph): its edges the bigrams
    seen at least the recipe's count (a fixed count streams the blocks: a large corpus is never held in memory)."""
    V, graph, extra = len(tokenizer), None, {}
    fields = {k: v for k, v in choice.section("model").items() if k != "graph"}
    if choice.value("model", "graph") != "dense":
        ignore = () if tokenizer.pad_token_id is None else (tokenizer.pad_token_id,)
        seqs = block_sequences(train_blocks, tokenizer.pad_token_id) if sequences is None else sequences
        try:
            graph = build_sparse_graph(seqs, V, min_count=choice.value("training", "min_bigram_count"),
                                       ignore_ids=ignore, with_prior=bool(fields.get("count_prior")))
        except (ValueError, TypeError) as err:
            raise UsageError(f"cannot build the graph: {err}") from None
        extra = {"num_edges": graph.num_edges}
        extra.update({"count_prior_bigrams": graph.prior.num_bigrams} if graph.prior is not None else {})
    try:
        return BriLLMConfig(vocab_size=V, graph=choice.value("model", "graph"), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            unk_token_id=tokenizer.unk_token_id, **fields, **extra), graph
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


# ------------------------------------------------------------------------------------- the step on a GPU
@dataclass
class StepBatch:
    """The batch GPU_STEP_TOKENS chose for a CUDA device."""
    rule_batch: int  # blocks per process before the memory check
    capped: bool = False  # fewer training blocks per process than the rule's
    resumed: bool = False  # the checkpoint's batch, kept so that the run continues it exactly


def choose_step_batch(args, device_type: str, train_blocks: int, processes: int,
                      checkpoint_global_batch: int | None = None) -> StepBatch | None:
    """On CUDA where nothing gave the batch: GPU_STEP_TOKENS tokens a step (a resumed run: its checkpoint's batch)."""
    if device_type != "cuda" or STEP_BATCH in args.recipe_choice.given:
        return None
    per_step, rule = processes * args.gradient_accumulation_steps, GPU_STEP_TOKENS // args.block_size
    resumed = bool(checkpoint_global_batch) and checkpoint_global_batch % per_step == 0
    batch = checkpoint_global_batch // per_step if resumed else max(1, min(rule, train_blocks // max(processes, 1)))
    args.per_device_train_batch_size = batch
    _set(args.recipe_choice, STEP_BATCH, batch, "the checkpoint's batch" if resumed else "GPU_STEP_TOKENS")
    return StepBatch(batch, capped=not resumed and batch < rule, resumed=resumed)


def fit_step_batch(args, step: StepBatch | None, need: Callable[[int], float], free: float | None) -> str | None:
    """The step's memory check on CUDA: a GPU_STEP_TOKENS batch is halved until it fits, any other kept (warned)."""
    if free is None:
        return None
    batch, L, size = args.per_device_train_batch_size, args.block_size, human_bytes
    if step is None or step.resumed:
        if need(batch) <= free:
            return None
        return (f"warning: batch {batch} x {L} would need ~{size(need(batch))}, {size(free)} free: it may run out "
                f"of memory (kept as {args.recipe_choice.rule(STEP_BATCH)} set it; lower --per_device_train_batch_size "
                "to fit)")
    while batch > 1 and need(batch) > FREE_SHARE * free:
        batch //= 2
    args.per_device_train_batch_size = batch
    head = f"batch {step.rule_batch} x {L} (GPU_STEP_TOKENS: {GPU_STEP_TOKENS:,} tokens per step"
    head += ", capped at the training blocks)" if step.capped else ")"
    if batch == step.rule_batch:
        return f"{head} needs ~{size(need(batch))}, {size(free)} free"
    return f"{head} would need ~{size(need(step.rule_batch))}, {size(free)} free: using {batch} (~{size(need(batch))})"
