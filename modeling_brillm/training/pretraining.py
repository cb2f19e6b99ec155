"""Pretraining BriLLM with accelerate: what examples/pretrain.py runs, as one sequence of named steps (`run`). Nothing
in the output folder changes before the data, tokenizer, graph, memory and disk space are checked."""

import dataclasses
import itertools
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader

from modeling_brillm import BriLLMForCausalLM

from . import memory, optimizers, presets, sharded
from .arguments import check_args, parse_args
from .best import BestModel
from .checkpoints import RESUME, TrainLog, open_folder, read_train_state, resolve_checkpoint, write_json, writing
from .data import collate, load_raw_data, load_tokenizer, prepare_blocks, scored_tokens
from .epochs import Job, Position, TrainingClock, eval_record, make_schedule, resume, seconds_per_step, train_epochs
from .errors import UsageError, run_cli
from .fsdp import fsdp_on_cpu, full_state_dict, is_fsdp, own_class, prepare_on_cpu
from .launch import make_accelerator
from .loop import TrainStep, choose_prompts, generate_samples
from .loop import evaluate as evaluate_dense
from .optimizers import apply_pending_weight_decay, build_optimizer, choose_optimizer, resolve_moment_dtype
from .publishing import push_folder, write_training_card
from .recipe import RunPlan, Setting

__all__ = ["SUMMARY_NAME", "load_data", "main", "parse_args", "planned_epochs", "run", "settle", "start_run"]

SUMMARY_NAME = "pretrain_summary.json"
SECRET = re.compile(r"(^|_)(token|key|password|secret)(_|$)")  # flags never logged, saved or printed
MIN_EVAL_TOKENS = 100  # fewer scored validation tokens: a loss too noisy to choose the best model by


def run(args, data=None) -> int:
    """The whole job. `data`: what load_data returned for these data flags (benchmarks/quality.py shares one)."""
    resolved = settle(args)
    accelerator, checkpoint, folder = start_run(args)
    with folder:  # the output folder is this run's until it ends
        data = data or load_data(args, resolved, accelerator, folder.path, checkpoint)
        config, graph, plan = plan_model(args, resolved, data, accelerator, checkpoint)
        parts = prepare(args, config, graph, plan, data, accelerator, checkpoint)
        job = make_job(args, parts, plan, data, config, accelerator, folder.path)
        claim_folder(args, job, config, folder, checkpoint)
        init_tracking(args, accelerator)

        position = Position() if checkpoint is None else resume(job, checkpoint)
        accelerator.print(describe_training(args, job, config))
        summary = start_summary(args, config, data, accelerator)
        if job.eval_loader is not None and checkpoint is None:
            evaluate_before(job, summary)

        stats = train_epochs(job, args, position)

        evaluate_after(job, stats, summary)
        unwrapped = save_final(args, job, data.tokenizer, folder)
        show_generations(args, job, unwrapped, data, summary)
        publish(args, job, unwrapped, data, plan, summary, folder)
    return 0


def main(argv=None) -> int:
    return run_cli(parse_args, run, argv)


# ---------------------------------------------------------------------------------------------- the steps
def settle(args):
    """The run's settings (their auto values still to choose), checked where no data is needed."""
    args.shared_rate_from_preset = args.shared_edge_lr_scale is None  # a preset or default rate yields to dense AdamW
    resolved = presets.resolve_settings(args)
    check_args(args, resolved.value("model", "max_position_embeddings"))
    args.optimizer = sharded.resolve_optimizer(args.edge_sharding, args.optimizer)
    args.sharding = args.edge_sharding == "source"
    return resolved


def start_run(args):
    """The accelerator, the checkpoint to resume from, and the output folder (checkpoints.open_folder locks it)."""
    accelerator, setup = make_accelerator(args, shards_on_cpu=True)
    say = accelerator.print
    say(f"BriLLM pretraining: {setup}, preset {args.config or '(none: built-in defaults)'}")
    if args.hub_token:
        say("warning: --hub_token puts the token on the command line, where the process list and a failing launch "
            "show it; set HF_TOKEN or run `hf auth login` instead")
    checkpoint = resolve_checkpoint(args, say)
    if checkpoint is not None:
        sharded.check_checkpoint_kind(checkpoint, args.sharding)
    here = checkpoint is not None and checkpoint.resolve().parent == Path(args.output_dir).resolve()
    folder = open_folder(args.output_dir, accelerator, args.overwrite_output_dir, resuming_here=here)
    return accelerator, checkpoint, folder


