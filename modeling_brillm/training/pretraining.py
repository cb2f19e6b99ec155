"""Pretraining BriLLM with accelerate: what examples/pretrain.py runs, one sequence of named steps (`run`): the
settings (presets.resolve_settings), the data and tokenizer (data.py), the plan (planning.py), the model prepared by
accelerate or sharded by source node, the epoch loop (epochs.py), the final folder, its card and `--push_to_hub`.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader

from modeling_brillm import BriLLMForCausalLM

from .arguments import check_args, parse_args
from .best import BestModel
from .checkpoints import TrainLog, prepare_output_dir, resolve_checkpoint
from .data import collate, load_raw_data, load_tokenizer, prepare_blocks, text_stats
from .epochs import Job, Position, TrainingClock, eval_record, make_schedule, resume, train_epochs
from .errors import UsageError, run_cli
from .fsdp import fsdp_on_cpu, full_state_dict, is_fsdp, own_class, prepare_on_cpu
from .launch import make_accelerator
from .loop import TrainStep, choose_prompts, generate_samples
from .loop import evaluate as evaluate_dense
from .optimizers import apply_pending_weight_decay, build_optimizer
from .planning import global_batch, plan_model, planned_epochs
from .presets import resolve_settings
from .publishing import push_folder, write_training_card
from .sharded import (
    ShardedTrainStep,
    build_sharded,
    build_sharded_optimizer,
    checkpoint_kind_error,
    evaluate_sharded,
    load_sharded_checkpoint,
    resolve_optimizer,
    whole_model_fits,
)

__all__ = ["SUMMARY_NAME", "load_data", "main", "parse_args", "planned_epochs", "run", "settle"]

SUMMARY_NAME = "pretrain_summary.json"


def run(args, data=None) -> int:
    """The whole job. `data`: what load_data returned for the same data flags (benchmarks/quality.py shares one
    preparation between runs); by default it is loaded here."""
    resolved = settle(args)
    accelerator, checkpoint, out_dir = start_run(args)
    data = data or load_data(args, resolved, accelerator, out_dir, checkpoint)
    config, graph, plan = plan_model(args, resolved, data, accelerator, checkpoint)
    model = build_model(args, config, graph, accelerator)
    parts = prepare_model_and_optimizer(args, model, plan, make_loaders(args, data, accelerator), config, graph,
                                        checkpoint, accelerator)
    job = make_job(args, parts, plan, data, config, accelerator, out_dir)
    init_tracking(args, accelerator)

    position = resume_or_start(args, job, checkpoint)
    accelerator.print(describe_training(args, job, config))
    summary = start_summary(args, config, data, accelerator)
    if job.eval_loader is not None and checkpoint is None:
        evaluate_before(job, summary)

    stats = train_epochs(job, args, position)

    evaluate_after(job, stats, summary)
    unwrapped = save_final(args, job, data.tokenizer, out_dir)
    show_generations(args, job, unwrapped, data, summary)
    publish(args, job, unwrapped, data, plan, summary, out_dir)
    return 0


def main(argv=None) -> int:
    return run_cli(parse_args, run, argv)


# ---------------------------------------------------------------------------------------------- the steps
def settle(args):
    """The run's settings (their auto values still to choose), checked where no data is needed."""
    args.shared_rate_from_preset = args.shared_edge_lr_scale is None  # a preset or default rate yields to dense AdamW
    resolved = resolve_settings(args)
    check_args(args, resolved.value("model", "max_position_embeddings"))
    args.optimizer = resolve_optimizer(args.edge_sharding, args.optimizer)
    args.sharding = args.edge_sharding == "source"
    return resolved


def start_run(args):
    """The accelerator, the checkpoint to resume from, and the output folder (cleared of an earlier run)."""
    accelerator, setup = make_accelerator(args, shards_on_cpu=True)
    accelerator.print(f"BriLLM pretraining: {setup}, preset {args.config or '(none: built-in defaults)'}")
    checkpoint = resolve_checkpoint(args)
    if checkpoint is not None and checkpoint_kind_error(checkpoint, args.sharding):
        raise checkpoint_kind_error(checkpoint, args.sharding)
    out_dir = prepare_output_dir(args.output_dir, checkpoint, bool(args.resume_from_checkpoint), accelerator)
    return accelerator, checkpoint, out_dir


def load_data(args, resolved, accelerator, out_dir, checkpoint):
    """Raw texts, the tokenizer (loaded or trained), and the training / validation blocks."""
    say = accelerator.print
    raw, description = load_raw_data(args)
    say(f"data: {description}")
    n_texts, n_nonblank = text_stats(raw["train"], args.text_column)
    if n_nonblank == 0:
        raise UsageError(f"the training data ({description}) contains no text: {n_texts} rows, all empty.")
    tokenizer, line = load_tokenizer(args, resolved.section("tokenizer"), raw, out_dir, checkpoint, accelerator)
    if line:
        say(line)
    train_blocks, eval_blocks, line = prepare_blocks(raw, tokenizer, args, accelerator)
    say(line)
    return SimpleNamespace(raw=raw, description=description, tokenizer=tokenizer, train=train_blocks,
                           eval=eval_blocks)


