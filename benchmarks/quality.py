"""Quality against a Transformer: BriLLM and small GPT-2 models, the same data, the same training-time budget.

    python benchmarks/quality.py                                   # embedded corpus, budgets 30 90 180 s
    python benchmarks/quality.py --budgets 30 120 300 --gpt2 2x64 4x128 4x256@1e-3 --batch_size 256
    python benchmarks/quality.py --train_file train.txt --validation_file valid.txt --output_dir outputs/q
    python benchmarks/quality.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 \
        --budgets 60 600 --schedule constant --more_brillm configuration/models/demo-release.json

Every BriLLM row IS an examples/pretrain.py run: its `run()` (modeling_brillm.training.pretraining) in this process
(the data prepared once and shared), with `--max_train_time` the largest budget and the curve points as
`--eval_seconds`; the equivalent command line is printed for each row and stored in quality.json
(`pretrain_command`), and running it gives the same losses and held-out figures (up to the timing of the steps: the
budget stops the run and, with `auto` choices, plans its epochs). The row's folder (`<output_dir>/brillm`,
`brillm-<preset>`) holds what pretrain.py writes: the model, train_log.jsonl (the curve), pretrain_summary.json.

What is the same for every model (the fairness rules):
- data, tokenizer and blocks come from examples/pretrain.py's own preparation with its built-in defaults or a
  --config preset: the embedded corpus (or --train_file / --validation_file), the byte-level BPE it trains on the
  training text, one sentence per block of --block_size tokens (padding masked), the held-out validation blocks;
- the training step: the pretraining code's TrainStep (token-weighted loss, gradient clipping, optimizer and
  scheduler step) for every model;
- the training batches and their order: pretrain.py's seeded loader (a permutation of the training blocks per
  epoch, seed + epoch); GPT-2 draws the same permutations (BatchOrder). The batch is --batch_size blocks for every
  model when given; by default each model's own: BriLLM's recipe (what pretrain.py chooses) and 64 for GPT-2;
- the score: the pretraining code's evaluator (training.loop.evaluate): token-weighted held-out perplexity
  exp(sum of NLL / number of targets) over the same target tokens (a real token after a real token in a block),
  the full softmax over all V nodes for BriLLM, over its LM head's V for GPT-2;
- the budget: seconds of training (the steps; evaluation is not counted), on the same torch thread count
  (--threads), in one process. One run per model up to the largest budget; the held-out perplexity is taken
  whenever the training clock passes a curve point, and at the end. After a warmup counted in steps every model's
  rate follows one rule over the training clock: by default pretrain.py's linear decay to zero at the largest
  budget (the package's one training clock and schedule, modeling_brillm.training.epochs: TrainingClock,
  make_schedule), so a smaller budget's figure comes from a run not yet annealed (a run given that budget alone would
  decay within it); --schedule constant holds the rate, so every budget's figure comes from a run whose schedule
  does not depend on that budget; --schedule cosine decays along a cosine. The models
  train one after the other (a BriLLM row is a pretrain.py run of its own, so the models cannot take turns): run
  it on a quiet machine; the load other processes put on it during each run is reported per model.
- --max_train_steps caps every model's steps (a short run whose figures do not depend on the machine's pace).

Each model keeps its own sensible optimizer: BriLLM what pretrain.py gives it in one process (SparseAdamW on sparse
edge gradients) with the preset's recipe (learning rate, weight decay and its lazy mode, shared-edge and node rates,
warmup, clipping, graph pruning, signal dropout, non-edge bias; --more_brillm adds other presets' recipes on the
same data). Its `auto` choices are told the run's length as pretrain.py's --max_train_time tells them: the epochs
the largest budget buys, timed on a few throwaway steps before the run. GPT-2 (transformers' GPT2LMHeadModel,
dropout 0, tied embeddings) trains with AdamW (--gpt2_lr, default 3e-3, weight decay 0.01, --gpt2_warmup (20)
steps of linear warmup, gradient clipping at 1.0). 3e-3 was the best of 1e-3 / 3e-3 / 6e-3 / 1.2e-2 for 2x64 and
4x128 at 100 and 300 steps of batch 64 on the embedded corpus; 4x256 does better with 1e-3 (its default:
4x256@1e-3). The GPT-2 runs use this module's harness (BudgetRun); it has no BriLLM training loop, evaluator or
epoch planner of its own. benchmarks/recipe_sweep.py builds its BriLLM variants the same way (brillm_argv,
shared_data, brillm_row) and its GPT-2 references in the same harness.

Runs where pretrain.py runs: on the GPU when there is one (CUDA_VISIBLE_DEVICES= for the CPU). Writes
<output_dir>/quality.json (settings, data, every model's parameters, curve and pretrain.py command, the table per
budget) and <output_dir>/quality.png (held-out perplexity against training seconds and against training tokens).
Exit status 2 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS_NAME = "quality.json"
PLOT_NAME = "quality.png"
DEFAULT_GPT2 = ["2x64", "4x128", "4x256@1e-3"]  # learning rates: the best of a sweep at fixed steps
GPT2_BATCH = 64  # GPT-2's blocks per step unless --batch_size is given
SCHEDULERS = {"linear": "linear", "constant": "constant_with_warmup", "cosine": "cosine"}  # pretrain.py's names
GPT2_SIZE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?(?:@([0-9.eE+-]+))?$")  # layers x width [x heads] [@lr]


from modeling_brillm.training import pretraining as pretrain  # noqa: E402  (pretrain.py's flags, checks and run)
from modeling_brillm.training.epochs import TrainingClock, make_schedule  # noqa: E402  (the one clock and schedule)

UsageError = pretrain.UsageError


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--budgets", type=float, nargs="+", default=[30.0, 90.0, 180.0],
                   help="Training budgets in seconds (evaluation excluded); one run per model up to the largest "
                   "(BriLLM: pretrain.py --max_train_time).")
    p.add_argument("--curve_points", type=int, default=10,
                   help="Extra evaluation points, log-spaced from 1/64 of the largest budget up to it.")
    p.add_argument("--gpt2", nargs="*", default=DEFAULT_GPT2, metavar="LxE[xH][@LR]",
                   help="GPT-2 sizes: layers x width [x heads] [@learning rate] (heads default width/32, learning "
                   "rate --gpt2_lr); `--gpt2` alone or `--gpt2 none` trains no GPT-2.")
    p.add_argument("--no_brillm", action="store_true", help="Train only the GPT-2 models.")
    p.add_argument("--config", default=None, help="Pretraining preset of BriLLM, data and tokenizer settings (default: "
                   "none, examples/pretrain.py's built-in defaults, so the BriLLM here is the one it trains).")
    p.add_argument("--more_brillm", nargs="*", default=[], metavar="PRESET",
                   help="More BriLLM recipes (preset names or JSON paths) trained beside the first on the same data: "
                   "their model and training sections, their own graph; the data flags stay --config's.")
    p.add_argument("--train_file", help="Training text (.txt one text per line, .json/.jsonl, .csv); default: "
                   "the embedded corpus.")
    p.add_argument("--validation_file", help="Held-out text, same format (default: every 20th training text).")
    p.add_argument("--text_column", default="text", help="Text field of json/csv data.")
    p.add_argument("--vocab_size", type=int, help="BPE vocabulary to train (default: the preset's).")
    p.add_argument("--block_size", type=int, help="Tokens per block (default: the preset's).")
    p.add_argument("--batch_size", type=int, default=None,
                   help="Blocks per training step, every model (default: each model's own: BriLLM the recipe's, "
                   f"as pretrain.py chooses it; GPT-2 {GPT2_BATCH}).")
    p.add_argument("--eval_batch_size", type=int, default=256, help="Blocks per evaluation forward pass.")
    p.add_argument("--max_eval_blocks", type=int, default=None, help="Score at most this many held-out blocks.")
    p.add_argument("--gpt2_lr", type=float, default=3e-3, help="GPT-2 peak learning rate (AdamW).")
    p.add_argument("--gpt2_warmup", type=int, default=20, help="GPT-2 linear warmup steps.")
    p.add_argument("--schedule", choices=["linear", "constant", "cosine"], default="linear",
                   help="Learning rate after the warmup, the same rule for every model: a linear decay over the "
                   "training clock from the peak to zero at the largest budget (BriLLM: pretrain.py's default), "
                   "constant (--lr_scheduler_type constant_with_warmup), or a cosine over the clock (cosine). With a "
                   "decay, the smaller budgets' figures come from a run not yet annealed.")
    p.add_argument("--max_train_steps", type=int, default=None,
                   help="Stop every model after this many steps if its clock has not passed the largest budget "
                   "first (pretrain.py's flag of the same name).")
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same for every model.")
    p.add_argument("--seed", type=int, default=42, help="Seed of initialisations and batch order.")
    p.add_argument("--output_dir", default="outputs/quality", help="Where quality.json and quality.png go.")
    p.add_argument("--no-wait-quiet", "--no_wait_quiet", dest="wait_quiet", action="store_false",
                   help="Do not wait (up to a minute) for other processes to leave the CPUs before training.")
    from common import add_results_dir

    return add_results_dir(p).parse_args(argv)


def gpt2_sizes(specs, default_lr: float) -> list[tuple[int, int, int, float]]:
    """(layers, width, heads, learning rate) of every --gpt2 spec; none for `--gpt2 none`."""
    if [spec.lower() for spec in specs] == ["none"]:
        return []
    sizes = []
    for spec in specs:
        match = GPT2_SIZE.match(spec)
        if not match:
            raise UsageError(f"--gpt2 {spec!r}: give layers x width [x heads] [@learning rate], e.g. 2x64, "
                             "4x256x8 or 4x256@1e-3.")
        layers, width = int(match.group(1)), int(match.group(2))
        heads = int(match.group(3)) if match.group(3) else max(1, width // 32)
        if layers < 1 or width < 1 or heads < 1:
            raise UsageError(f"--gpt2 {spec!r}: layers, width and heads must be positive.")
        if width % heads:
            raise UsageError(f"--gpt2 {spec!r}: the width {width} must be a multiple of the heads {heads}.")
        try:
            lr = float(match.group(4)) if match.group(4) else default_lr
        except ValueError:
            lr = float("nan")
        if not (lr > 0 and math.isfinite(lr)):
            raise UsageError(f"--gpt2 {spec!r}: the learning rate after @ must be a positive number.")
        sizes.append((layers, width, heads, lr))
    return sizes


def check_args(args):
    if any(not (b > 0 and math.isfinite(b)) for b in args.budgets):
        raise UsageError(f"--budgets must be positive numbers of seconds, got {args.budgets}.")
    if len(set(args.budgets)) != len(args.budgets):
        raise UsageError(f"--budgets has repeated values: {args.budgets}.")
    for name in ("batch_size", "eval_batch_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        raise UsageError(f"--max_train_steps must be a positive integer, got {args.max_train_steps}.")
    if args.curve_points < 0:
        raise UsageError(f"--curve_points must be >= 0, got {args.curve_points}.")
    if args.max_eval_blocks is not None and args.max_eval_blocks < 1:
        raise UsageError(f"--max_eval_blocks must be a positive integer, got {args.max_eval_blocks}.")
    if not args.gpt2_lr > 0 or args.gpt2_warmup < 0:
        raise UsageError("--gpt2_lr must be positive and --gpt2_warmup >= 0.")
    if args.no_brillm and not args.gpt2:
        raise UsageError("nothing to train: --no_brillm and no --gpt2 size.")


def curve_points(budgets, extra: int) -> list[float]:
    top = max(budgets)
    points = set(budgets)
    if extra:
        points.update(top / 64 * 64 ** (i / extra) for i in range(extra))
    return sorted(points)


# ---------------------------------------------------------------------------------------------------- data
def labels_of(ids, mask):
    return ids.masked_fill(mask == 0, -100)


def target_mask(mask):
    """Targets scored by both models: position t+1 when tokens t and t+1 are real (as the training data module's
    count_targets counts them)."""
    return (mask[:, 1:] != 0) & (mask[:, :-1] != 0)


class BatchOrder:
    """The same stream of training batches for every model: a seeded permutation of the blocks per epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed

    def __iter__(self):
        import torch

        epoch = 0
        while True:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            for start in range(0, self.n - self.batch_size + 1, self.batch_size):  # full batches only
                yield order[start:start + self.batch_size]
            epoch += 1


