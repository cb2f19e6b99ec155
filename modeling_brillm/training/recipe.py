"""The default recipe of `examples/pretrain.py` as data: every tuned number and switch it uses (`RULES`), and what
a run chose (`RecipeChoice`, saved as `recipe.json`). `presets.choose_recipe` decides a run's settings from its
data and plan with these rules.

What `BriLLMConfig()` means, and what the recipe adds
-----------------------------------------------------
`BriLLMConfig()` is the released model (BriLLM0.5): a sparse graph, no signal dropout, position weights at one, and
none of the five extensions (non-edge bias, node readout, shared edge matrix, node vectors, count prior), so a
saved config keeps meaning the model it was trained as. The recipe (`MODEL_DEFAULTS`: what pretrain.py trains with
no preset) turns the five extensions on, starts the position weights at 1 + 0.2·k, and sizes the graph
(`min_bigram_count`), the signal dropout and the learning rate to the data and the run's length; its training
values (`TRAINING_RECIPE`) keep transformers' defaults. A preset such as
`brillm-en` or `demo-release` goes back to the release.

Each row of `RULES` is one number or switch, with the value the code uses (`pruning.py` and `presets.py` import it
from here; `count_prior.DISCOUNT` is listed by reference, since saved models ship that module), a one-line why and
its evidence: a `benchmarks/results/*.json` record or a section of `docs/benchmarks.md` (§"Rule ablation" in the
current one, the other § sections in the one of commit 9071684, `git show 9071684:docs/benchmarks.md`). A row marked
`tuned=False` holds the paper's, the literature's or transformers' value, or the neutral one, and is not counted
among the tuned numbers (`tuned_numbers()`). `presets.choose_recipe` returns a `RecipeChoice`: every setting, its
value and the rule (or preset, flag, recipe file) that produced it; pretrain.py prints it and saves it as
`recipe.json`, and `--recipe recipe.json` applies it again verbatim. docs/training.md's rule table is
`recipe_table_markdown()` (a test keeps the two equal).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ..count_prior import DISCOUNT
from .errors import UsageError

RECIPE_NAME = "recipe.json"
RECIPE_FORMAT = 1

# ------------------------------------------------------------------------------------- the probe's numbers
RECURRENCE = 0.8  # the share of its expected held-out occurrences a count class must show to keep its edges
RUNS, PROBE_EVERY = 100, 10  # the training blocks cut into RUNS runs, every PROBE_EVERY-th one held out
MAX_COUNT = 64  # above this every bigram keeps its edge (the estimate has few classes left to go on)
MIN_VISITS = 2  # a kept edge is a training target at least this often in the planned run
STRAYING_COUNT = 2  # where held-out text strays (a dropout bar's novelty), a bigram seen once gets no edge


class Bar(NamedTuple):
    """Where held-out text strays at least `novelty` (the share of its bigram occurrences without an edge): the
    planned epochs past which the signal drops, and past which the count grows with them."""
    novelty: float
    dropout: float
    growth: float


# (novelty, dropout bar, growth bar): from 17% novelty the signal drops past 2 planned epochs, from 5% past 3.
DROPOUT_BARS = (Bar(0.17, 2.0, 2.0), Bar(0.05, 3.0, 4.0))
DROPOUT = 0.3  # past the bar: weaker dropouts let held-out loss turn up
LONG_EPOCHS, LONG_DROPOUT = 7.0, 0.4  # a run of more than LONG_EPOCHS planned epochs drops LONG_DROPOUT
RATE, DROPPING_RATE = 2e-2, 1e-2  # `--learning_rate auto`: DROPPING_RATE wherever the signal drops, else RATE
MAX_GROWTH = 4.5  # past its bar the count grows with the planned epochs to at most this many times the data's count

# ------------------------------------------------------------------------------------- the step on a GPU
GPU_STEP_TOKENS = 65_536  # tokens per process and step on a CUDA device where nothing else gives the batch
FREE_SHARE = 0.9  # the share of the device's free memory the step's estimate may fill
GPU_RECORD = "benchmarks/results/gpu_throughput-20261126T164207Z.json"


@dataclass(frozen=True)
class Rule:
    """One tuned number or switch: `value` is what the code uses; `sets` the setting it is the default of
    ("model.node_size", "training.learning_rate"); `when` (an override) the resolved model fields it applies to."""
    name: str
    value: object
    why: str
    evidence: str
    sets: str | None = None
    formula: str | None = None  # how the value acts, where the number alone does not say
    when: Callable[[dict], bool] | None = None
    tuned: bool = True  # False: the paper's, the literature's or transformers' value, or the neutral one

    @property
    def numbers(self) -> int:
        """How many tuned numbers the rule holds (a switch or "auto" holds none)."""
        def count(value):
            if isinstance(value, tuple):
                return sum(map(count, value))
            return int(isinstance(value, (int, float)) and not isinstance(value, bool))
        return count(self.value) if self.tuned and self.evidence != PAPER else 0

    @property
    def shown(self) -> str:
        value = self.value if not isinstance(self.value, tuple) else [tuple(v) for v in self.value]
        return f"`{value!r}`" + (f": {self.formula}" if self.formula else "")


WHERE = "benchmarks/results/quality-20261128T162129Z.json"  # the whole recipe on eight corpora
KINDS = '§"The default recipe on corpora of three kinds"'
ABLATION = 'docs/benchmarks.md §"Rule ablation"'
S = "docs/benchmarks.md "
PAPER = "the paper"

RULES = (
    # the graph: which bigrams get an edge (--min_bigram_count auto)
    Rule("min_bigram_count", "auto", "an edge is d²+d parameters trained only on its bigram; rare bigrams of one "
         "document do not come back, and their pairs predict better through the back-off (every bigram an edge: "
         "13-22% higher; a fixed 2: 3-10% higher where a run plans far from one pass)", f"{ABLATION}; {S}{KINDS}",
         sets="training.min_bigram_count", formula="the count the probe and the run's length choose (rules below)"),
    Rule("RUNS", RUNS, "runs of consecutive blocks keep a document's sentences together, so the probe is other "
         "documents, as a validation set is", f"{S}{KINDS}", formula="the training blocks cut into this many runs"),
    Rule("PROBE_EVERY", PROBE_EVERY, "a tenth held out leaves nine tenths to count", f"{S}{KINDS}",
         formula="every this-th run is the probe"),
    Rule("RECURRENCE", RECURRENCE, "a count class that comes back in other documents is the pair's, not one "
         "document's", f"{S}{KINDS}", formula="the data count c₀: the smallest c whose class c..2c−1 comes back "
         "at this share of its expected rate"),
    Rule("MAX_COUNT", MAX_COUNT, "the estimate has few classes left to go on", f"{S}{KINDS}",
         formula="past it every bigram keeps its edge"),
    Rule("STRAYING_COUNT", STRAYING_COUNT, "a bigram seen once has one occurrence of one document to learn from",
         f'{S}§"A bigram seen once where text strays"', formula="novelty ≥ 5%: c ≥ max(c₀, 2)"),
    Rule("MIN_VISITS", MIN_VISITS, "an edge that was a target once is little more than its random start, and "
         "every edge costs time in the exact loss", f"{S}{KINDS} (the 25-MB corpora)",
         formula="smallest c ≥ floor with c · E(c) ≥ 2; with a time budget E(c) grows as a sparser graph scores "
         "fewer successors per token"),
    Rule("DROPOUT_BARS", DROPOUT_BARS, "the more held-out text strays, the sooner a long run learns its training "
         "documents' particulars", f'{S}§"Over-fitting on `code`", §"The dropout\'s bar at 3 planned epochs"',
         formula="(novelty, dropout bar, growth bar): past the dropout bar the signal drops, past the growth bar "
         "the count grows"),
    Rule("MAX_GROWTH", MAX_GROWTH, "every pass fits an edge to the same few occurrences again; the ceiling, because "
         "pruning also takes pairs that do come back", f'{S}§"Long runs on text that strays", §"A ceiling on the '
         'count\'s growth"', formula="past the growth bar c ≥ c₀ · E / bar, at most ⌊4.5 · c₀⌋"),
    # the signal dropout and the rate
    Rule("signal_dropout", "auto", "where held-out text strays a long run learns contexts particular to the "
         "training documents and held-out loss turns up", f"{S}{KINDS}; {WHERE}", sets="model.signal_dropout",
         formula="0 below 5% novelty or at E ≤ the dropout bar; DROPOUT past it; LONG_DROPOUT past LONG_EPOCHS"),
    Rule("DROPOUT", DROPOUT, "weaker dropouts let held-out loss turn up; where nothing over-fitted it cost 0-4%",
         f'{S}§"Over-fitting on `code`"'),
    Rule("LONG_EPOCHS", LONG_EPOCHS, "past it DROPOUT let held-out loss turn up over 30 minutes", f'{S}§"Long runs '
         'drop more"', formula="planned epochs past which the signal drops LONG_DROPOUT"),
    Rule("LONG_DROPOUT", LONG_DROPOUT, "over 30 minutes it fell to the end where DROPOUT rose", f'{S}§"Long runs '
         'drop more"'),
    Rule("signal_dropout_warmup_epochs", 1.0, "no block has been seen before in the first pass; the full dropout "
         "from the first step only slows the start", f'{S}§"The dropout\'s warm-up"',
         sets="training.signal_dropout_warmup_epochs", formula="the dropout grows linearly from 0 over these epochs"),
    Rule("learning_rate", "auto", "a lower rate fits sooner: a gain where dropout holds over-fitting off, a loss "
         "where nothing does", f"{S}{KINDS}; {WHERE}", sets="training.learning_rate",
         formula="DROPPING_RATE where the signal drops, else RATE"),
    Rule("RATE", RATE, "without dropout a lower rate fits sooner and turns up", f'{S}§"The rate of 1e-2 where the '
         'signal drops"'),
    Rule("DROPPING_RATE", DROPPING_RATE, "where the signal drops it ended 10 minutes 3-21% below RATE on seven "
         'corpora', f'{S}§"The rate of 1e-2 where the signal drops", §"… in long runs too"'),
    # rates per parameter, schedule, regularisation
    Rule("node_lr_scale", 1.0, "one rate for every parameter: the per-node rate ×2, the shared edge's ×0.5 and "
         "clipping off together moved held-out perplexity by less than the noise on every corpus", ABLATION,
         sets="training.node_lr_scale", formula="rate multiplier of the per-node parameters", tuned=False),
    Rule("shared_edge_lr_scale", 1.0, "as node_lr_scale", ABLATION, sets="training.shared_edge_lr_scale",
         formula="rate multiplier of the shared edge (SparseAdamW)", tuned=False),
    Rule("num_warmup_steps", 0, "transformers' default; a warm-up of 10 steps moved held-out perplexity by less "
         "than the noise", ABLATION, sets="training.num_warmup_steps", tuned=False),
    Rule("lr_scheduler_type", "linear", "transformers' default: the rate falls to zero at the run's end",
         f'{S}§"The learning rate"', sets="training.lr_scheduler_type", tuned=False),
    Rule("weight_decay", 0.0, "transformers' default; 0.1 lowered held-out perplexity 1.9-3.9%, past twice the "
         "noise on one corpus of four", ABLATION, sets="training.weight_decay", tuned=False),
    Rule("lazy_weight_decay", False, "the recipe's runs decayed only the rows a step touches",
         f'{S}§"Training recipe"', sets="training.lazy_weight_decay"),
    Rule("max_grad_norm", 1.0, "transformers' default; with no clipping the run ended within the noise",
         ABLATION, sets="training.max_grad_norm", tuned=False),
    Rule("moment_dtype", None, "16-bit moments pay on a GPU; on a CPU the rounding costs more than the bytes",
         'docs/gpu.md §"Mixed precision"', sets="training.moment_dtype",
         formula="None: bfloat16 under --mixed_precision bf16 with SparseAdamW on a GPU, else float32"),
    # the model: the paper's shape, plus the extensions
    Rule("node_size", 32, "the paper's d", PAPER, sets="model.node_size"),
    Rule("max_position_embeddings", 512, "the paper's position weights", PAPER,
         sets="model.max_position_embeddings"),
    Rule("graph", "sparse", "a dense graph is V² edges (16.9B parameters at V=4000)", "docs/model.md",
         sets="model.graph"),
    Rule("loss_type", "exact", "scores all V nodes; the extensions below need it", f"{S}{KINDS}",
         sets="model.loss_type"),
    Rule("non_edge_bias", True, "unseen continuations are no longer all alike; pruning only helps with it",
         f'{S}§"Training recipe"', sets="model.non_edge_bias", formula="shared edge + a learned energy offset per "
         "node for the pairs without an edge"),
    Rule("node_readout", True, "r_v learns from every occurrence of v, an edge only from its bigram's",
         f"{S}{KINDS}", sets="model.node_readout", formula="logit + ⟨x, r_v⟩"),
    Rule("edge_backoff", True, "a rare edge starts from what the common ones learned", f"{S}{KINDS}",
         sets="model.edge_backoff", formula="x·(edge_base + W[u→v])"),
    Rule("node_embedding", True, "the mix carries which tokens came last, learned from every occurrence of each "
         "token", f'{S}§"The nodes\' own vectors"', sets="model.node_embedding", formula="edge output + e_v"),
    Rule("count_prior", True, "the counts read every training token at once; the edges learn what they miss "
         "(without it 2-10% higher)",
         f'{ABLATION}; {S}§"The count prior"', sets="model.count_prior",
         formula="logit + log p(v \\| u), fixed, built from every training bigram"),
    Rule("count_prior.DISCOUNT", DISCOUNT, "the usual absolute discount (Ney, Essen & Kneser 1994)",
         f'{S}§"The count prior"', formula="p(v \\| u) interpolates max(c − D, 0)/c(u) with an add-one unigram",
         tuned=False),
    Rule("position_recency", 0.2, "left at one, training did not find recency: held-out perplexity 3-9% higher",
         f"{ABLATION}; {S}{KINDS}",
         sets="model.position_recency", formula="position weights start at 1 + 0.2·k: a moving average of the last "
         "~5 edge outputs"),
    # the data: the paper's blocks, batches and tokenizer
    Rule("block_size", 32, "the paper's blocks", PAPER, sets="training.block_size"),
    Rule("block_mode", "sentence", "the paper's: one sentence per block", PAPER, sets="training.block_mode"),
    Rule("per_device_train_batch_size", 32, "the paper's batch", PAPER,
         sets="training.per_device_train_batch_size"),
    Rule("GPU_STEP_TOKENS", GPU_STEP_TOKENS, "a step of 32 × 32 tokens leaves a GPU idle: at the paper's shape the "
         "kernels trained 76,494 tokens/s at 32 × 32 and 1,526,444 at 1024 × 64 (20×)", GPU_RECORD,
         formula="on a CUDA device, where no flag, preset or recipe file gives the batch: per_device_train_batch_size "
         f"= {GPU_STEP_TOKENS:,} // block_size (at most the training blocks per process), halved until the step's "
         f"estimated memory fits {FREE_SHARE} of the device's free memory"),
    Rule("tokenizer kind", "bpe", "byte-level BPE for English (characters for Chinese)", PAPER,
         sets="tokenizer.kind"),
    Rule("tokenizer vocab_size", 4000, "the paper's vocabulary (= graph nodes)", PAPER,
         sets="tokenizer.vocab_size"),
    Rule("tokenizer min_frequency", 2, "the paper's tokenizer", PAPER, sets="tokenizer.min_frequency"),
    # a setup that cannot train a built-in default turns it off (a preset's or a flag's value stays and is refused)
    Rule("sampled loss: no non_edge_bias", False, "the sampled loss's negatives do not cover non-edges",
         "docs/model.md", sets="model.non_edge_bias", when=lambda m: m["loss_type"] == "sampled"),
    Rule("sampled loss: no node_readout", False, "the sampled loss scores a few nodes, the readout all",
         "docs/model.md", sets="model.node_readout", when=lambda m: m["loss_type"] == "sampled"),
    Rule("sampled loss: no count_prior", False, "the prior changes every node's logit", "docs/model.md",
         sets="model.count_prior", when=lambda m: m["loss_type"] == "sampled"),
    Rule("dense graph: no count_prior", False, "the prior is built with a sparse graph's bigrams", "docs/model.md",
         sets="model.count_prior", when=lambda m: m["graph"] == "dense"),
)
OVERRIDES = tuple(rule for rule in RULES if rule.when is not None)


def _defaults(section: str) -> dict:
    return {r.sets.split(".", 1)[1]: r.value for r in RULES if r.when is None and r.sets and
            r.sets.startswith(section + ".")}


MODEL_DEFAULTS = _defaults("model")  # the recipe's model: BriLLMConfig's fields it sets
TRAINING_RECIPE = _defaults("training")  # the recipe's training flags (presets.TRAINING_DEFAULTS adds the rest)
TOKENIZER_DEFAULTS = _defaults("tokenizer")


def default_rule(section: str, name: str) -> str | None:
    """The name of the rule whose value is the recipe's default of `section.name`, if any."""
    return next((r.name for r in RULES if r.when is None and r.sets == f"{section}.{name}"), None)