def load_data(args, resolved, accelerator, out_dir, checkpoint):
    """Raw texts, the tokenizer (loaded or trained), and the training / validation blocks."""
    raw, description = load_raw_data(args)
    accelerator.print(f"data: {description}")
    tokenizer, line = load_tokenizer(args, resolved.section("tokenizer"), raw, out_dir, checkpoint, accelerator)
    accelerator.print(line)
    train_blocks, eval_blocks, line = prepare_blocks(raw, tokenizer, args, accelerator)
    accelerator.print(line)
    eval_tokens = scored_tokens(eval_blocks) if eval_blocks is not None else 0
    if eval_blocks is not None and eval_tokens < MIN_EVAL_TOKENS and args.keep_best_model:
        accelerator.print(f"warning: the validation set has {eval_tokens} scored tokens, too few to choose the best "
                          f"model by (under {MIN_EVAL_TOKENS} its loss is mostly chance): keeping the last model; "
                          "give a larger --validation_file to keep the best")
    return SimpleNamespace(raw=raw, description=description, tokenizer=tokenizer, train=train_blocks,
                           eval=eval_blocks, eval_tokens=eval_tokens)


# ------------------------------------------------------------------------------------------------ the plan
def global_batch(args, accelerator) -> int:
    return args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps


def plan_model(args, resolved, data, accelerator, checkpoint=None):
    """The optimizer (its moments count in the memory check), the GPU batch, the config and graph, the memory check."""
    say = accelerator.print
    plan = choose_optimizer(args.optimizer, 1 if args.sharding else accelerator.num_processes, args.max_grad_norm,
                            fsdp=is_fsdp(accelerator))
    args.moment_dtype = resolve_moment_dtype(args.moment_dtype, plan, accelerator.mixed_precision,
                                             accelerator.device.type)
    device_type, free = memory.device_facts(accelerator.device)
    saved = read_train_state(checkpoint).get("signature", {}) if checkpoint is not None else {}
    step = presets.choose_step_batch(args, device_type, len(data.train), accelerator.num_processes,
                                     saved.get("global_batch"))
    config, graph, min_count = plan_length_and_config(args, resolved, data, accelerator, checkpoint, step,
                                                      memory.agreed_free(accelerator, free))
    V, P, edges = config.vocab_size, config.num_parameters_formula(), config.num_edges
    say(f"graph: {config.graph}, V={V} nodes, {edges:,} real edges of {V * V:,} possible ({edges / (V * V):.2%})"
        + (f", bigrams seen >= {min_count} times" if graph is not None else "")
        + f"; d={config.node_size}; parameters {P:,} ({memory.human_bytes(4 * P)} fp32)"
        + (f"; count prior of all {config.count_prior_bigrams:,} bigrams seen" if config.count_prior else ""))
    if args.sharding:  # clips by the global norm too (ShardedBriLLM.clip_grad_norm_)
        plan = dataclasses.replace(plan, reason="--edge_sharding source: each process updates the touched rows it owns")
    say(optimizers.describe_optimizer(plan, args.max_grad_norm, args.moment_dtype))
    if plan.name != "sparse_adamw" and args.shared_edge_lr_scale != 1.0 and args.shared_rate_from_preset:
        say(f"the recipe's shared-edge rate ({args.shared_edge_lr_scale}x) needs sparse edge gradients: with "
            f"{plan.name} the shared edge trains at the base rate")
        args.shared_edge_lr_scale = 1.0
    say(memory.check_memory(config, accelerator, args))
    recipe = args.recipe_choice
    recipe.add(Setting("training", "moment_dtype", args.moment_dtype, recipe.rule("training.moment_dtype"),
                       f"{plan.name} on {accelerator.device.type}, mixed precision {accelerator.mixed_precision}"))
    recipe.inputs.update(preset=args.config, recipe_file=args.recipe)
    say(recipe.describe())
    return config, graph, plan