def build_model(args, config, graph, accelerator):
    """The model on every process, or None when a sharded run must build each process's shard directly."""
    if args.sharding and not whole_model_fits(config, accelerator, args):
        accelerator.print("the whole model does not fit one process: each process initialises only the blocks of "
                          "its own sources (ShardedBriLLM.from_config: seeded per source, not the one-process "
                          "initialisation)")
        return None
    return BriLLMForCausalLM.from_graph(graph, config=config)


def make_loaders(args, data, accelerator):
    """Training loader (shuffled, whole batches) and validation loader (None without validation blocks)."""
    W = accelerator.num_processes
    if len(data.train) < args.per_device_train_batch_size * W:
        raise UsageError(f"{len(data.train)} training blocks cannot fill one global batch of "
                         f"{args.per_device_train_batch_size} x {W} process(es); lower --per_device_train_batch_size.")
    train_loader = DataLoader(data.train, shuffle=True, collate_fn=collate, drop_last=True,
                              batch_size=args.per_device_train_batch_size)
    # a sharded run does not prepare the validation loader: every process reads every batch and scores its share
    eval_batch = args.per_device_eval_batch_size * (W if args.sharding else 1)
    eval_loader = DataLoader(data.eval, collate_fn=collate, batch_size=eval_batch) if data.eval is not None else None
    return train_loader, eval_loader


def prepare_model_and_optimizer(args, model, plan, loaders, config, graph, checkpoint, accelerator):
    """The optimizer, and everything handed to accelerate (or sharded by source node)."""
    train_loader, eval_loader = loaders
    options = dict(lazy_weight_decay=args.lazy_weight_decay, node_lr_scale=args.node_lr_scale,
                   shared_edge_lr_scale=args.shared_edge_lr_scale, moment_dtype=args.moment_dtype)
    if args.sharding:  # not prepared: no DDP wrapper
        model = build_sharded(model, accelerator, checkpoint, config, graph, seed=args.seed)
        optimizer = build_sharded_optimizer(model, args.learning_rate, args.weight_decay, **options)
        train_loader = accelerator.prepare(train_loader)
        rows = [int(r) for r in accelerator.gather(torch.tensor([model.model.base_model.weights.shape[0] - 1],
                                                                device=accelerator.device)).tolist()]
        accelerator.print(f"edge sharding by source: edge rows per process {rows} of {config.num_edge_rows - 1:,}")
        return model, optimizer, train_loader, eval_loader
    if fsdp_on_cpu(accelerator):  # accelerate does not shard on the CPU: torch's fully_shard, by the script
        return prepare_on_cpu(accelerator, model, lambda sharded: build_optimizer(
            sharded, plan, args.learning_rate, args.weight_decay, accelerator, **options), train_loader, eval_loader)
    optimizer = build_optimizer(model, plan, args.learning_rate, args.weight_decay, accelerator, **options)
    if eval_loader is not None:
        return accelerator.prepare(model, optimizer, train_loader, eval_loader)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    return model, optimizer, train_loader, None


def make_job(args, parts, plan, data, config, accelerator, out_dir) -> Job:
    """The schedule, the step and evaluation functions, the log and the best-model keeper around the prepared
    parts; fixes max_train_steps and num_train_epochs (None under a time budget without a step limit)."""
    model, optimizer, train_loader, eval_loader = parts
    args.steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None and args.max_train_time is None:
        args.max_train_steps = args.num_train_epochs * args.steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / args.steps_per_epoch) if args.max_train_steps else None
    clock = TrainingClock(args.max_train_time)
    lr_scheduler = accelerator.prepare(make_schedule(optimizer, args.lr_scheduler_type, args.num_warmup_steps,
                                                     args.max_train_steps, clock))
    common = dict(learning_rate=args.learning_rate, per_device_batch_size=args.per_device_train_batch_size,
                  block_size=args.block_size, seed=args.seed)
    if args.sharding:  # the sharded model has no logits; evaluate_sharded gives the same figures
        train_step = ShardedTrainStep(accelerator, model, optimizer, lr_scheduler,
                                      max_grad_norm=args.max_grad_norm if plan.clip else None, **common)
    else:
        train_step = TrainStep(accelerator, model, optimizer, lr_scheduler, max_grad_norm=args.max_grad_norm,
                               clip=plan.clip, **common)
    signature = {"global_batch": global_batch(args, accelerator), "block_size": args.block_size,
                 "block_mode": args.block_mode, "seed": args.seed, "num_edges": config.num_edges,
                 "vocab_size": config.vocab_size, "max_train_steps": args.max_train_steps,
                 "max_train_time": args.max_train_time,
                 "signal_dropout_warmup_epochs": args.signal_dropout_warmup_epochs}
    keep = args.keep_best_model and eval_loader is not None

    def write_extra(tmp):  # every checkpoint holds the run's recipe.json (`--recipe` reads it there) and shards
        if args.sharding:
            model.save_shard(tmp, optimizer)
        if accelerator.is_main_process:
            args.recipe_choice.save(tmp)

    return Job(accelerator, model, optimizer, lr_scheduler, train_loader, eval_loader, train_step,
               evaluate_sharded if args.sharding else evaluate_dense,
               log=TrainLog(out_dir, accelerator, tracking=args.with_tracking),
               best=BestModel(out_dir, accelerator, enabled=keep), tokenizer=data.tokenizer, signature=signature,
               clock=clock, write_extra=write_extra)