def tuned_numbers() -> int:
    """How many numbers of the recipe were tuned on data (not the paper's, the literature's or a library's)."""
    return sum(rule.numbers for rule in RULES)


def recipe_table_markdown() -> str:
    """docs/training.md's rule table: one row per rule of `RULES`, the paper's settings together in the last."""
    rows = [f"{tuned_numbers()} tuned numbers:", "", "| rule | value or formula | why | evidence |",
            "|---|---|---|---|"]
    paper = []
    for rule in RULES:
        if rule.evidence == PAPER:
            paper.append(f"`{rule.name}` {rule.value!r}")
            continue
        name = f"`{rule.name}`" + (f" (`{rule.sets}`)" if rule.sets and rule.sets.split(".")[1] != rule.name else "")
        rows.append(f"| {name} | {rule.shown} | {rule.why} | {rule.evidence} |")
    rows.append(f"| the paper's shape | {', '.join(paper)} | as published | {PAPER} |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------------------------------ a run's choice
@dataclass
class RunPlan:
    """What the run is: its length in epochs (None: not known) and whether a time budget lets a sparser graph train
    more of them; the rest is recorded with the choice."""
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
    rule: str  # the rule of RULES that chose it, or "preset NAME", "flag --NAME", "recipe file"
    why: str = ""  # what the data said, where the rule read it


@dataclass
class RecipeChoice:
    """Every setting the recipe decided for a run, with the rule behind it, and the inputs it read."""
    settings: dict = field(default_factory=dict)  # "section.name" -> Setting
    inputs: dict = field(default_factory=dict)
    pruning: object = None  # the PruningChoice of `min_bigram_count auto` (not saved)

    def add(self, setting: Setting):
        self.settings[f"{setting.section}.{setting.name}"] = setting

    def value(self, section: str, name: str):
        return self.settings[f"{section}.{name}"].value

    def section(self, section: str) -> dict:
        return {s.name: s.value for s in self.settings.values() if s.section == section}

    def describe(self) -> str:
        width = max((len(key) for key in self.settings), default=0)
        lines = [f"the recipe (saved as {RECIPE_NAME}; --recipe FILE applies it again):"]
        lines += [f"  {key:<{width}} = {s.value!r:<8} [{s.rule}]" for key, s in self.settings.items()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"format": RECIPE_FORMAT, "settings": [asdict(s) for s in self.settings.values()],
                "inputs": self.inputs}

    def save(self, folder) -> Path:
        path = Path(folder) / RECIPE_NAME
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path


def load_recipe(path) -> RecipeChoice:
    """A saved recipe.json (a file, or a folder holding one): clear errors for anything else."""
    path = Path(path)
    if path.is_dir():
        path = path / RECIPE_NAME
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