# ------------------------------------------------------------------------------------------------ models
def make_gpt2(data, size, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads = size[:3]
    tok = data["tokenizer"]
    config = GPT2Config(vocab_size=len(tok), n_positions=data["train"][0].shape[1], n_embd=width, n_layer=layers,
                        n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers cannot infer it from the class name GPT2LMHeadModel (it warns)
    return model


def gpt2_batch(args) -> int:
    return args.batch_size or GPT2_BATCH


def package_step(accelerator, model, optimizer, scheduler, args, block_size: int, max_grad_norm):
    """step(ids, mask) -> training loss, through the pretraining code's TrainStep (forward, token-weighted
    backward, gradient clipping, optimizer and scheduler step), the same for every model."""
    from modeling_brillm.training.loop import TrainStep

    train_step = TrainStep(accelerator, model, optimizer, scheduler, per_device_batch_size=gpt2_batch(args),
                           block_size=block_size, max_grad_norm=max_grad_norm, clip=bool(max_grad_norm),
                           learning_rate=optimizer.param_groups[0]["lr"])

    def step(ids, mask):
        return train_step({"input_ids": ids, "attention_mask": mask, "labels": labels_of(ids, mask)}).loss

    return step


def schedule_text(args) -> str:
    if args.schedule == "constant":
        return "constant after warmup"
    return f"{args.schedule} over {max(args.budgets):g} training seconds to zero, after warmup"


def gpt2_trainer(model, lr: float, warmup: int, data, args, accelerator, device):
    """GPT-2's usual recipe: fused AdamW (weight decay 0.01 on matrices), linear warmup then --schedule, gradient
    norm clipped to 1.0; the step, the clock and the schedule are the pretraining code's, as pretrain.py's for
    BriLLM (TrainStep, epochs.TrainingClock, epochs.make_schedule)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type in ("cpu", "cuda"))
    clock = TrainingClock(max(args.budgets))
    scheduler = make_schedule(optimizer, SCHEDULERS[args.schedule], warmup, clock=clock)
    step = package_step(accelerator, model, optimizer, scheduler, args, data["pargs"].block_size, 1.0)
    info = dict(optimizer="adamw (fused)", lr=lr, weight_decay=0.01, warmup_steps=warmup,
                schedule=schedule_text(args), grad_clip=1.0)
    return step, info, clock


def heldout_nll(model, held, batch_size: int, accelerator) -> tuple[float, int]:
    """(summed NLL in nats, number of targets) over the held-out blocks through the pretraining code's evaluator
    (training.loop.evaluate): the full softmax at the same targets for every model (a real token after a real
    token). Leaves the model in training mode."""
    from modeling_brillm.training.loop import evaluate

    device = accelerator.device
    batches = ({"input_ids": ids.to(device), "attention_mask": mask.to(device),
                "labels": labels_of(ids, mask).to(device)}
               for ids, mask in zip(held[0].split(batch_size), held[1].split(batch_size)))
    loss, _, count = evaluate(model, batches, accelerator)
    return (loss * count if count else 0.0), count


def bigram_reference(data, k: float = 0.1) -> float:
    """Held-out perplexity of add-k smoothed bigram counts of the training targets: what the previous token
    alone gives, for reading the curves (not a trained model, no clock)."""
    import torch

    V = len(data["tokenizer"])

    def pairs(ids, mask):
        keep = target_mask(mask)
        return ids[:, :-1][keep], ids[:, 1:][keep]

    u, v = pairs(*data["train"])
    counts = torch.bincount(u * V + v, minlength=V * V).view(V, V).double()
    probs = (counts + k) / (counts.sum(1, keepdim=True) + k * V)
    hu, hv = pairs(*data["held"])
    return math.exp(float(-probs[hu, hv].log().mean()))


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- training
class BudgetRun:
    """One GPT-2's training against the clock: `train()` trains until its training clock (seconds of forward,
    backward and optimizer step, nothing else) passes the last of `points` (or --max_train_steps), and evaluates each
    time the clock passes one of them."""

    def __init__(self, label, model, step, data, points, args, device, clock=None):
        import torch
        from common import CpuMonitor

        self.label, self.model, self.step, self.data, self.args, self.device = label, model, step, data, args, device
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.batches = iter(BatchOrder(len(data["train"][0]), gpt2_batch(args), args.seed))
        self.pending = list(points)
        self.clock = clock or TrainingClock()  # its seconds: what the schedule over the clock reads
        self.steps, self.tokens, self.targets = 0, 0, 0
        self.loss_sum, self.loss_steps = 0.0, 0
        self.monitor, self.load_seconds, self.wall_seconds = CpuMonitor(), 0.0, 0.0
        model.to(device).train()
        self.curve = [self.evaluate()]

    def evaluate(self) -> dict:
        started = time.perf_counter()
        total, count = heldout_nll(self.model, self.data["held"], self.args.eval_batch_size,
                                   self.data["accelerator"])
        nll = total / count
        last = self.loss_sum / self.loss_steps if self.loss_steps else None
        point = dict(train_seconds=round(self.clock.seconds, 3), steps=self.steps, train_tokens=self.tokens,
                     train_targets=self.targets, train_loss=last, eval_nll=nll, perplexity=math.exp(min(nll, 700.0)),
                     eval_tokens=count, eval_seconds=round(time.perf_counter() - started, 3))
        self.loss_sum, self.loss_steps = 0.0, 0
        print(f"  {self.label:>18} {self.clock.seconds:8.1f}s step {self.steps:6d}  held-out perplexity "
              f"{point['perplexity']:10.2f}" + (f"  (train loss {last:.3f})" if last is not None else ""))
        return point

    def train(self):
        ids_all, mask_all = self.data["train"]
        self.monitor.start()
        wall = time.perf_counter()
        cap = self.args.max_train_steps or math.inf
        while self.pending and self.steps < cap:
            index = next(self.batches)
            ids, mask = ids_all[index], mask_all[index]
            self.sync()
            started = time.perf_counter()
            ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
            loss = float(self.step(ids, mask))
            self.sync()
            self.clock.seconds += time.perf_counter() - started
            self.steps += 1
            self.tokens += int(mask.sum())
            self.targets += int(target_mask(mask).sum())
            self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
            if not math.isfinite(loss):
                raise RuntimeError(f"{self.label}: the training loss is {loss} at step {self.steps}; lower its "
                                   "learning rate.")
            if self.clock.seconds >= self.pending[0]:
                while self.pending and self.clock.seconds >= self.pending[0]:
                    self.pending.pop(0)
                self.curve.append(self.evaluate())
        if self.pending and self.curve[-1]["steps"] < self.steps:  # stopped by the step cap: its final evaluation
            self.curve.append(self.evaluate())
        wall = time.perf_counter() - wall
        self.load_seconds = self.monitor.stop() * wall  # other processes' load, evaluations included
        self.wall_seconds = wall

    def result(self) -> dict:
        return dict(curve=self.curve, steps=self.steps, train_seconds=round(self.clock.seconds, 3),
                    tokens_per_second=round(self.tokens / max(self.clock.seconds, 1e-9), 1),
                    other_cpu_load=round(self.load_seconds / max(self.wall_seconds, 1e-9), 3))


def at_budget(curve, budget: float) -> dict:
    """The evaluation taken when the training clock first passed `budget`; the last one of a run that stopped
    before it (--max_train_steps)."""
    return next((p for p in curve if p["train_seconds"] >= budget), curve[-1])


# ---------------------------------------------------------------------------------------------- outputs
def write_json_atomic(path: Path, obj):
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def plot(results: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for model in results["models"]:
        curve = [p for p in model["curve"] if p["steps"] > 0]
        style = dict(marker="o", markersize=3, linewidth=2.2 if model["kind"] == "brillm" else 1.4)
        axes[0].plot([p["train_seconds"] for p in curve], [p["perplexity"] for p in curve], label=model["label"],
                     **style)
        axes[1].plot([p["train_tokens"] for p in curve], [p["perplexity"] for p in curve], label=model["label"],
                     **style)
    bigram = results.get("bigram_add_0_1_perplexity")
    if bigram:
        for ax in axes:
            ax.axhline(bigram, color="black", linewidth=0.8, linestyle="--", label="bigram counts (add-0.1)")
    for b in results["settings"]["budgets"]:
        axes[0].axvline(b, color="grey", linewidth=0.6, linestyle=":")
    axes[0].set_xlabel("training seconds (evaluation excluded)")
    axes[1].set_xlabel("training tokens")
    def short(value, _):
        for scale, unit in ((1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:g}{unit}"
        return f"{value:g}"

    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=(1.0,) if axis is axes[1].xaxis else (1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(short))
            axis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("held-out perplexity (token-weighted)")
        ax.grid(True, which="both", linewidth=0.3)
    axes[0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"BriLLM vs GPT-2, same tokenizer (V={results['data']['vocab_size']}), blocks and budget; "
                 f"{s['threads']} thread(s), {s['device']}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def markdown_table(results: dict) -> str:
    """The results as a Markdown table (docs/benchmarks.md shows them)."""
    budgets = results["settings"]["budgets"]
    head = ("| model | parameters | " + " | ".join(f"ppl @ {b:g} s" for b in budgets)
            + " | steps | tokens/s | train tokens | other load |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in results["models"]:
        cells = " | ".join(f"{results['perplexity_at_budget'][str(b)][m['label']]:,.1f}" for b in budgets)
        last = m["curve"][-1]
        lines.append(f"| {m['label']} | {m['parameters'] / 1e6:.2f}M | {cells} | {m['steps']:,} | "
                     f"{m['tokens_per_second']:,.0f} | {last['train_tokens']:,} | {m['other_cpu_load']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- BriLLM rows
def brillm_argv(args, preset, points, first=None, name=None, schedule=None) -> list[str]:
    """examples/pretrain.py's flags for one BriLLM row. `first`: the first row's settled arguments, whose data
    settings (tokenizer, blocks, validation split) a --more_brillm row keeps, so every row trains on the same data;
    `name`: its folder under --output_dir; `schedule`: constant or cosine (default --schedule)."""
    argv = ["--seed", str(args.seed), "--text_column", args.text_column]
    argv += ["--config", preset] if preset else []
    for flag in ("train_file", "validation_file"):
        argv += [f"--{flag}", str(getattr(args, flag))] if getattr(args, flag) else []
    if first is None:
        argv += [x for flag in ("vocab_size", "block_size") if getattr(args, flag) is not None
                 for x in (f"--{flag}", str(getattr(args, flag)))]
    else:
        argv += ["--vocab_size", str(first.vocab_size), "--tokenizer_kind", first.tokenizer_kind,
                 "--tokenizer_min_frequency", str(first.tokenizer_min_frequency), "--block_size",
                 str(first.block_size), f"--{first.block_mode}_blocks", "--validation_split_percentage",
                 f"{first.validation_split_percentage:g}"]
    argv += ["--per_device_train_batch_size", str(args.batch_size)] if args.batch_size else []
    argv += ["--per_device_eval_batch_size", str(args.eval_batch_size)]
    argv += ["--max_eval_samples", str(args.max_eval_blocks)] if args.max_eval_blocks else []
    top = max(args.budgets)
    argv += ["--max_train_time", f"{top:g}"]
    argv += ["--eval_seconds", *(f"{p:.6g}" for p in points if p < top)] if any(p < top for p in points) else []
    argv += ["--max_train_steps", str(args.max_train_steps)] if args.max_train_steps else []
    schedule = schedule or args.schedule
    if schedule != "linear" or preset:  # linear is pretrain.py's default; a preset may name another
        argv += ["--lr_scheduler_type", SCHEDULERS[schedule]]
    name = name or ("brillm" if first is None else f"brillm-{Path(preset).stem}")
    return argv + ["--torch_threads", str(args.threads), "--num_generations", "0",
                   "--output_dir", str(Path(args.output_dir) / name)]


def command_line(argv) -> str:
    """The shell command of a pretrain.py run (what a BriLLM row is)."""
    import shlex

    return "python examples/pretrain.py " + " ".join(shlex.quote(a) for a in argv)


def parse_pretrain(argv):
    try:
        return pretrain.parse_args(argv)
    except SystemExit:
        raise UsageError(f"the pretraining script refused the arguments {argv}.") from None


def shared_data(argv):
    """pretrain.py's data (raw text, tokenizer, blocks) for the first row's flags, prepared once for every row; the
    first row's settled arguments; the accelerator (the same one-process setup pretrain.py makes)."""
    from modeling_brillm.training.launch import make_accelerator as pretrain_accelerator

    pargs = parse_pretrain(argv)
    resolved = pretrain.settle(pargs)
    tok_settings = resolved.section("tokenizer")
    # what a --more_brillm row is told so that it prepares the same data (brillm_argv)
    pargs.vocab_size, pargs.tokenizer_kind = tok_settings["vocab_size"], tok_settings["kind"]
    pargs.tokenizer_min_frequency = tok_settings["min_frequency"]
    accelerator, _ = pretrain_accelerator(pargs, shards_on_cpu=True)
    out = Path(pargs.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = pretrain.load_data(pargs, resolved, accelerator, out, None)
    if data.eval is None:
        raise UsageError("no held-out text: give --validation_file, or more training texts (every 20th is held out).")
    return data, pargs, accelerator


def brillm_row(argv, data, label_suffix: str) -> dict:
    """One BriLLM row: pretrain.py's run() in this process on the shared data; its curve read from its
    train_log.jsonl (every evaluation, with the mean training loss of the steps since the one before)."""
    from common import CpuMonitor

    from modeling_brillm.training.checkpoints import LOG_NAME, read_log

    print(f"\nBriLLM{label_suffix}: {command_line(argv)}", flush=True)
    pargs = parse_pretrain(argv)
    monitor, wall = CpuMonitor(), time.perf_counter()
    monitor.start()
    if pretrain.run(pargs, data=data) != 0:
        raise RuntimeError(f"the pretraining run failed: {command_line(argv)}")
    load, wall = monitor.stop(), time.perf_counter() - wall
    out = Path(pargs.output_dir)
    summary = json.loads((out / pretrain.SUMMARY_NAME).read_text(encoding="utf-8"))
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    curve, losses = [], []
    for record in read_log(out / LOG_NAME):
        if "loss" in record:
            losses.append(record["loss"])
        elif "eval_loss" in record:
            curve.append(dict(train_seconds=record["train_seconds"], steps=record["step"],
                              train_tokens=record["train_tokens"],
                              train_loss=sum(losses) / len(losses) if losses else None, eval_nll=record["eval_loss"],
                              perplexity=record["perplexity"], eval_tokens=record["eval_tokens"]))
            losses = []
    return dict(kind="brillm", label=f"BriLLM d={config['node_size']}{label_suffix}",
                parameters=summary["num_parameters"], preset=pargs.config, pretrain_command=command_line(argv),
                pretrain_argv=argv, output_dir=str(out),
                parameters_note=f"{config['num_edges']:,} edges of {config['node_size']}x{config['node_size']} (+ the "
                "shared edge); a step touches only the edges leaving the batch's tokens",
                batch_size=pargs.per_device_train_batch_size, optimizer=pargs.optimizer, lr=pargs.learning_rate,
                weight_decay=pargs.weight_decay,
                warmup_steps=pargs.num_warmup_steps, lazy_weight_decay=pargs.lazy_weight_decay,
                shared_edge_lr_scale=pargs.shared_edge_lr_scale, node_lr_scale=pargs.node_lr_scale,
                min_bigram_count=pargs.min_bigram_count, planned_epochs=round(pargs.planned_epochs, 3),
                signal_dropout_warmup_epochs=pargs.signal_dropout_warmup_epochs, schedule=pargs.lr_scheduler_type,
                grad_clip=pargs.max_grad_norm, curve=curve, steps=summary["steps"],
                train_seconds=summary["train_seconds"], tokens_per_second=summary["tokens_per_second"],
                other_cpu_load=round(load, 3), wall_seconds=round(wall, 1),
                **{k: config[k] for k in ("node_size", "num_edges", "signal_dropout", "non_edge_bias", "node_readout",
                                          "edge_backoff", "node_embedding", "count_prior", "position_recency")})


def tensors(blocks):
    rows = blocks.with_format("torch")[:]
    return rows["input_ids"].long(), rows["attention_mask"].long()


def harness_data(pretrain_data, first, accelerator, batch_size: int) -> dict:
    """The shared blocks as tensors, for the GPT-2 harness (BudgetRun) and the bigram reference."""
    data = dict(tokenizer=pretrain_data.tokenizer, train=tensors(pretrain_data.train),
                held=tensors(pretrain_data.eval), pargs=first, accelerator=accelerator)
    if len(data["train"][0]) < batch_size:
        raise UsageError(f"{len(data['train'][0])} training blocks cannot fill one batch of {batch_size}; lower "
                         "--batch_size or give more text.")
    return data


# ------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_args(args)
    sizes = gpt2_sizes(args.gpt2, args.gpt2_lr)
    from common import machine, wait_for_quiet

    output_dir = Path(args.output_dir)
    points = curve_points(args.budgets, args.curve_points)
    started = time.time()
    argv0 = brillm_argv(args, args.config, points)
    pretrain_data, first, accelerator = shared_data(argv0)
    device = accelerator.device
    data = harness_data(pretrain_data, first, accelerator, gpt2_batch(args))
    tok = data["tokenizer"]
    held_targets = int(target_mask(data["held"][1]).sum())
    print(f"data: {pretrain_data.description}")
    print(f"tokenizer: {len(tok)} tokens; {len(data['train'][0]):,} training blocks, {len(data['held'][0]):,} "
          f"held-out blocks ({held_targets:,} targets) of {data['train'][0].shape[1]} tokens; prepared in "
          f"{time.time() - started:.1f}s")
    print(f"machine: {machine()}, device {device}; budgets {args.budgets} s, "
          f"curve points {[round(p, 1) for p in points]}")
    rows = [] if args.no_brillm else [(argv0, "")]
    rows += [(brillm_argv(args, preset, points, first), f" ({Path(preset).stem})") for preset in args.more_brillm]
    if args.more_brillm and rows:
        rows[0] = (argv0, f" ({Path(args.config).stem if args.config else 'defaults'})")
    load_before = wait_for_quiet(max_wait_s=60) if args.wait_quiet else None
    models = [brillm_row(argv, pretrain_data, suffix) for argv, suffix in rows]
    for size in sizes:
        models.append(gpt2_row(size, data, points, args, accelerator))

    table = {str(b): {m["label"]: round(at_budget(m["curve"], b)["perplexity"], 3) for m in models}
             for b in sorted(args.budgets)}
    results = dict(
        settings=dict(budgets=sorted(args.budgets), curve_points=points, batch_size=args.batch_size,
                      gpt2_batch_size=gpt2_batch(args),
                      threads=args.threads, device=str(device), seed=args.seed, config=args.config,
                      max_train_steps=args.max_train_steps, gpt2_lr=args.gpt2_lr, gpt2_warmup=args.gpt2_warmup,
                      schedule=schedule_text(args), order="one model after the other",
                      other_cpu_load_before=None if load_before is None else round(load_before, 3),
                      machine=machine(), started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))),
        data=dict(description=pretrain_data.description, vocab_size=len(tok),
                  block_size=int(data["train"][0].shape[1]), train_blocks=len(data["train"][0]),
                  train_tokens=int(data["train"][1].sum()), heldout_blocks=len(data["held"][0]),
                  heldout_targets=held_targets),
        models=models, perplexity_at_budget=table, bigram_add_0_1_perplexity=round(bigram_reference(data), 3))
    write_json_atomic(output_dir / RESULTS_NAME, results)
    plot(results, output_dir / PLOT_NAME)
    report(results, models, args, output_dir)
    return results