def init_tracking(args, accelerator):
    """Experiment trackers (--with_tracking) with the run's flags and the model's fields as hyperparameters."""
    if args.with_tracking:
        plain = (int, float, str, bool)
        hparams = {k: v for k, v in vars(args).items() if isinstance(v, plain)}
        fields = args.recipe_choice.section("model")
        model = {f"model_{k}": v for k, v in fields.items() if isinstance(v, plain)}
        accelerator.init_trackers("brillm_pretrain", {**hparams, **model})


def resume_or_start(args, job: Job, checkpoint) -> Position:
    """Where training starts: the checkpoint's position (its states restored), or the beginning."""
    if checkpoint is None:
        job.best.discard()  # an earlier run's best model is not this run's
        return Position()
    load_shards = None
    if args.sharding:
        def load_shards():
            load_sharded_checkpoint(job.model, job.optimizer, job.lr_scheduler, checkpoint)
    return resume(job, checkpoint, load_shards)


def describe_training(args, job: Job, config) -> str:
    keep = "keeping the best model by validation loss" if job.best.enabled else "keeping the last model"
    length = f"{args.max_train_steps} steps ({args.steps_per_epoch} per epoch, {args.num_train_epochs} epoch(s))"
    if args.max_train_time is not None:
        length = (f"{args.max_train_time:g}s of training" + (f" or {args.max_train_steps} steps" if
                  args.max_train_steps else "") + f" ({args.steps_per_epoch} steps per epoch, "
                  f"{args.planned_epochs:.2f} epoch(s) planned)")
    dropout = f", signal dropout {config.signal_dropout:g}" if config.signal_dropout else ""
    if dropout and args.signal_dropout_warmup_epochs:
        dropout += f" (growing from 0 over the first {args.signal_dropout_warmup_epochs:g} epoch(s))"
    return (f"training: {length}, global batch {job.signature['global_batch']} blocks = "
            f"{args.per_device_train_batch_size} x {job.accelerator.num_processes} process(es) x "
            f"{args.gradient_accumulation_steps} accumulation, lr {args.learning_rate} ({args.lr_scheduler_type}, "
            f"{args.num_warmup_steps} warmup), loss {config.loss_type}{dropout}; {keep}")


def start_summary(args, config, data, accelerator) -> dict:
    """The run's facts for pretrain_summary.json and the model card; the results are added as they come."""
    return {"data": data.description, "vocab_size": config.vocab_size, "num_edges": config.num_edges,
            "num_parameters": config.num_parameters_formula(), "node_size": config.node_size, "graph": config.graph,
            "processes": accelerator.num_processes, "global_batch": global_batch(args, accelerator)}


def evaluate_before(job: Job, summary: dict):
    """Validation of the untrained model (step 0 of the log and the card's 'before' figure)."""
    started = time.time()
    loss0, ppl0, n0 = job.evaluate(job.model, job.eval_loader, job.accelerator)
    job.accelerator.print(f"step 0: validation loss {loss0:.4f}, perplexity {ppl0:,.1f} ({n0:,} tokens, "
                          f"{time.time() - started:.1f}s)")
    job.log(eval_record(0, loss0, ppl0, n0, 0.0, 0))
    summary.update(perplexity_before=ppl0, eval_loss_before=loss0)