def plan_length_and_config(args, resolved, data, accelerator, checkpoint, step, free):
    """The run's planned epochs and the recipe's config and graph for them, with a batch that fits the device: where
    the memory check halves the batch and the run's length in epochs follows from it, both are planned again."""
    while True:
        args.planned_epochs = planned_epochs(args, data, accelerator, checkpoint)
        if args.planned_epochs is None:  # a time budget: the epochs it buys, timed
            args.planned_epochs = epochs_in_budget(args, resolved, data, accelerator, step, free)
        base = dataclasses.replace(resolved, settings={key: dataclasses.replace(s, value=getattr(args, s.name))
                                                       if s.section == "training" else s
                                                       for key, s in resolved.settings.items()})
        budgeted = args.max_train_time is not None and args.min_bigram_count == "auto"  # a sparser graph trains faster
        run_plan = RunPlan(args.planned_epochs, budgeted, args.max_train_steps, global_batch(args, accelerator),
                           len(data.train), accelerator.device.type, accelerator.mixed_precision)
        recipe, sequences = presets.plan_recipe(base, data.tokenizer, data.train, run_plan, say=accelerator.print)
        config, graph = presets.build_from_recipe(recipe, data.tokenizer, data.train, sequences)
        args.learning_rate, args.recipe_choice = recipe.value("training", "learning_rate"), recipe
        batch = args.per_device_train_batch_size
        if line := presets.fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free):
            accelerator.print(line)
        if step is not None:  # the batch the device left, and why, in recipe.json
            recipe.add(Setting("training", "per_device_train_batch_size", args.per_device_train_batch_size,
                               recipe.rule("training.per_device_train_batch_size"), line or ""))
        if args.per_device_train_batch_size == batch or planned_epochs(args, data, accelerator, checkpoint) == \
                args.planned_epochs:
            return config, graph, recipe.value("training", "min_bigram_count")
        accelerator.print(f"planning the run again for batch {args.per_device_train_batch_size}")


def planned_epochs(args, data, accelerator, checkpoint=None) -> float | None:
    """The run's length in epochs, before the loaders exist (None for a time budget). A resumed run takes its
    checkpoint's, so that `auto` choices rebuild the graph it was trained on even when the run is extended."""
    state = {} if checkpoint is None else read_train_state(checkpoint)
    saved = state.get("signature", {})
    if state.get("planned_epochs"):
        return state["planned_epochs"]
    if saved.get("max_train_steps") and saved.get("global_batch"):
        return saved["max_train_steps"] * saved["global_batch"] / max(len(data.train), 1)
    if getattr(args, "max_train_time", None) is not None:
        return None
    if args.max_train_steps is None:
        return float(args.num_train_epochs)
    return args.max_train_steps * global_batch(args, accelerator) / max(len(data.train), 1)


def epochs_in_budget(args, resolved, data, accelerator, step=None, free=None) -> float:
    """The epochs --max_train_time buys (at most --max_train_steps'): the slowest process's pace on a throwaway model
    of the data's graph, the run's random state untouched; a batch the device chose (`step`) is fitted first."""
    device = accelerator.device
    recipe, sequences = presets.plan_recipe(resolved, data.tokenizer, data.train)
    config, graph = presets.build_from_recipe(recipe, data.tokenizer, data.train, sequences)
    presets.fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        pace = time_steps(args, config, graph, data, accelerator)
    accelerator.step = 0  # the probe's micro-batches do not count towards the run's accumulation
    pace = float(accelerator.gather(torch.tensor([pace], device=device)).max())
    blocks = global_batch(args, accelerator) / len(data.train)
    epochs = args.max_train_time / pace * blocks
    if args.max_train_steps is not None:
        epochs = min(epochs, args.max_train_steps * blocks)
    accelerator.print(f"--max_train_time {args.max_train_time:g}s: {pace:.4f}s per step (timed on a throwaway "
                      f"model) plans {epochs:.2f} epoch(s)")
    return epochs