def gpt2_row(size, data, points, args, accelerator) -> dict:
    """One GPT-2 row in this module's harness (BudgetRun): the same blocks, batch order, step and evaluator."""
    device = accelerator.device
    model = make_gpt2(data, size, args.seed).to(device)
    label = f"GPT-2 {size[0]}L {size[1]}w {size[2]}h"
    step, info, clock = gpt2_trainer(model, size[3], args.gpt2_warmup, data, args, accelerator, device)
    params = count_parameters(model)
    print(f"\n{label}: {params:,} parameters; {info['optimizer']} lr {info['lr']}")
    run = BudgetRun(label, model, step, data, points, args, device, clock=clock)
    run.train()
    return dict(kind="gpt2", label=label, parameters=params, size=dict(zip(("layers", "width", "heads"), size[:3])),
                parameters_note="dense: every parameter is used and updated every step (tied input/output embeddings)",
                **info, **run.result())


def report(results, models, args, output_dir):
    table = results["perplexity_at_budget"]
    print("\nheld-out perplexity at each budget (token-weighted, the same targets):")
    width = max(len(m["label"]) for m in models)
    print(f"{'model':<{width}}  {'params':>12}  " + "  ".join(f"{f'{b:g} s':>9}" for b in sorted(args.budgets))
          + "  tokens/s  other load")
    for m in models:
        cells = "  ".join(f"{table[str(b)][m['label']]:9.2f}" for b in sorted(args.budgets))
        print(f"{m['label']:<{width}}  {m['parameters']:12,}  {cells}  {m['tokens_per_second']:8,.0f}  "
              f"{m['other_cpu_load']}")
    print(f"bigram counts, add-0.1 (reference): held-out perplexity {results['bigram_add_0_1_perplexity']:.2f}")
    for m in models:
        if m["kind"] == "brillm":
            print(f"{m['label']} is: {m['pretrain_command']}")
    print("\n" + markdown_table(results))
    print(f"wrote {output_dir / RESULTS_NAME} and {output_dir / PLOT_NAME}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    from common import write_record

    write_record("quality", args, results, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