def evaluate_after(job: Job, stats, summary: dict):
    """Throughput, the final validation, and the best model put back when an earlier step scored better."""
    say, steps = job.accelerator.print, stats.completed_steps
    if stats.train_time > 0:
        say(f"trained to step {steps}: {stats.train_tokens:,} real tokens in {stats.train_time:.1f}s of training "
            f"= {stats.train_tokens / stats.train_time:,.0f} tokens/s; last train loss {stats.last_loss:.4f}")
    summary.update(steps=steps, train_seconds=round(stats.train_time, 2), train_tokens=stats.train_tokens,
                   tokens_per_second=round(stats.train_tokens / stats.train_time, 1) if stats.train_time else None,
                   last_loss=stats.last_loss)
    apply_pending_weight_decay(job.optimizer)  # lazily decayed rows: the weights as dense AdamW's decay has them
    if job.eval_loader is None:
        return
    loss1, ppl1, n1 = job.evaluate(job.model, job.eval_loader, job.accelerator)
    say(f"validation loss {loss1:.4f}, perplexity {ppl1:,.2f} ({n1:,} tokens)"
        + (f"; before training: {summary['perplexity_before']:,.1f}" if "perplexity_before" in summary else ""))
    job.log(eval_record(steps, loss1, ppl1, n1, stats.train_time, stats.train_tokens))
    summary.update(perplexity=ppl1, eval_loss=loss1)
    best = job.best
    if best.enabled and best.step is not None and not loss1 <= best.eval_loss:
        fsdp = is_fsdp(job.accelerator)
        best.load_into(job.accelerator.unwrap_model(job.model), prepared=job.model if fsdp else None)
        say(f"kept the best model: step {best.step} (validation loss {best.eval_loss:.4f}, perplexity "
            f"{math.exp(min(best.eval_loss, 700.0)):,.2f}), not the last step {steps} ({loss1:.4f})")
        summary.update(perplexity=math.exp(min(best.eval_loss, 700.0)), eval_loss=best.eval_loss,
                       best_step=best.step, last_eval_loss=loss1)
    elif best.enabled and best.step is not None:
        say(f"kept the best model: the last step {steps} (validation loss {loss1:.4f})")
        summary.update(best_step=steps)


def save_final(args, job: Job, tokenizer, out_dir):
    """The Hugging Face folder (a sharded run's table gathered on the main process); returns the plain model."""
    accelerator, model = job.accelerator, job.model
    accelerator.wait_for_everyone()
    if args.sharding:  # gathered on the main process (host RAM for the whole table), a plain BriLLM folder
        unwrapped = model.export_model()
        if accelerator.is_main_process:
            unwrapped.save_pretrained(out_dir, safe_serialization=True)
    else:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.sparse_gradients = False
        state_dict = full_state_dict(accelerator, model)
        with own_class(unwrapped):  # FSDP: the model's own code, not torch's FSDP class, goes into the folder
            unwrapped.save_pretrained(out_dir, is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save, state_dict=state_dict, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.model_max_length = unwrapped.config.max_position_embeddings  # pipelines and harnesses read it
        tokenizer.save_pretrained(out_dir)
        args.recipe_choice.save(out_dir)  # --recipe out_dir/recipe.json builds the same config
    job.best.discard()
    accelerator.print(f"saved the model and tokenizer to {out_dir} "
                      "(AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))")
    return unwrapped


def show_generations(args, job: Job, unwrapped, data, summary: dict):
    """A few greedy and sampled continuations (all processes take part under FSDP, whose weights are sharded)."""
    accelerator, fsdp = job.accelerator, is_fsdp(job.accelerator)
    prompts = choose_prompts(args, data.raw["validation"] if "validation" in data.raw else None,
                             not (args.train_file or args.dataset_name))
    if prompts and args.num_generations > 0 and (accelerator.is_main_process or fsdp):
        samples = generate_samples(job.model if fsdp else unwrapped, data.tokenizer, prompts, args,
                                   accelerator.device)
        accelerator.print("generations (greedy | sampled, top-k 40, temperature 0.8):")
        for s in samples:
            accelerator.print(f"  {s['prompt']!r}\n    greedy : {s['prompt']}{s['greedy']}\n"
                              f"    sampled: {s['prompt']}{s['sampled']}")
        summary["generations"] = samples


def publish(args, job: Job, unwrapped, data, plan, summary: dict, out_dir):
    """pretrain_summary.json, the model card, and --push_to_hub."""
    accelerator, say = job.accelerator, job.accelerator.print

    def write_card(repo_id=None):  # README.md with metadata, the final perplexity and usage, as Trainer writes
        return write_training_card(out_dir, unwrapped, data.tokenizer, args, summary, data.description,
                                   repo_id=repo_id, optimizer=plan.name)

    if accelerator.is_main_process:
        with open(out_dir / SUMMARY_NAME, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
        say(f"model card: {write_card(args.hub_model_id if args.push_to_hub else None)}")
    if args.with_tracking:
        accelerator.end_training()
    if args.push_to_hub and accelerator.is_main_process:
        repo_id = push_folder(out_dir, args.hub_model_id or out_dir.resolve().name, args.hub_token,
                              "BriLLM pretraining", before_upload=write_card)
        say(f"pushed to https://huggingface.co/{repo_id}")
    accelerator.wait_for_everyone()