def time_steps(args, config, graph, data, accelerator) -> float:
    """Seconds per optimizer step of a throwaway model (unprepared: no gradient exchange) on the run's batches."""
    device = accelerator.device
    plan = choose_optimizer(args.optimizer, accelerator.num_processes, args.max_grad_norm, fsdp=is_fsdp(accelerator))
    model = BriLLMForCausalLM.from_graph(graph, config=config).to(device)
    optimizer = build_optimizer(
        model, plan, args.learning_rate, args.weight_decay, accelerator, lazy_weight_decay=args.lazy_weight_decay,
        node_lr_scale=args.node_lr_scale, moment_dtype=args.moment_dtype,  # plan_model resolved it for this plan
        shared_edge_lr_scale=args.shared_edge_lr_scale if plan.name == "sparse_adamw" else 1.0)
    step = TrainStep(accelerator, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                     per_device_batch_size=args.per_device_train_batch_size, block_size=args.block_size,
                     max_grad_norm=args.max_grad_norm, clip=plan.clip, learning_rate=args.learning_rate)
    loader = DataLoader(data.train, shuffle=True, collate_fn=collate, drop_last=True,
                        batch_size=args.per_device_train_batch_size, generator=torch.Generator().manual_seed(args.seed))
    batches = itertools.chain.from_iterable(itertools.repeat(loader))

    def one_step():  # one optimizer step: the accumulated micro-batches
        for _ in range(args.gradient_accumulation_steps):
            step({k: v.to(device) for k, v in next(batches).items()})

    return seconds_per_step(one_step, torch.cuda.synchronize if device.type == "cuda" else (lambda: None))


# --------------------------------------------------------------------------------------- the model and job
def prepare(args, config, graph, plan, data, accelerator, checkpoint):
    """The model, the loaders (training: shuffled, whole batches) and the optimizer, prepared or sharded by source."""
    W = accelerator.num_processes
    if len(data.train) < args.per_device_train_batch_size * W:
        raise UsageError(f"{len(data.train)} training blocks cannot fill one global batch of "
                         f"{args.per_device_train_batch_size} x {W} process(es); lower --per_device_train_batch_size.")
    train_loader = DataLoader(data.train, shuffle=True, collate_fn=collate, drop_last=True,
                              batch_size=args.per_device_train_batch_size)
    # a sharded run does not prepare the validation loader: every process reads every batch and scores its share
    eval_batch = args.per_device_eval_batch_size * (W if args.sharding else 1)
    eval_loader = None if data.eval is None else DataLoader(data.eval, collate_fn=collate, batch_size=eval_batch)
    options = dict(lazy_weight_decay=args.lazy_weight_decay, node_lr_scale=args.node_lr_scale,
                   shared_edge_lr_scale=args.shared_edge_lr_scale, moment_dtype=args.moment_dtype)
    if args.sharding:  # the model is not prepared: no DDP wrapper
        return (*sharded.prepare_sharded(args, config, graph, accelerator, checkpoint, train_loader, **options),
                eval_loader)
    model = BriLLMForCausalLM.from_graph(graph, config=config)
    optimizer_of = lambda m: build_optimizer(m, plan, args.learning_rate, args.weight_decay, accelerator, **options)
    if fsdp_on_cpu(accelerator):  # accelerate does not shard on the CPU: torch's fully_shard, by the script
        return prepare_on_cpu(accelerator, model, optimizer_of, train_loader, eval_loader)
    return accelerator.prepare(model, optimizer_of(model), train_loader, eval_loader)  # passes a None loader through


