"""Every setting of a pretraining run as one table (`RULES`: docs/training.md's rule table, each with its evidence:
a `benchmarks/results/*.json` record, a §section of docs/ablations.md or another source), the default preset generated
from it, and what a run chose (`RecipeChoice`, saved as `recipe.json`, which does not replay the run's own settings)."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..count_prior import DISCOUNT
from .errors import UsageError

RECIPE_NAME = "recipe.json"
RECIPE_FORMAT = 1

RECURRENCE = 0.8  # the share of its expected held-out occurrences a count class must show to keep its edges
RUNS, PROBE_EVERY = 100, 10  # the training blocks cut into RUNS runs, every PROBE_EVERY-th one held out
MIN_VISITS = 2  # a kept edge is a training target this often (c · E >= 2), and seen this often where text strays
NOVEL = 0.05  # held-out text strays where this share of its bigrams has no edge; the long-run rules weigh in from here

FIT_EPOCHS = 2.0  # past this many planned epochs E the count grows and the signal drops (where text strays)
MAX_DROPOUT = 0.5  # p = MAX_DROPOUT · s · (1 - FIT_EPOCHS / E): a half at most, reached in very long runs
RATE = 2e-2  # the peak learning rate, with or without dropout

GPU_STEP_TOKENS = 65_536  # tokens per process and step on a CUDA device where nothing else gives the batch
FREE_SHARE = 0.9  # the share of the device's free memory the step's estimate may fill
GPU_RECORD = "benchmarks/results/gpu_throughput-20261126T164207Z.json"


@dataclass(frozen=True)
class Rule:
    """One number or setting: `sets` names the setting it is the default of; `when` ((field, value) of the model
    section) makes it a default that gives way."""
    name: str
    value: object
    why: str
    evidence: str
    sets: str | None = None
    formula: str | None = None  # how the value acts, where the number alone does not say
    when: tuple | None = None
    tuned: bool = True  # False: the paper's, the literature's, a library's or the run's value, or the neutral one
    run: bool = False  # a setting of the run, not of the recipe: not saved in recipe.json

    @property
    def numbers(self) -> int:
        """How many tuned numbers the rule holds (a switch or "auto" holds none)."""
        values = self.value if isinstance(self.value, tuple) else (self.value,)
        tuned = self.tuned and self.evidence != PAPER
        return tuned * sum(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


ABLATION = '§"Rule ablation"'  # § names a section of docs/ablations.md
LONG = '§"Long runs"'
PROBE = '§"The probe"'
SHAPE = '§"Schedule, batch and block"'
PAPER = "the paper"
LIBRARY = "the library's default (transformers, torch)"
RUN = "the run's own (run_clm_no_trainer's flags)"


def _default(key, value, why, evidence, **kwargs):  # the rule that is setting `key`'s default, named as the setting
    return Rule(key.split(".", 1)[1], value, why, evidence, sets=key, **kwargs)


def _run(name, value, why):
    return _default(f"training.{name}", value, why, RUN, tuned=False, run=True)


RULES = (
    # the graph: which bigrams get an edge (--min_bigram_count auto)
    _default("training.min_bigram_count", "auto", "an edge is d²+d parameters trained only on its bigram, and a rare "
             "bigram of one document does not come back (every bigram an edge: 13-22% higher)", f"{ABLATION}; {PROBE}",
             formula="chosen by the probe and the run's length (below)"),
    Rule("RUNS, PROBE_EVERY", (RUNS, PROBE_EVERY), "a tenth held out in runs of blocks, so the probe is other "
         "documents; single blocks, 50 or 200 runs, every 5th or 20th: within the noise on five corpora", PROBE,
         formula="100 runs of the training blocks, every 10th the probe", tuned=False),
    Rule("RECURRENCE", RECURRENCE, "a count class that comes back in other documents is the pair's; ν at c₀ tells "
         "familiar text (3.0%, 3.7%) from straying text (≥ 9.3% on 15 corpora), at a fixed count it does not; "
         "c₀ = 1: 3.6% higher in a long run", PROBE,
         formula="c₀: the smallest c whose class c..2c−1 comes back at this share of its expected rate"),
    Rule("MIN_VISITS", MIN_VISITS, "an edge that was a target once is little more than its random start; where text "
         "strays, one document's occurrence is too little", ABLATION, formula="smallest c ≥ c₀ with c · E(c) ≥ 2 (a "
         "sparser graph trains more epochs in a time budget); c ≥ 2 where ν ≥ NOVEL"),
    Rule("NOVEL", NOVEL, "on familiar text a document's particulars come back: the demo's manual (3.7%) was 5-26% "
         "higher with the floor, the growth or the dropout", LONG, formula="the novelty ν past which text strays; "
         "s = clamp(ν / NOVEL − 1, 0, 1)"),
    Rule("FIT_EPOCHS", FIT_EPOCHS, "past the first passes a run learns its documents' particulars: at 6-8 planned "
         "epochs 32-74% higher without the dropout, 5-9% without the growth", LONG,
         formula="past it the count grows, c ≥ c₀ · (1 + s · (E / 2 − 1)), and the signal drops"),
    _default("model.signal_dropout", "auto", "the longer the run and the more the text strays, the more of the signal "
             "is particular to the training documents", LONG, formula="MAX_DROPOUT · s · (1 − FIT_EPOCHS / E), 0 up to "
             "FIT_EPOCHS"),
    Rule("MAX_DROPOUT", MAX_DROPOUT, "the dropout a very long run on straying text tends to", LONG),
    _default("training.signal_dropout_warmup_epochs", 0.0, "none: grown over the first epoch, it stayed within the "
             "noise", LONG, formula="the dropout grows from 0 over these epochs", tuned=False),
    _default("training.learning_rate", RATE, "one rate, with or without dropout; half of it was 2.6-16.6% higher on "
             "six corpora, twice it 4.3% higher on one and 4.5% lower on another", f"{ABLATION}; {LONG}"),
    # rates per parameter, schedule, regularisation
    _default("training.node_lr_scale", 1.0, "one rate for every parameter: ×2 here or ×0.5 on the shared edge stayed "
             "within the noise", ABLATION, formula="the per-node parameters' rate multiplier", tuned=False),
    _default("training.shared_edge_lr_scale", 1.0, "as node_lr_scale", ABLATION,
             formula="the shared edge's (SparseAdamW)", tuned=False),
    _default("training.num_warmup_steps", 0, "transformers' default; a warm-up of 10 steps stayed within the noise",
             ABLATION, tuned=False),
    _default("training.lr_scheduler_type", "linear", "the rate falls to zero at the run's end (or its time budget); "
             "held constant: 3-28% higher on six corpora", SHAPE, tuned=False),
    _default("training.weight_decay", 0.1, "the usual decay of LM pretraining (GPT-3, LLaMA); without it 1.9-3.9% "
             "higher in all six runs on four corpora", f"{ABLATION}; {LONG}", tuned=False),
    _default("training.lazy_weight_decay", False, "a step decays only the rows it updates, as SparseAdam updates only "
             "those", LIBRARY, tuned=False),
    _default("training.max_grad_norm", 1.0, "transformers' default; with no clipping the run ended within the noise",
             ABLATION, tuned=False),
    _default("training.moment_dtype", None, "16-bit moments pay on a GPU, not on a CPU", 'docs/gpu.md §"Mixed '
             'precision"', formula="bfloat16 under bf16 with SparseAdamW on a GPU, else float32"),
    # the model: the paper's shape, plus the extensions
    _default("model.node_size", 32, "the paper's d", PAPER),
    _default("model.max_position_embeddings", 512, "the paper's position weights", PAPER),
    _default("model.graph", "sparse", "a dense graph is V² edges (16.9B parameters at V=4000)", "docs/model.md"),
    _default("model.loss_type", "exact", "the paper's loss: a softmax over every node's energy; the extensions below "
             "need it", PAPER, tuned=False),
    _default("model.non_edge_bias", False, "off: within the noise on six corpora (±0.3%) and at 8.2-8.4 passes",
             ABLATION, formula="on: shared edge + a learned offset per node for pairs without an edge", tuned=False),
    _default("model.node_readout", True, "r_v learns from every occurrence of v, an edge only from its bigram's: "
             "without it 6.8-15% higher on six corpora", ABLATION, formula="logit + ⟨x, r_v⟩"),
    _default("model.edge_backoff", False, "off: never worth twice the noise on six corpora, 4.3% lower without it on "
             "`small`", ABLATION, formula="on: x·(edge_base + W[u→v])", tuned=False),
    _default("model.node_embedding", True, "the mix carries which tokens came last, learned from every occurrence: "
             "without it 15-23% higher on six corpora", ABLATION, formula="edge output + e_v"),
    _default("model.count_prior", True, "the counts read every training token at once; the edges learn what they "
             "miss (without it 2-10% higher)", ABLATION, formula="logit + log p(v \\| u), fixed, built from every "
             "training bigram"),
    Rule("count_prior.DISCOUNT", DISCOUNT, "the usual absolute discount", "Ney, Essen & Kneser 1994",
         formula="p(v \\| u) interpolates max(c − D, 0)/c(u) with an add-one unigram", tuned=False),
    _default("model.position_recency", 0.2, "left at one, training did not find recency: 3-9% higher", ABLATION,
             formula="position weights start at 1 + 0.2·k (~the last 5 edges)"),
    _default("model.position_encoding", "released", "the release's position weights", PAPER),
    _default("model.initializer_range", 0.5, "the release's initialisation", PAPER),
    _default("model.num_negatives", 400, "the release's sampled loss (--loss sampled)", PAPER),
    _default("model.negative_sampling", "frequency", "the release's negatives: the most frequent successors", PAPER),
    # the data: one sentence per block, the paper's batch and tokenizer
    _default("training.block_mode", "sentence", "the paper's: one sentence per block", PAPER),
    _default("training.block_size", 64, "a sentence is cut at block_size − 1 tokens: cut at 31 (the paper's blocks "
             "of 32), 4.4-19.8% higher on four of six corpora", SHAPE,
             formula="tokens per block: `<s>`, the sentence, `</s>`, padding"),
    _default("training.per_device_train_batch_size", 32, "the paper's: at the same epochs within the noise of batch "
             "64 on four of six corpora, 3.8-4.4% lower on two", SHAPE, tuned=False),
    Rule("GPU_STEP_TOKENS", GPU_STEP_TOKENS, "32 × 32 tokens leave a GPU idle: 76,494 tokens/s at the paper's "
         "shape, 1,526,444 at 1024 × 64 (20×)", GPU_RECORD, formula=f"on CUDA, unless set: batch = "
         f"{GPU_STEP_TOKENS:,} // block_size, halved until the step fits {FREE_SHARE} of the free memory"),
    Rule("tokenizer kind", "bpe", "byte-level BPE for English (characters for Chinese)", PAPER, sets="tokenizer.kind"),
    Rule("tokenizer vocab_size", 4000, "the paper's vocabulary (= graph nodes)", PAPER, sets="tokenizer.vocab_size"),
    Rule("tokenizer min_frequency", 2, "the paper's tokenizer", PAPER, sets="tokenizer.min_frequency"),
    # a setup that cannot train a default turns it off (a preset's or a flag's value stays and is refused)
    Rule("sampled loss: no node_readout", False, "the sampled loss scores a few nodes, the readout all",
         "docs/model.md", sets="model.node_readout", when=("loss_type", "sampled")),
    Rule("sampled loss: no count_prior", False, "the prior changes every node's logit", "docs/model.md",
         sets="model.count_prior", when=("loss_type", "sampled")),
    Rule("dense graph: no count_prior", False, "the prior is built with a sparse graph's bigrams", "docs/model.md",
         sets="model.count_prior", when=("graph", "dense")),
    # the run: its length, evaluation and output (a preset may set them; recipe.json does not replay them)
    _run("num_train_epochs", 1, "one pass unless told"),
    _run("max_train_steps", None, "from the epochs unless given"),
    _run("gradient_accumulation_steps", 1, "one micro-batch per step"),
    _run("per_device_eval_batch_size", 32, "the training batch's"),
    _run("validation_split_percentage", 5, "run_clm's held-out share"),
    _run("max_eval_samples", None, "every validation block"),
    _run("eval_steps", None, "validate before and after training only"),
    _run("checkpointing_steps", None, "no checkpoints unless asked"),
    _run("checkpoints_total_limit", None, "keep every checkpoint"),
    _run("num_generations", 3, "a few continuations at the end"),
    _run("max_new_tokens", 20, "tokens per continuation"),
    _run("seed", 42, "transformers' seed"),
    _run("torch_threads", None, "torch's thread count"),
)
GIVES_WAY = tuple(rule for rule in RULES if rule.when is not None)
DEFAULT_PRESET = {rule.sets: rule for rule in RULES if rule.sets and rule.when is None}  # "section.name" -> rule
RUN_SETTINGS = frozenset(key for key, rule in DEFAULT_PRESET.items() if rule.run)


def defaults(section: str) -> dict:
    """The default preset's values of one section: {"node_size": 32, ...}."""
    return {key.split(".", 1)[1]: rule.value for key, rule in DEFAULT_PRESET.items() if key.startswith(section + ".")}


