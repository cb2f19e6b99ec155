"""Planning a pretraining run before its model exists: the optimizer, the batch on a GPU, the run's length in epochs
(timed on throwaway steps under a time budget), the recipe's auto values for that length, and the memory check."""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.utils.data import DataLoader

from modeling_brillm import BriLLMForCausalLM

from . import memory
from .checkpoints import read_train_state
from .data import collate
from .epochs import seconds_per_step
from .fsdp import is_fsdp
from .loop import TrainStep
from .optimizers import build_optimizer, choose_optimizer, describe_optimizer, resolve_moment_dtype
from .presets import build_config_and_graph, build_from_recipe, choose_step_batch, fit_step_batch, plan_recipe
from .recipe import RunPlan, Setting


def global_batch(args, accelerator) -> int:
    return args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps


def plan_model(args, resolved, data, accelerator, checkpoint=None):
    """The optimizer (its moments count in the memory check), the batch on a GPU, the config and graph of the
    training blocks for the run's length, the memory check; returns (config, graph, optimizer plan)."""
    say = accelerator.print
    plan = choose_optimizer(args.optimizer, 1 if args.sharding else accelerator.num_processes, args.max_grad_norm,
                            fsdp=is_fsdp(accelerator))
    args.moment_dtype = resolve_moment_dtype(args.moment_dtype, plan, accelerator.mixed_precision,
                                             accelerator.device.type)
    step, free = device_batch(args, data, accelerator, checkpoint)
    config, graph, min_count = plan_length_and_config(args, resolved, data, accelerator, checkpoint, step, free)
    V, P, edges = config.vocab_size, config.num_parameters_formula(), config.num_edges
    say(f"graph: {config.graph}, V={V} nodes, {edges:,} real edges of {V * V:,} possible ({edges / (V * V):.2%})"
        + (f", bigrams seen >= {min_count} times" if graph is not None else "")
        + f"; d={config.node_size}; parameters {P:,} ({memory.human_bytes(4 * P)} fp32)"
        + (f"; count prior of all {config.count_prior_bigrams:,} bigrams seen" if config.count_prior else ""))
    if args.sharding:  # clips by the global norm too (ShardedBriLLM.clip_grad_norm_)
        plan = dataclasses.replace(plan, reason="--edge_sharding source: each process updates the touched rows it "
                                   "owns")
    say(describe_optimizer(plan, args.max_grad_norm, args.moment_dtype))
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


def device_batch(args, data, accelerator, checkpoint):
    """The batch GPU_STEP_TOKENS chooses on a CUDA device where none is given, and the free memory (None off CUDA)."""
    device_type, free = memory.device_facts(accelerator.device)
    saved = read_train_state(checkpoint).get("signature", {}) if checkpoint is not None else {}
    step = choose_step_batch(args, device_type, len(data.train), accelerator.num_processes, saved.get("global_batch"))
    return step, memory.agreed_free(accelerator, free)


def plan_length_and_config(args, resolved, data, accelerator, checkpoint, step, free):
    """The run's planned epochs and the recipe's config and graph for them, with a batch that fits the device: where
    the memory check halves the batch and the run's length in epochs follows from it, both are planned again."""
    say = accelerator.print
    while True:
        args.planned_epochs = planned_epochs(args, data, accelerator, checkpoint)
        if args.planned_epochs is None:  # a time budget: the epochs it buys, timed
            args.planned_epochs = epochs_in_budget(args, resolved, data, accelerator, step, free)
        budgeted = args.max_train_time is not None and args.min_bigram_count == "auto"  # a sparser graph trains faster
        config, graph, min_count = plan_config(args, resolved, data, accelerator, budgeted)
        batch = args.per_device_train_batch_size
        line = fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free)
        if line:
            say(line)
        if step is not None:  # the batch the device left, and why, in recipe.json
            args.recipe_choice.add(Setting("training", "per_device_train_batch_size", args.per_device_train_batch_size,
                                           args.recipe_choice.rule("training.per_device_train_batch_size"), line or ""))
        if args.per_device_train_batch_size == batch or planned_epochs(args, data, accelerator, checkpoint) == \
                args.planned_epochs:
            return config, graph, min_count
        say(f"planning the run again for batch {args.per_device_train_batch_size}")


def plan_config(args, resolved, data, accelerator, budgeted: bool):
    """(config, graph, count) of the recipe's auto values for this data and run, with the training values as the
    plan left them on `args` (a GPU's batch, the moments' dtype); sets `args.recipe_choice`."""
    base = dataclasses.replace(resolved, settings={key: dataclasses.replace(s, value=getattr(args, s.name))
                                                   if s.section == "training" else s
                                                   for key, s in resolved.settings.items()})
    run_plan = RunPlan(args.planned_epochs, budgeted, args.max_train_steps, global_batch(args, accelerator),
                       len(data.train), accelerator.device.type, accelerator.mixed_precision)
    recipe, sequences = plan_recipe(base, data.tokenizer, data.train, run_plan, say=accelerator.print)
    config, graph = build_from_recipe(recipe, data.tokenizer, data.train, sequences)
    args.learning_rate, args.recipe_choice = recipe.value("training", "learning_rate"), recipe
    return config, graph, recipe.value("training", "min_bigram_count")


def planned_epochs(args, data, accelerator, checkpoint=None) -> float | None:
    """The run's length in epochs of the training blocks, before the loaders exist; None for a time budget
    (epochs_in_budget times it). A resumed run takes the length its checkpoint was planned with, so `auto` choices
    rebuild the graph the checkpoint was trained on even when the run is extended."""
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
    """The epochs --max_train_time buys (at most --max_train_steps'): a few steps of the run's batches timed on a
    throwaway model of the data's graph at no planned length (the slowest process's pace), without touching the
    run's random state. A batch the device chose (`step`) is first fitted to the device's `free` memory."""
    device = accelerator.device
    config, graph, _ = build_config_and_graph(resolved, data.tokenizer, data.train)
    fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        pace = _time_steps(args, config, graph, data, accelerator)
    accelerator.step = 0  # the probe's micro-batches do not count towards the run's accumulation
    pace = float(accelerator.gather(torch.tensor([pace], device=device)).max())
    epochs = args.max_train_time / pace * global_batch(args, accelerator) / len(data.train)
    if args.max_train_steps is not None:
        epochs = min(epochs, args.max_train_steps * global_batch(args, accelerator) / len(data.train))
    accelerator.print(f"--max_train_time {args.max_train_time:g}s: {pace:.4f}s per step (timed on a throwaway "
                      f"model) plans {epochs:.2f} epoch(s)")
    return epochs


def _time_steps(args, config, graph, data, accelerator) -> float:
    """Seconds per optimizer step of a throwaway model (unprepared: no gradient exchange) on the run's batches."""

    device = accelerator.device
    plan = choose_optimizer(args.optimizer, accelerator.num_processes, args.max_grad_norm, fsdp=is_fsdp(accelerator))
    model = BriLLMForCausalLM.from_graph(graph, config=config).to(device)
    optimizer = build_optimizer(
        model, plan, args.learning_rate, args.weight_decay, accelerator, lazy_weight_decay=args.lazy_weight_decay,
        node_lr_scale=args.node_lr_scale, moment_dtype=resolve_moment_dtype(
            args.moment_dtype, plan, accelerator.mixed_precision, device.type),
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
