"""The epoch loop of a pretraining run (`train_epochs` over a `Job` from a `Position`, what a checkpoint stores), and
the one training clock and schedule every model of a time budget shares (BriLLM here, GPT-2 in benchmarks/gpt2.py)."""

import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import get_scheduler

from .checkpoints import load_checkpoint, save_checkpoint
from .optimizers import apply_pending_weight_decay

CLOCK_STEPS = 1_000_000  # past its warmup, a schedule following the clock runs over this many virtual steps


@dataclass
class TrainingClock:
    """Seconds of training steps (not evaluations or checkpoints) out of an optional budget; the loop sets them."""
    budget: float | None = None
    seconds: float = 0.0

    def fraction(self) -> float:
        return min(1.0, self.seconds / self.budget)


@dataclass
class Job:
    accelerator: object
    model: object
    optimizer: object
    lr_scheduler: object
    train_loader: object
    eval_loader: object | None
    train_step: Callable  # (batch, step) -> StepResult | None (loop.TrainStep, sharded.ShardedTrainStep)
    evaluate: Callable  # (model, loader, accelerator) -> (loss, perplexity, tokens)
    log: Callable  # checkpoints.TrainLog
    best: object  # best.BestModel
    tokenizer: object
    signature: dict  # what must match for a resume to be an exact continuation
    clock: TrainingClock = field(default_factory=TrainingClock)  # with the time budget, if any
    write_extra: Callable | None = None  # adds files to a checkpoint's temporary folder (the edge shards)
    load_extra: Callable | None = None  # (checkpoint) restores what write_extra added


@dataclass
class Position:
    completed_steps: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of `epoch` already consumed
    train_seconds: float = 0.0  # the training clock at this position
    train_tokens: int = 0  # real tokens trained on up to this position


@dataclass
class TrainStats:
    completed_steps: int
    train_time: float = 0.0
    train_tokens: int = 0
    last_loss: float = float("nan")
    pending: list = field(default_factory=list)  # the --eval_seconds points the clock has not passed yet


