"""Quality against a Transformer: BriLLM and small GPT-2 models, the same data, the same wall-clock budget.

    python benchmarks/quality.py                                   # embedded corpus, budgets 30 90 180 s
    python benchmarks/quality.py --budgets 30 120 300 --gpt2 2x64 4x128 4x256@1e-3 --batch_size 256
    python benchmarks/quality.py --train_file train.txt --validation_file valid.txt --output_dir outputs/q
    python benchmarks/quality.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 \
        --budgets 60 600 --schedule cosine --more_brillm configuration/models/demo-release.json

What is the same for every model (the fairness rules):
- data, tokenizer and blocks come from the package's pretraining code (modeling_brillm.training, with
  examples/pretrain.py's flags and checks) with its built-in defaults or a --config preset: the embedded corpus (or
  --train_file / --validation_file), the byte-level BPE it trains on the training text, one sentence per block
  of --block_size tokens (padding masked), the held-out validation blocks;
- the training step: the pretraining code's TrainStep (token-weighted loss, gradient clipping, optimizer and
  scheduler step) for every model;
- the training batches and their order: one seeded permutation of the training blocks per epoch, shared;
- the score: token-weighted held-out perplexity exp(sum of NLL / number of targets) over the same target tokens
  (a real token after a real token in a block); BriLLM's NLL is its exact full softmax over all V nodes, GPT-2's
  the softmax of its LM head over the same V;
- the budget: seconds of training (forward, backward, optimizer step; evaluation is not counted), on the same
  torch thread count (--threads), in one process. One run per model up to the largest budget; the held-out
  perplexity is taken whenever the training clock passes a curve point (the budgets among them), so every
  budget's figure comes from a run whose schedule does not depend on the budget (constant learning rate after a
  warmup counted in steps; with --schedule cosine, every model's rate follows one cosine over the training clock to
  the largest budget, so the smaller budgets' figures come from runs not yet annealed). The models take turns
  (--interleave seconds of training each), so the load other processes put on a shared machine falls on all of
  them alike; the load seen is reported per model.

Each model keeps its own sensible optimizer: BriLLM what pretrain.py gives it in one process (SparseAdamW on sparse
edge gradients) with the preset's recipe (learning rate, weight decay and its lazy mode, shared-edge and node rates,
warmup, clipping, graph pruning, signal dropout, non-edge bias; --more_brillm adds other presets' recipes on the
same data). `--min_bigram_count auto` is told the run's length as pretrain.py tells it its epochs: here the epochs
the largest budget buys, timed on a few throwaway steps before the runs (budget_graph). GPT-2 (transformers'
GPT2LMHeadModel, dropout 0, tied embeddings) trains with AdamW (--gpt2_lr, default 3e-3, weight decay 0.01,
--gpt2_warmup (20) steps of linear warmup, gradient clipping at 1.0). 3e-3 was the best of 1e-3 / 3e-3 / 6e-3 /
1.2e-2 for 2x64 and 4x128 at 100 and 300 steps of batch 64 on the embedded corpus; 4x256 does better with 1e-3 (its
default: 4x256@1e-3).

Writes <output_dir>/quality.json (settings, data, every model's parameters and curve, the table per budget)
and <output_dir>/quality.png (held-out perplexity against training seconds and against training tokens).
Exit status 2 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
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
GPT2_SIZE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?(?:@([0-9.eE+-]+))?$")  # layers x width [x heads] [@lr]


def load_pretrain():
    """examples/pretrain.py as a module (as tests/training/test_pretrain.py loads it): its flags and their checks."""
    spec = importlib.util.spec_from_file_location("brillm_pretrain_script", ROOT / "examples" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain = load_pretrain()
UsageError = pretrain.UsageError


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--budgets", type=float, nargs="+", default=[30.0, 90.0, 180.0],
                   help="Training budgets in seconds (evaluation excluded); one run per model up to the largest.")
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
    p.add_argument("--batch_size", type=int, default=64, help="Blocks per training step, every model.")
    p.add_argument("--eval_batch_size", type=int, default=256, help="Blocks per evaluation forward pass.")
    p.add_argument("--max_eval_blocks", type=int, default=None, help="Score at most this many held-out blocks.")
    p.add_argument("--gpt2_lr", type=float, default=3e-3, help="GPT-2 peak learning rate (AdamW).")
    p.add_argument("--gpt2_warmup", type=int, default=20, help="GPT-2 linear warmup steps.")
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                   help="Learning rate after the warmup, the same rule for every model: constant, or a cosine over the "
                   "training clock from the peak to --min_lr_ratio of it at the largest budget (then the smaller "
                   "budgets' figures come from a run not yet annealed).")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="End of the cosine, a fraction of the peak.")
    p.add_argument("--interleave", type=float, default=5.0,
                   help="Models take turns, this many training seconds each, so that a shared machine's varying "
                   "load falls on all alike; 0: one model after the other.")
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same for every model.")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available).")
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
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.interleave < 0 or not math.isfinite(args.interleave):
        raise UsageError(f"--interleave must be a number of seconds >= 0, got {args.interleave}.")
    if args.curve_points < 0:
        raise UsageError(f"--curve_points must be >= 0, got {args.curve_points}.")
    if args.max_eval_blocks is not None and args.max_eval_blocks < 1:
        raise UsageError(f"--max_eval_blocks must be a positive integer, got {args.max_eval_blocks}.")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min_lr_ratio must be in [0, 1], got {args.min_lr_ratio}.")
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
def pretrain_args(args):
    """The pretraining script's own arguments for this data and preset (checked by its own rules)."""
    argv = ["--seed", str(args.seed), "--text_column", args.text_column]
    argv += ["--config", args.config] if args.config else []
    for flag in ("train_file", "validation_file", "vocab_size", "block_size"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    try:
        pargs = pretrain.parse_args(argv)
    except SystemExit:
        raise UsageError(f"the pretraining script refused the arguments {argv}.") from None
    model_fields, tok_settings = pretrain.resolve_settings(pargs)
    pretrain.check_args(pargs, model_fields)
    return pargs, model_fields, tok_settings


def make_accelerator(device):
    """The one-process Accelerator the training modules ask for (tokenizer on the main process, the step's
    backward and reductions), on `device`; no model or optimizer is `prepare`d (nothing is distributed)."""
    from accelerate import Accelerator

    return Accelerator(cpu=device.type == "cpu")


def prepare_data(args, output_dir: Path, accelerator) -> dict:
    """Tokenizer, training and held-out blocks (as tensors), BriLLM's config and graph: all made by the
    pretraining modules (modeling_brillm.training) exactly as examples/pretrain.py makes them."""
    from modeling_brillm.training.data import load_raw_data, load_tokenizer, prepare_blocks

    pargs, model_fields, tok_settings = pretrain_args(args)
    pargs.output_dir = str(output_dir)
    raw, description = load_raw_data(pargs)
    if "validation" not in raw or len(raw["validation"]) == 0:
        raise UsageError("no held-out text: give --validation_file, or more training texts (every 20th is held out).")
    tokenizer, _ = load_tokenizer(pargs, tok_settings, raw, output_dir / "tokenizer", None, accelerator)
    train_blocks, eval_blocks, _ = prepare_blocks(raw, tokenizer, pargs, accelerator)
    if eval_blocks is None:
        raise UsageError("the held-out text gives no block of at least two tokens; give a longer --validation_file.")

    def tensors(blocks):
        rows = blocks.with_format("torch")[:]
        return rows["input_ids"].long(), rows["attention_mask"].long()

    train, held = tensors(train_blocks), tensors(eval_blocks)
    if args.max_eval_blocks:
        held = (held[0][: args.max_eval_blocks], held[1][: args.max_eval_blocks])
    if len(train[0]) < args.batch_size:
        raise UsageError(f"{len(train[0])} training blocks cannot fill one batch of {args.batch_size}; lower "
                         "--batch_size or give more text.")
    data = dict(tokenizer=tokenizer, train=train, held=held, pargs=pargs, description=description,
                train_blocks=train_blocks)
    return {**data, **budget_graph(model_fields, data, args, accelerator)}


def budget_graph(model_fields, data, args, accelerator) -> dict:
    """BriLLM's config, graph and the count used, as pretrain.py builds them. `--min_bigram_count auto` and
    `--signal_dropout auto` are told the run's length: here a time budget, so the epochs come from timing a few steps
    on the data's graph, and a sparser graph is taken to train proportionally more of them
    (pruning.choose_min_count)."""
    from modeling_brillm.training.presets import build_config_and_graph
    from modeling_brillm.training.pruning import choose_learning_rate

    count = data["pargs"].min_bigram_count
    lines = []  # what the data chose, for the report
    config, graph, used = build_config_and_graph(model_fields, data["tokenizer"], data["train_blocks"], count,
                                                 say=lines.append)
    if "auto" in (count, model_fields.get("signal_dropout")) and graph is not None:
        probe = {**data, "config": config, "graph": graph, "min_count": used}
        epochs = epochs_in_budget(probe, args, accelerator, max(args.budgets))
        lines.clear()
        config, graph, used = build_config_and_graph(model_fields, data["tokenizer"], data["train_blocks"], count,
                                                     planned_epochs=epochs, epochs_grow_with_pruning=count == "auto",
                                                     say=lines.append)
    if data["pargs"].learning_rate == "auto":
        lines.append(choose_learning_rate(config.signal_dropout)[1])
    return dict(config=config, graph=graph, min_count=used, choices=lines)


def brillm_rate(pargs, config) -> float:
    """BriLLM's peak rate: the preset's or flag's, or pretrain.py's `auto` choice for this config's dropout."""
    from modeling_brillm.training.pruning import choose_learning_rate

    return choose_learning_rate(config.signal_dropout)[0] if pargs.learning_rate == "auto" else pargs.learning_rate


def epochs_in_budget(data, args, accelerator, seconds: float) -> float:
    """Epochs of the training blocks BriLLM trains in `seconds` on data's graph, timed on a throwaway model."""
    import torch

    device = accelerator.device
    model = make_brillm(data, args.seed).to(device)
    step = brillm_trainer(model, data, args, accelerator)[0]
    ids_all, mask_all = data["train"]
    order = iter(BatchOrder(len(ids_all), args.batch_size, args.seed))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one_step():
        index = next(order)
        step(ids_all[index].to(device), mask_all[index].to(device))

    return seconds / seconds_per_step(one_step, sync) * args.batch_size / len(ids_all)


def seconds_per_step(step, sync, warmup: int = 2, timed: int = 5) -> float:
    """The median time of `timed` calls of `step`, after `warmup` untimed ones. The first steps are not the run's:
    the first allocates the optimizer's moments, and on a GPU the first two compile kernels (Triton compiles an
    integer argument equal to 1, the optimizer's first step, apart from the others); the median keeps one more
    slow step (a late compile, another process) from passing for the run's pace."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return sorted(times)[timed // 2]


def brillm_setup(data, args, preset: str, accelerator) -> dict:
    """Another BriLLM recipe on the same data (--more_brillm): `preset`'s model and training settings, its own graph
    (its --min_bigram_count) over the same training blocks and tokenizer. Data flags (vocabulary, blocks) stay the
    first preset's."""
    from argparse import Namespace

    pargs, model_fields, _ = pretrain_args(Namespace(**{**vars(args), "config": preset}))
    pargs.block_size = int(data["train"][0].shape[1])
    setup = {**data, "pargs": pargs}
    return {**setup, **budget_graph(model_fields, setup, args, accelerator)}


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
def make_brillm(data, seed: int):
    import torch

    from modeling_brillm import BriLLMForCausalLM

    torch.manual_seed(seed)
    return BriLLMForCausalLM.from_graph(data["graph"], config=data["config"])


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


class TrainingClock:
    """Training seconds of one run, read by a schedule over the clock (BudgetRun sets it before every step)."""

    def __init__(self):
        self.seconds = 0.0


def clock_schedule(optimizer, warmup_steps: int, schedule: str, horizon: float, min_ratio: float, clock: TrainingClock):
    """LambdaLR: linear warmup over `warmup_steps` steps, then constant, or a cosine over the training clock from the
    peak down to `min_ratio` of it at `horizon` seconds (and flat after)."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, clock.seconds / horizon)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def package_step(accelerator, model, optimizer, scheduler, args, block_size: int, max_grad_norm):
    """step(ids, mask) -> training loss, through the pretraining code's TrainStep (forward, token-weighted
    backward, gradient clipping, optimizer and scheduler step), the same for every model."""
    from modeling_brillm.training.loop import TrainStep

    train_step = TrainStep(accelerator, model, optimizer, scheduler, per_device_batch_size=args.batch_size,
                           block_size=block_size, max_grad_norm=max_grad_norm, clip=bool(max_grad_norm),
                           learning_rate=optimizer.param_groups[0]["lr"])

    def step(ids, mask):
        return train_step({"input_ids": ids, "attention_mask": mask, "labels": labels_of(ids, mask)}).loss

    return step


def warm_dropout(step, model, steps_per_epoch: int, warmup_epochs: float):
    """`step`, with the model's signal dropout grown from 0 over its first `warmup_epochs` epochs of
    `steps_per_epoch` steps (as pretrain.py's epoch loop grows it)."""
    from modeling_brillm.training.epochs import warm_signal_dropout

    done = 0

    def warming_step(ids, mask):
        nonlocal done
        warm_signal_dropout(model, done / steps_per_epoch, warmup_epochs)
        done += 1
        return step(ids, mask)

    return warming_step


def schedule_text(args) -> str:
    if args.schedule == "constant":
        return "constant after warmup"
    return f"cosine over {max(args.budgets):g} training seconds to {args.min_lr_ratio:g} x the peak, after warmup"


def chosen_count(min_count):
    """The count `build_config_and_graph` used: an int, or "auto (N)" when the data chose N."""
    return f"auto ({min_count.min_count})" if hasattr(min_count, "min_count") else min_count


def brillm_trainer(model, data, args, accelerator):
    """BriLLM as examples/pretrain.py trains it in one process (its --optimizer default: SparseAdamW on sparse
    edge gradients, the preset's or `auto` learning rate, weight decay and its lazy mode, shared-edge and node rates,
    warmup and clipping), with --schedule over the training clock. Returns (step, info, clock, optimizer)."""
    from modeling_brillm.training.optimizers import build_optimizer, choose_optimizer

    pargs = data["pargs"]
    plan = choose_optimizer(pargs.optimizer, 1, pargs.max_grad_norm)
    lr = brillm_rate(pargs, model.config)
    optimizer = build_optimizer(model, plan, lr, pargs.weight_decay, accelerator,
                                lazy_weight_decay=pargs.lazy_weight_decay, node_lr_scale=pargs.node_lr_scale,
                                shared_edge_lr_scale=pargs.shared_edge_lr_scale)
    clock = TrainingClock()
    scheduler = clock_schedule(optimizer, pargs.num_warmup_steps, args.schedule, max(args.budgets), args.min_lr_ratio,
                               clock)
    step = package_step(accelerator, model, optimizer, scheduler, args, pargs.block_size,
                        pargs.max_grad_norm if plan.clip else None)
    step = warm_dropout(step, model, len(data["train"][0]) // args.batch_size, pargs.signal_dropout_warmup_epochs)
    info = dict(optimizer=f"{plan.name} ({'sparse' if plan.sparse_gradients else 'dense'} edge gradients)",
                lr=lr, weight_decay=pargs.weight_decay,
                warmup_steps=pargs.num_warmup_steps,
                lazy_weight_decay=pargs.lazy_weight_decay, shared_edge_lr_scale=pargs.shared_edge_lr_scale,
                node_lr_scale=pargs.node_lr_scale, min_bigram_count=chosen_count(data["min_count"]),
                signal_dropout=model.config.signal_dropout,
                signal_dropout_warmup_epochs=pargs.signal_dropout_warmup_epochs,
                non_edge_bias=model.config.non_edge_bias,
                node_readout=model.config.node_readout, edge_backoff=model.config.edge_backoff,
                node_embedding=model.config.node_embedding, count_prior=model.config.count_prior,
                position_recency=model.config.position_recency,
                node_size=model.config.node_size, schedule=schedule_text(args),
                grad_clip=pargs.max_grad_norm if plan.clip else None)
    return step, info, clock, optimizer


def gpt2_trainer(model, lr: float, warmup: int, data, args, accelerator, device):
    """GPT-2's usual recipe: fused AdamW (weight decay 0.01 on matrices), linear warmup then --schedule, gradient
    norm clipped to 1.0; the step itself is the pretraining code's TrainStep, as for BriLLM."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type in ("cpu", "cuda"))
    clock = TrainingClock()
    scheduler = clock_schedule(optimizer, warmup, args.schedule, max(args.budgets), args.min_lr_ratio, clock)
    step = package_step(accelerator, model, optimizer, scheduler, args, data["pargs"].block_size, 1.0)
    info = dict(optimizer="adamw (fused)", lr=lr, weight_decay=0.01, warmup_steps=warmup,
                schedule=schedule_text(args), grad_clip=1.0)
    return step, info, clock


def heldout_nll(model, held, batch_size: int, device) -> tuple[float, int]:
    """(summed NLL in nats, number of targets) over the held-out blocks, the same targets for every model.
    BriLLM: its exact loss (full softmax over all V nodes, no logits built) times its target count; any other
    model: cross-entropy of its logits at those targets."""
    import torch
    import torch.nn.functional as F

    from modeling_brillm import BriLLMForCausalLM

    ids_all, mask_all = held
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids_all), batch_size):
            ids = ids_all[start:start + batch_size].to(device)
            mask = mask_all[start:start + batch_size].to(device)
            targets = target_mask(mask)
            n = int(targets.sum())
            if n == 0:
                continue
            if isinstance(model, BriLLMForCausalLM):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels_of(ids, mask), return_logits=False,
                             use_cache=False).loss
                total += float(loss.double()) * n
            else:
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
                total += float(nll.view(targets.shape)[targets].double().sum())
            count += n
    if was_training:
        model.train()
    return total, count


def touched_edge_share(data, args, batches: int = 20) -> float:
    """Mean share of BriLLM's real edges whose matrices a training step reads and updates: the out-edges of the
    distinct tokens that are followed by a target in the batch (first `batches` batches of the shared order)."""
    import torch

    ids_all, mask_all = data["train"]
    if data["graph"] is None:  # dense graph: every source has all V successors
        return 1.0
    degree = data["graph"].indptr.diff()
    shares = []
    for index, _ in zip(BatchOrder(len(ids_all), args.batch_size, args.seed), range(batches)):
        ids, mask = ids_all[index], mask_all[index]
        sources = torch.unique(ids[:, :-1][target_mask(mask)])
        shares.append(float(degree[sources].sum()) / max(data["graph"].num_edges, 1))
    return sum(shares) / len(shares)


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
    """One model's training against the clock: `train_until(t)` trains until its training clock (seconds of
    forward, backward and optimizer step, nothing else) passes t, and evaluates each time the clock passes one
    of `points`. Runs can take turns in slices (interleaved), so a shared machine's load falls on all alike."""

    def __init__(self, label, model, step, data, points, args, device, say=print, clock=None, optimizer=None):
        import torch
        from common import CpuMonitor

        self.label, self.model, self.step, self.data, self.args, self.device, self.say = (
            label, model, step, data, args, device, say)
        # `clock` (a TrainingClock): told the training seconds before every step, for a schedule over the clock;
        # `optimizer`: its lazily decayed rows are brought up to date before every evaluation
        self.clock_ref, self.optimizer = clock, optimizer
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.batches = iter(BatchOrder(len(data["train"][0]), args.batch_size, args.seed))
        self.pending = list(points)
        self.clock, self.steps, self.tokens, self.targets = 0.0, 0, 0, 0
        self.loss_sum, self.loss_steps = 0.0, 0
        self.monitor, self.load_seconds, self.wall_seconds = CpuMonitor(), 0.0, 0.0
        model.to(device).train()
        self.curve = [self.evaluate()]

    @property
    def done(self) -> bool:
        return not self.pending

    def evaluate(self) -> dict:
        from modeling_brillm.training.optimizers import apply_pending_weight_decay

        if self.optimizer is not None:
            apply_pending_weight_decay(self.optimizer)
        started = time.perf_counter()
        total, count = heldout_nll(self.model, self.data["held"], self.args.eval_batch_size, self.device)
        nll = total / count
        last = self.loss_sum / self.loss_steps if self.loss_steps else None
        point = dict(train_seconds=round(self.clock, 3), steps=self.steps, train_tokens=self.tokens,
                     train_targets=self.targets, train_loss=last, eval_nll=nll, perplexity=math.exp(min(nll, 700.0)),
                     eval_tokens=count, eval_seconds=round(time.perf_counter() - started, 3))
        self.loss_sum, self.loss_steps = 0.0, 0
        self.say(f"  {self.label:>18} {self.clock:8.1f}s step {self.steps:6d}  held-out perplexity "
                 f"{point['perplexity']:10.2f}" + (f"  (train loss {last:.3f})" if last is not None else ""))
        return point

    def train_until(self, limit: float):
        ids_all, mask_all = self.data["train"]
        self.monitor.start()
        wall = time.perf_counter()
        while self.pending and self.clock < limit:
            index = next(self.batches)
            ids, mask = ids_all[index], mask_all[index]
            self.sync()
            started = time.perf_counter()
            ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
            if self.clock_ref is not None:
                self.clock_ref.seconds = self.clock
            loss = float(self.step(ids, mask))
            self.sync()
            self.clock += time.perf_counter() - started
            self.steps += 1
            self.tokens += int(mask.sum())
            self.targets += int(target_mask(mask).sum())
            self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
            if not math.isfinite(loss):
                raise RuntimeError(f"{self.label}: the training loss is {loss} at step {self.steps}; lower its "
                                   "learning rate.")
            if self.clock >= self.pending[0]:
                while self.pending and self.clock >= self.pending[0]:
                    self.pending.pop(0)
                self.curve.append(self.evaluate())
        wall = time.perf_counter() - wall
        self.load_seconds += self.monitor.stop() * wall  # other processes' load, evaluations included
        self.wall_seconds += wall

    def result(self) -> dict:
        return dict(curve=self.curve, steps=self.steps, train_seconds=round(self.clock, 3),
                    tokens_per_second=round(self.tokens / max(self.clock, 1e-9), 1),
                    other_cpu_load=round(self.load_seconds / max(self.wall_seconds, 1e-9), 3))


def run_all(runs, slice_seconds: float):
    """Train every run to its last point: in turns of `slice_seconds` of training each, or (0) one after another."""
    if slice_seconds <= 0:
        for run in runs:
            run.train_until(math.inf)
        return
    limit = 0.0
    while not all(run.done for run in runs):
        limit += slice_seconds
        for run in runs:
            run.train_until(limit)


def at_budget(curve, budget: float) -> dict:
    """The evaluation taken when the training clock first passed `budget`."""
    return next(p for p in curve if p["train_seconds"] >= budget)


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


# ------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_args(args)
    sizes = gpt2_sizes(args.gpt2, args.gpt2_lr)
    import torch
    from common import machine, wait_for_quiet

    from modeling_brillm.training.memory import keep_freed_memory

    if args.device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda (pick the GPU with CUDA_VISIBLE_DEVICES).")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available; use --device cpu.")
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cpu":
        keep_freed_memory()  # as the pretraining script does: the same allocator settings for every model

    started = time.time()
    accelerator = make_accelerator(device)
    data = prepare_data(args, output_dir, accelerator)
    tok = data["tokenizer"]
    held_targets = int(target_mask(data["held"][1]).sum())
    points = curve_points(args.budgets, args.curve_points)
    print(f"data: {data['description']}")
    for line in data["choices"]:
        print(f"BriLLM: {line}")
    print(f"tokenizer: {len(tok)} tokens; {len(data['train'][0]):,} training blocks, {len(data['held'][0]):,} "
          f"held-out blocks ({held_targets:,} targets) of {data['train'][0].shape[1]} tokens; prepared in "
          f"{time.time() - started:.1f}s")
    print(f"machine: {machine()}, device {device}; budgets {args.budgets} s, "
          f"curve points {[round(p, 1) for p in points]}")

    specs = [] if args.no_brillm else [("brillm", args.config)] + [("brillm", p) for p in args.more_brillm]
    specs += [("gpt2", size) for size in sizes]
    runs, models = [], []
    for kind, size in specs:
        if kind == "brillm":
            setup = data if size == args.config else brillm_setup(data, args, size, accelerator)
            model = make_brillm(setup, args.seed)
            name = Path(size).stem if size else "defaults"
            label = f"BriLLM d={model.config.node_size}" + (f" ({name})" if args.more_brillm else "")
            step, info, clock, optimizer = brillm_trainer(model.to(device), setup, args, accelerator)
            info["preset"] = size
            touched = touched_edge_share(setup, args)
            note = (f"{model.config.num_edges:,} edges of {model.config.node_size}x{model.config.node_size} (+ the "
                    f"shared edge); a step touches only the edges leaving the batch's tokens: {touched:.1%} of them "
                    f"on average at batch {args.batch_size}")
        else:
            model = make_gpt2(data, size, args.seed).to(device)
            label = f"GPT-2 {size[0]}L {size[1]}w {size[2]}h"
            step, info, clock = gpt2_trainer(model, size[3], args.gpt2_warmup, data, args, accelerator, device)
            optimizer = None
            note = "dense: every parameter is used and updated every step (tied input/output embeddings)"
        params = count_parameters(model)
        print(f"{label}: {params:,} parameters; {info['optimizer']} lr {info['lr']}")
        models.append(dict(kind=kind, label=label, parameters=params, parameters_note=note, **info,
                           size=None if kind == "brillm" else dict(zip(("layers", "width", "heads"), size[:3]))))
        runs.append(BudgetRun(label, model, step, data, points, args, device, clock=clock, optimizer=optimizer))
    load_before = wait_for_quiet(max_wait_s=60) if args.wait_quiet else None
    run_all(runs, args.interleave)
    for model, run in zip(models, runs):
        model.update(run.result())

    table = {str(b): {m["label"]: round(at_budget(m["curve"], b)["perplexity"], 3) for m in models}
             for b in sorted(args.budgets)}
    results = dict(
        settings=dict(budgets=sorted(args.budgets), curve_points=points, batch_size=args.batch_size,
                      threads=args.threads, device=str(device), seed=args.seed, config=args.config,
                      interleave_seconds=args.interleave, gpt2_lr=args.gpt2_lr, gpt2_warmup=args.gpt2_warmup,
                      schedule=schedule_text(args),
                      other_cpu_load_before=None if load_before is None else round(load_before, 3),
                      machine=machine(), started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))),
        data=dict(description=data["description"], vocab_size=len(tok), block_size=int(data["train"][0].shape[1]),
                  train_blocks=len(data["train"][0]), train_tokens=int(data["train"][1].sum()),
                  heldout_blocks=len(data["held"][0]), heldout_targets=held_targets),
        models=models, perplexity_at_budget=table, bigram_add_0_1_perplexity=round(bigram_reference(data), 3))
    write_json_atomic(output_dir / RESULTS_NAME, results)
    plot(results, output_dir / PLOT_NAME)

    print("\nheld-out perplexity at each budget (token-weighted, the same targets):")
    width = max(len(m["label"]) for m in models)
    print(f"{'model':<{width}}  {'params':>12}  " + "  ".join(f"{f'{b:g} s':>9}" for b in sorted(args.budgets))
          + "  tokens/s  other load")
    for m in models:
        cells = "  ".join(f"{table[str(b)][m['label']]:9.2f}" for b in sorted(args.budgets))
        print(f"{m['label']:<{width}}  {m['parameters']:12,}  {cells}  {m['tokens_per_second']:8,.0f}  "
              f"{m['other_cpu_load']}")
    print(f"bigram counts, add-0.1 (reference): held-out perplexity {results['bigram_add_0_1_perplexity']:.2f}")
    print("\n" + markdown_table(results))
    print(f"wrote {output_dir / RESULTS_NAME} and {output_dir / PLOT_NAME}")
    return results


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