def tuned_numbers() -> int:
    """How many numbers of the recipe were tuned on data (not the paper's, the literature's or a library's)."""
    return sum(rule.numbers for rule in RULES)


def recipe_table_markdown() -> str:
    """docs/training.md's rule table: one row per rule, the paper's settings and the run's each in one row."""
    rows = [f"{tuned_numbers()} tuned numbers:", "", "| rule | value or formula | why | evidence (§: ablations.md) |",
            "|---|---|---|---|"]
    grouped = {PAPER: [], RUN: []}
    for rule in RULES:
        if rule.evidence in grouped:
            grouped[rule.evidence].append(f"`{rule.name}` {rule.value!r}")
            continue
        name = f"`{rule.name}`" + (f" (`{rule.sets}`)" if rule.sets and rule.sets.split(".")[1] != rule.name else "")
        shown = f"`{rule.value!r}`" + (f": {rule.formula}" if rule.formula else "")
        rows.append(f"| {name} | {shown} | {rule.why} | {rule.evidence} |")
    rows.append(f"| the paper's shape | {', '.join(grouped[PAPER])} | as published | {PAPER} |")
    rows.append(f"| the run | {', '.join(grouped[RUN])} | not the recipe: `recipe.json` leaves them out | {RUN} |")
    return "\n".join(rows) + "\n"