def make_schedule(optimizer, name: str, warmup_steps: int, total_steps: int | None = None,
                  clock: TrainingClock | None = None):
    """transformers' schedule `name` over `total_steps`, or past its warmup over the clock, ending with its budget."""
    if clock is None or clock.budget is None:
        return get_scheduler(name, optimizer=optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    scheduler = get_scheduler(name, optimizer=optimizer, num_warmup_steps=warmup_steps,
                              num_training_steps=warmup_steps + CLOCK_STEPS)

    def following(factor):
        return lambda step: factor(step if step < warmup_steps else warmup_steps + clock.fraction() * CLOCK_STEPS)

    scheduler.lr_lambdas = [following(factor) for factor in scheduler.lr_lambdas]
    return scheduler


def seconds_per_step(step: Callable, sync: Callable = lambda: None, warmup: int = 2, timed: int = 5) -> float:
    """The median time of `timed` calls of `step` after `warmup` untimed ones (which allocate and compile)."""
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


def resume(job: Job, checkpoint) -> Position:
    """Restore the states saved in `checkpoint` (and the best model so far); where the run continues."""
    state = load_checkpoint(job.accelerator, checkpoint)
    if job.load_extra is not None:
        job.load_extra(checkpoint)
    position = Position(state["completed_steps"], state["epoch"], state["batches_in_epoch"],
                        state.get("train_seconds", 0.0), state.get("train_tokens", 0))
    if position.batches_in_epoch >= len(job.train_loader):
        position = replace(position, epoch=position.epoch + 1, batches_in_epoch=0)
    saved = state.get("signature", {})
    changed = {k: (saved.get(k), v) for k, v in job.signature.items()
               if saved.get(k) != v and k not in ("max_train_steps", "max_train_time")}
    if changed:
        job.accelerator.print(f"warning: this run differs from the checkpoint's in {changed}: not an exact "
                              "continuation.")
    job.best.restore(state.get("best"), checkpoint)
    job.accelerator.print(
        f"resumed from {checkpoint}: step {position.completed_steps}, epoch {position.epoch}, skipping "
        f"{position.batches_in_epoch} batches of that epoch, training clock {position.train_seconds:.1f}s"
        + (f"; best model so far: step {job.best.step}" if job.best.step is not None else ""))
    job.log.truncate(position.completed_steps)  # the log keeps what happened up to the checkpoint
    return position


def eval_record(step: int, loss: float, ppl: float, count: int, seconds: float, tokens: int) -> dict:
    """A validation's line of the train log, with where on the training clock it was taken."""
    return {"step": step, "eval_loss": loss, "perplexity": ppl, "eval_tokens": count,
            "train_seconds": round(seconds, 4), "train_tokens": tokens}


def evaluate_now(job: Job, stats: TrainStats, write=print):
    """Validate (lazily decayed rows brought up to date first), log it, offer the model as the best. The random state
    is kept as it was, so what follows (the sampled loss's negatives) does not depend on when evaluations happen."""
    apply_pending_weight_decay(job.optimizer)
    device = job.accelerator.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        loss, ppl, count = job.evaluate(job.model, job.eval_loader, job.accelerator)
    if job.accelerator.is_local_main_process:
        write(f"step {stats.completed_steps}: train loss {stats.last_loss:.4f}, validation loss {loss:.4f}, "
              f"perplexity {ppl:,.2f}")
    job.log(eval_record(stats.completed_steps, loss, ppl, count, stats.train_time, stats.train_tokens))
    job.best.update(job.model, stats.completed_steps, loss)


def checkpoint_now(job: Job, args, position: Position, write=print):
    """Save the training state (the best model so far, the clock, the planned epochs) as `<output_dir>/step_N`."""
    state = {**asdict(position), "planned_epochs": getattr(args, "planned_epochs", None),
             "signature": job.signature, "best": job.best.state()}

    def extra(tmp):
        if job.write_extra is not None:
            job.write_extra(tmp)
        job.best.write_into(tmp)

    path = save_checkpoint(job.accelerator, args.output_dir, position.completed_steps, state, job.tokenizer,
                           args.checkpoints_total_limit, write_extra=extra, need=getattr(args, "checkpoint_bytes", 0))
    if job.accelerator.is_local_main_process:
        write(f"step {position.completed_steps}: checkpoint {path}")


def warm_signal_dropout(model, epochs_trained: float, warmup_epochs: float):
    """Apply the share epochs_trained / warmup_epochs (at most all) of config.signal_dropout to the BriLLMModel."""
    scale = min(1.0, epochs_trained / warmup_epochs) if warmup_epochs > 0 else 1.0
    for module in model.modules():
        if hasattr(module, "signal_dropout_scale"):
            module.signal_dropout_scale = scale


def train_epochs(job: Job, args, start: Position) -> TrainStats:
    """Train from `start` to `max_train_steps` or the clock's `max_train_time`: log every step, validate at
    `eval_steps` and `eval_seconds` (the caller evaluates the last step), checkpoint at `checkpointing_steps`."""
    acc = job.accelerator
    progress = tqdm(total=args.max_train_steps, initial=start.completed_steps, desc="train",
                    disable=not acc.is_local_main_process, dynamic_ncols=True)
    stats = TrainStats(start.completed_steps, start.train_seconds, start.train_tokens)
    stats.pending = [s for s in sorted(getattr(args, "eval_seconds", None) or []) if s > start.train_seconds]
    model = acc.unwrap_model(job.model)
    job.model.train()
    epochs = range(start.epoch, args.num_train_epochs) if args.num_train_epochs else itertools.count(start.epoch)
    for epoch in itertools.takewhile(lambda _: not done(args, stats), epochs):
        job.train_loader.set_epoch(epoch)  # the loader's order is seeded per epoch; a resume skips what it consumed
        batches = start.batches_in_epoch if epoch == start.epoch else 0
        loader = acc.skip_first_batches(job.train_loader, batches) if batches else job.train_loader
        step_started = time.time()
        for batch in loader:
            warm_signal_dropout(model, epoch + batches / len(job.train_loader), args.signal_dropout_warmup_epochs)
            job.clock.seconds = stats.train_time
            result = job.train_step(batch, stats.completed_steps)  # the step keys its dropout masks
            batches += 1
            if result is None:  # a micro-batch of an accumulation: no optimizer step yet
                continue
            count_step(job, args, stats, result, epoch, time.time() - step_started, progress)
            at = Position(stats.completed_steps, epoch, batches, stats.train_time, stats.train_tokens)
            validate_and_checkpoint(job, args, stats, at, progress)
            step_started = time.time()
            if done(args, stats):
                break
    progress.close()
    warm_signal_dropout(model, 1.0, 0.0)  # the model leaves the loop with its configured dropout
    return stats


def done(args, stats: TrainStats) -> bool:
    limit, budget = args.max_train_steps, getattr(args, "max_train_time", None)
    return limit is not None and stats.completed_steps >= limit or budget is not None and stats.train_time >= budget


def count_step(job: Job, args, stats: TrainStats, result, epoch: int, elapsed: float, progress):
    """The step's figures into the stats, the train log and the progress bar."""
    stats.completed_steps += 1
    stats.last_loss, stats.train_time = result.loss, stats.train_time + elapsed
    stats.train_tokens += result.tokens
    job.log({"step": stats.completed_steps, "loss": result.loss, "lr": result.lr, "tokens": result.targets,
             "epoch": epoch, "seconds": round(elapsed, 4), "train_seconds": round(stats.train_time, 4)})
    progress.update(1)
    progress.set_postfix(loss=f"{result.loss:.3f}", refresh=False,
                         tok_s=f"{stats.train_tokens / max(stats.train_time, 1e-9):,.0f}")
    if args.step_sleep:
        time.sleep(args.step_sleep)


def validate_and_checkpoint(job: Job, args, stats: TrainStats, at: Position, progress):
    """Validate at an --eval_steps step or --eval_seconds point (not the last step); checkpoint when due."""
    steps, every = stats.completed_steps, args.checkpointing_steps
    passed = bool(stats.pending) and stats.train_time >= stats.pending[0]
    stats.pending = [s for s in stats.pending if s > stats.train_time]
    due = passed or bool(args.eval_steps) and steps % args.eval_steps == 0
    if due and job.eval_loader is not None and not done(args, stats):
        evaluate_now(job, stats, write=progress.write)
    epoch_end = at.batches_in_epoch >= len(job.train_loader)
    if isinstance(every, int) and steps % every == 0 or every == "epoch" and epoch_end:
        checkpoint_now(job, args, at, write=progress.write)