def make_job(args, parts, plan, data, config, accelerator, out_dir) -> Job:
    """The schedule, the step, the log and the best-model keeper around the prepared parts; fixes the run's length."""
    model, optimizer, train_loader, eval_loader = parts
    args.steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None and args.max_train_time is None:
        args.max_train_steps = args.num_train_epochs * args.steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / args.steps_per_epoch) if args.max_train_steps else None
    clock = TrainingClock(args.max_train_time)
    lr_scheduler = accelerator.prepare(make_schedule(optimizer, args.lr_scheduler_type, args.num_warmup_steps,
                                                     args.max_train_steps, clock))
    step_kind = sharded.ShardedTrainStep if args.sharding else TrainStep
    train_step = step_kind(accelerator, model, optimizer, lr_scheduler, learning_rate=args.learning_rate,
                           per_device_batch_size=args.per_device_train_batch_size, block_size=args.block_size,
                           max_grad_norm=args.max_grad_norm if plan.clip else None, seed=args.seed)
    signature = {"global_batch": global_batch(args, accelerator), "block_size": args.block_size,
                 "block_mode": args.block_mode, "seed": args.seed, "num_edges": config.num_edges,
                 "vocab_size": config.vocab_size, "max_train_steps": args.max_train_steps,
                 "max_train_time": args.max_train_time,
                 "signal_dropout_warmup_epochs": args.signal_dropout_warmup_epochs}
    keep = args.keep_best_model and eval_loader is not None and data.eval_tokens >= MIN_EVAL_TOKENS

    def write_extra(tmp):  # every checkpoint holds the run's recipe.json (`--recipe` reads it there) and shards
        if args.sharding:
            model.save_shard(tmp, optimizer)
        if accelerator.is_main_process:
            args.recipe_choice.save(tmp)

    load_shards = lambda path: sharded.load_sharded_checkpoint(model, optimizer, lr_scheduler, path)
    return Job(accelerator, model, optimizer, lr_scheduler, train_loader, eval_loader, train_step,
               sharded.evaluate_sharded if args.sharding else evaluate_dense,  # the sharded model has no logits
               log=TrainLog(out_dir, accelerator, tracking=args.with_tracking),
               best=BestModel(out_dir, accelerator, enabled=keep), tokenizer=data.tokenizer, signature=signature,
               clock=clock, write_extra=write_extra, load_extra=load_shards if args.sharding else None)