@dataclass
class RunPlan:
    """The run's length in epochs (None: not known), whether a time budget lets a sparser graph train more of them,
    and what recipe.json records with the choice."""
    planned_epochs: float | None = None
    epochs_grow_with_pruning: bool = False
    max_train_steps: int | None = None
    global_batch: int | None = None
    train_blocks: int | None = None
    device: str | None = None
    mixed_precision: str | None = None


@dataclass
class Setting:
    section: str  # "model", "training" or "tokenizer"
    name: str
    value: object
    rule: str  # the rule of RULES that chose it, or "preset NAME", "flag --NAME", the recipe file's rule
    why: str = ""  # what the data said, where the rule read it


@dataclass
class RecipeChoice:
    """Every setting of a run with the rule behind it, and the inputs the choice read."""
    settings: dict = field(default_factory=dict)  # "section.name" -> Setting
    inputs: dict = field(default_factory=dict)
    pruning: object = None  # the PruningChoice of `min_bigram_count auto` (not saved)
    given: set = field(default_factory=set)  # the keys a preset, a recipe file or a flag set (not saved)

    def add(self, setting: Setting):
        self.settings[f"{setting.section}.{setting.name}"] = setting

    def value(self, section: str, name: str):  # None where the choice has no such setting
        return getattr(self.settings.get(f"{section}.{name}"), "value", None)

    def rule(self, key: str) -> str:
        return self.settings[key].rule

    def section(self, section: str) -> dict:
        return {s.name: s.value for key, s in self.settings.items() if s.section == section and key not in RUN_SETTINGS}

    def describe(self) -> str:
        width = max((len(key) for key in self.settings), default=0)
        lines = {False: [f"the recipe (saved as {RECIPE_NAME}; --recipe FILE applies it again):"],
                 True: ["the run (not part of the recipe):"]}
        for key, s in self.settings.items():
            lines[key in RUN_SETTINGS].append(f"  {key:<{width}} = {s.value!r:<8} [{s.rule}]")
        return "\n".join(lines[False] + (lines[True] if len(lines[True]) > 1 else []))

    def save(self, folder) -> Path:
        saved = [asdict(s) for key, s in self.settings.items() if key not in RUN_SETTINGS]
        path = Path(folder) / RECIPE_NAME
        data = {"format": RECIPE_FORMAT, "settings": saved, "inputs": self.inputs}
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        return path


def load_recipe(path) -> RecipeChoice:
    """A saved recipe.json (a file, or a folder holding one): clear errors for anything else."""
    path = Path(path) / RECIPE_NAME if Path(path).is_dir() else Path(path)
    fix = f"pass the {RECIPE_NAME} a pretraining run saved (in its output folder or a checkpoint)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--recipe {path}: no such file; {fix}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"--recipe {path} is not valid JSON ({err}); {fix}.") from None
    if not isinstance(data, dict) or data.get("format") != RECIPE_FORMAT or not isinstance(data.get("settings"), list):
        raise UsageError(f"--recipe {path} is not a recipe of format {RECIPE_FORMAT}; {fix}.")
    choice = RecipeChoice(inputs=data.get("inputs", {}))
    try:
        for item in data["settings"]:
            choice.add(Setting(**item))
    except TypeError as err:
        raise UsageError(f"--recipe {path}: a setting is malformed ({err}); {fix}.") from None
    return choice