def claim_folder(args, job: Job, config, folder, checkpoint):
    """The disk must hold what the run writes (its checkpoints, best and final model); then a fresh run removes the
    earlier run's checkpoints and log. Each checkpoint is written before the ones past the limit go: limit + 1."""
    every, steps, limit = args.checkpointing_steps, args.max_train_steps, args.checkpoints_total_limit
    planned = (steps // every if isinstance(every, int) else args.num_train_epochs) if steps and every else None
    kept = 0 if every is None else (min(planned or limit + 1, limit + 1) if limit else planned or 1)
    weights = args.model_bytes = 4 * config.num_parameters_formula()
    args.checkpoint_bytes = weights * (2 if args.moment_dtype == "bfloat16" else 3)  # weights + moments
    what = f"{kept} checkpoint(s) of {memory.human_bytes(args.checkpoint_bytes)} and " if kept else ""
    what += f"the model{' and its best evaluation' if job.best.enabled else ''}, {memory.human_bytes(weights)} each"
    if job.accelerator.is_main_process:
        need = kept * args.checkpoint_bytes + weights * (1 + job.best.enabled)
        folder.claim(need, what, fresh=checkpoint is None, say=job.accelerator.print)
    job.accelerator.wait_for_everyone()


def init_tracking(args, accelerator):
    """Experiment trackers with the run's flags (never a token, key or password) and the model's fields."""
    if args.with_tracking:
        plain = (int, float, str, bool)
        hparams = {k: v for k, v in vars(args).items() if isinstance(v, plain) and not SECRET.search(k)}
        model = {f"model_{k}": v for k, v in args.recipe_choice.section("model").items() if isinstance(v, plain)}
        accelerator.init_trackers("brillm_pretrain", {**hparams, **model})


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


# -------------------------------------------------------------------------------------------- after training
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
        prepared = job.model if is_fsdp(job.accelerator) else None
        best.load_into(job.accelerator.unwrap_model(job.model), prepared=prepared)
        best_ppl = math.exp(min(best.eval_loss, 700.0))
        say(f"kept the best model: step {best.step} (validation loss {best.eval_loss:.4f}, perplexity "
            f"{best_ppl:,.2f}), not the last step {steps} ({loss1:.4f})")
        summary.update(perplexity=best_ppl, eval_loss=best.eval_loss, best_step=best.step, last_eval_loss=loss1)
    elif best.enabled and best.step is not None:
        say(f"kept the best model: the last step {steps} (validation loss {loss1:.4f})")
        summary.update(best_step=steps)


def final_fix(args, folder) -> str:
    """What a failed final save leaves, and what to do."""
    kept = "the training state is in its last checkpoint: " + RESUME if args.checkpointing_steps else \
        "this run kept no checkpoint (--checkpointing_steps), so its training is lost"
    return f"the model that was in {folder.path} is intact; {kept}"


def save_final(args, job: Job, tokenizer, folder):
    """The Hugging Face folder, staged beside the old model; returns the plain model."""
    accelerator, model = job.accelerator, job.model
    with folder.staging(accelerator, "the final model", final_fix(args, folder), args.model_bytes) as staged:
        if args.sharding:  # gathered on the main process (host RAM for the whole table), a plain BriLLM folder
            unwrapped = model.export_model()
            if accelerator.is_main_process:
                unwrapped.save_pretrained(staged, safe_serialization=True)
        else:
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.sparse_gradients = False
            state_dict = full_state_dict(accelerator, model)
            with own_class(unwrapped):  # FSDP: the model's own code, not torch's FSDP class, goes into the folder
                unwrapped.save_pretrained(staged, is_main_process=accelerator.is_main_process,
                                          save_function=accelerator.save, state_dict=state_dict,
                                          safe_serialization=True)
        if accelerator.is_main_process:
            tokenizer.model_max_length = unwrapped.config.max_position_embeddings  # pipelines and harnesses read it
            tokenizer.save_pretrained(staged)
            args.recipe_choice.save(staged)  # --recipe out_dir/recipe.json builds the same config
    return unwrapped


def show_generations(args, job: Job, unwrapped, data, summary: dict):
    """A few greedy and sampled continuations (all processes take part under FSDP, whose weights are sharded)."""
    accelerator, fsdp = job.accelerator, is_fsdp(job.accelerator)
    prompts = choose_prompts(args, data.raw["validation"] if "validation" in data.raw else None,
                             not (args.train_file or args.dataset_name))
    if prompts and args.num_generations > 0 and (accelerator.is_main_process or fsdp):
        samples = generate_samples(job.model if fsdp else unwrapped, data.tokenizer, prompts, args, accelerator.device)
        accelerator.print("generations (greedy | sampled, top-k 40, temperature 0.8):")
        for s in samples:
            accelerator.print(f"  {s['prompt']!r}\n    greedy : {s['prompt']}{s['greedy']}\n"
                              f"    sampled: {s['prompt']}{s['sampled']}")
        summary["generations"] = samples


def publish(args, job: Job, unwrapped, data, plan, summary: dict, folder):
    """pretrain_summary.json and the model card beside the staged model, the model swapped in, --push_to_hub."""
    accelerator, say, out_dir = job.accelerator, job.accelerator.print, folder.path

    def write_card(target, repo_id=None):  # README.md with metadata, the final perplexity and usage, as Trainer writes
        return write_training_card(target, unwrapped, data.tokenizer, args, summary, data.description,
                                   repo_id=repo_id, optimizer=plan.name, name=out_dir.name)

    if accelerator.is_main_process:
        with writing(out_dir, "the final model", final_fix(args, folder), cleanup=folder.unstage):
            write_json(folder.staged / SUMMARY_NAME, summary)
            write_card(folder.staged, args.hub_model_id if args.push_to_hub else None)
        folder.install()
        job.best.discard()
        say(f"saved the model and tokenizer to {out_dir} (AutoModelForCausalLM.from_pretrained(..., "
            "trust_remote_code=True))")
        say(f"model card: {out_dir / 'README.md'}")
    if args.with_tracking:
        accelerator.end_training()
    if args.push_to_hub and accelerator.is_main_process:
        repo_id = push_folder(out_dir, args.hub_model_id or out_dir.resolve().name, args.hub_token,
                              "BriLLM pretraining", before_upload=lambda repo: write_card(out_dir, repo))
        say(f"pushed to https://huggingface.co/{repo_id}")
    accelerator.wait_for_everyone()
