#!/usr/bin/env python
"""Pretrain a BriLLM graph language model with `accelerate launch`.

The flags follow transformers' `run_clm_no_trainer.py` wherever the concept is the same; the BriLLM-specific
ones choose the tokenizer, the graph and the loss. What one run does, in order:

1. data: `--train_file`/`--validation_file` (.txt/.text one text per line, .json/.jsonl records, .csv rows),
   or `--dataset_name` from the Hub, or, with neither, the English documentation text embedded in every
   CPython install (`pydoc_data.topics`), so the script runs offline anywhere;
2. tokenizer: `--tokenizer_name` (a saved tokenizer folder) or one trained on the training text with
   `tokenization.build_tokenizer` (byte-level BPE or characters) and saved into `--output_dir`;
3. blocks of `--block_size` tokens (`datasets.map`, batched and cached): one sentence per block
   (`<s> sentence </s>`, truncated, padded with `<pad>` that is masked out of the loss) or contiguous blocks;
4. the graph: the sparse bigram graph of the training blocks (`--min_bigram_count`) or the dense one; the
   parameter count and the training memory are estimated first, and a model that cannot fit is refused;
5. AdamW (betas 0.9/0.999, eps 1e-8, the paper's; `--optimizer auto`: SparseAdamW on sparse row gradients in
   one process, fused AdamW on dense gradients under DDP and FSDP), warmup schedule, gradient accumulation and
   clipping, periodic validation perplexity, atomic checkpoints that resume exactly;
6. at the end: the best model by validation loss (`--keep_best_model`, on by default: a later step that has begun
   to memorise the training text does not replace it) as a Hugging Face folder (`save_pretrained`, safetensors,
   with the model's code, and a model card README.md with its validation perplexity), a few greedy and sampled
   continuations, and `--push_to_hub`.

`run()` below is the whole job as a sequence of named steps; the pieces other scripts share live in
`modeling_brillm/training/` (the epoch loop in `epochs.py`, the kept best model in `best.py`).

Examples:

    accelerate launch --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \\
        --config demo --output_dir outputs/demo
    accelerate launch --config_file configuration/accelerate/gpu8_ddp.yaml examples/pretrain.py \\
        --config brillm-en --train_file wiki_en.txt --output_dir outputs/brillm-en

Every optimizer step appends `{"step", "loss", "lr", "tokens", ...}` to `<output_dir>/train_log.jsonl` (and
every evaluation `{"step", "eval_loss", "perplexity"}`); the loss of a step is the token-weighted mean over the
whole global batch, so it is the same number whatever the number of processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from types import SimpleNamespace

from modeling_brillm.training import memory
from modeling_brillm.training.best import BestModel
from modeling_brillm.training.checkpoints import TrainLog, prepare_output_dir, read_train_state, resolve_checkpoint
from modeling_brillm.training.data import (
    collate,
    file_builder,
    load_raw_data,
    load_tokenizer,
    prepare_blocks,
    text_stats,
)
from modeling_brillm.training.epochs import (
    CLOCK_STEPS,
    Job,
    Position,
    TrainingClock,
    eval_record,
    follow_clock,
    resume,
    seconds_per_step,
    train_epochs,
)
from modeling_brillm.training.errors import UsageError
from modeling_brillm.training.fsdp import fsdp_on_cpu, full_state_dict, is_fsdp, own_class, prepare_on_cpu
from modeling_brillm.training.launch import make_accelerator
from modeling_brillm.training.loop import TrainStep, choose_prompts, generate_samples
from modeling_brillm.training.loop import evaluate as evaluate_dense
from modeling_brillm.training.memory import check_memory, human_bytes
from modeling_brillm.training.optimizers import (
    MOMENT_DTYPES,
    OPTIMIZERS,
    apply_pending_weight_decay,
    build_optimizer,
    choose_optimizer,
    describe_optimizer,
    resolve_moment_dtype,
)
from modeling_brillm.training.presets import (
    build_config_and_graph,
    build_from_recipe,
    choose_step_batch,
    fit_step_batch,
    known_presets,
    plan_recipe,
    resolve_settings,
)
from modeling_brillm.training.publishing import push_folder, write_training_card
from modeling_brillm.training.recipe import TRAINING_RECIPE, RunPlan, Setting
from modeling_brillm.training.sharded import (
    EDGE_SHARDINGS,
    ShardedTrainStep,
    build_sharded,
    build_sharded_optimizer,
    checkpoint_kind_error,
    evaluate_sharded,
    load_sharded_checkpoint,
    resolve_optimizer,
    whole_model_fits,
)

SUMMARY_NAME = "pretrain_summary.json"


# ---------------------------------------------------------------------------------------------- arguments
def count_or_auto(value: str):
    """--min_bigram_count: a positive count, or "auto" (pruning.choose_min_count)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def number_or_auto(value: str, valid, expected: str):
    """"auto", or a number for which `valid` holds (argparse's error names `expected` otherwise)."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is None or not valid(number):
        raise argparse.ArgumentTypeError(f"expected {expected} or 'auto', got {value!r}")
    return number


def positive_rate(value: str) -> float:
    """--learning_rate: a positive number."""
    try:
        rate = float(value)
    except ValueError:
        rate = None
    if rate is None or not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive learning rate, got {value!r}")
    return rate


def probability_or_auto(value: str):
    """--signal_dropout: a probability in [0, 1), or "auto" (pruning.choose_signal_dropout)."""
    return number_or_auto(value, lambda p: 0 <= p < 1, "a probability in [0, 1)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pretrain BriLLM (a graph language model) with accelerate. Values not given on the command "
        "line come from --config (a preset), then from built-in defaults (the paper's model with a recipe sized by "
        "the data: docs/training.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    S = argparse.SUPPRESS
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", help="A dataset on the Hugging Face Hub (needs network access).")
    g.add_argument("--dataset_config_name", help="Its configuration name.")
    g.add_argument("--train_file", help="Training text: .txt/.text (one text per line), .json/.jsonl, .csv.")
    g.add_argument("--validation_file", help="Validation text, same formats as --train_file.")
    g.add_argument("--text_column", default="text", help="Column/field holding the text in json/csv/hub data.")
    g.add_argument("--validation_split_percentage", type=float, default=None,
                   help="Share of the training texts held out for validation when there is no validation set "
                   "(every k-th text, deterministic). [5]")
    g.add_argument("--max_eval_samples", type=int, default=None, help="Evaluate on at most this many blocks.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="Processes for datasets.map.")
    g.add_argument("--overwrite_cache", action="store_true", help="Recompute the tokenized datasets.")
    g.add_argument("--block_size", type=int, default=None, help="Tokens per training block (the paper: 32). [64]")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--sentence_blocks", dest="block_mode", action="store_const", const="sentence", default=None,
                      help="One sentence per block: <s> sentence </s>, truncated to --block_size, padding masked "
                      "(the paper's setup; the default).")
    mode.add_argument("--contiguous_blocks", dest="block_mode", action="store_const", const="contiguous",
                      help="Concatenate all texts (<s> text </s> ...) and cut blocks of --block_size tokens.")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer_name", help="A saved Hugging Face tokenizer folder; else one is trained.")
    g.add_argument("--tokenizer_kind", choices=["bpe", "char"], default=None,
                   help="Tokenizer to train: byte-level BPE (English) or characters (Chinese). [bpe]")
    g.add_argument("--vocab_size", type=int, default=None, help="Vocabulary (= graph nodes) to train. [4000]")
    g.add_argument("--tokenizer_min_frequency", type=int, default=None, help="Min count of a merge/character. [2]")

    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"A preset name ({', '.join(known_presets())}) or a JSON path.")
    g.add_argument("--recipe", metavar="FILE",
                   help="A recipe.json an earlier run saved (in its output folder or a checkpoint): apply its "
                   "settings verbatim (no probing of the data), in place of the built-in recipe and a preset.")
    g.add_argument("--node_size", type=int, default=None, help="Neurons per node, d (the paper: 32).")
    graph = g.add_mutually_exclusive_group()
    graph.add_argument("--min_bigram_count", type=count_or_auto, default=None,
                       help="Sparse graph: real edges for the bigrams seen at least this often; auto: the smallest "
                       "count whose bigrams recur in held-back training text (at least 2 where that text strays), "
                       "raised if need be until every edge is a training target at least twice in the planned "
                       "epochs (printed at start-up). [auto]")
    graph.add_argument("--dense_graph", action="store_true", default=None,
                       help="Every ordered pair of nodes is a real edge (V^2 edges: 16.9B parameters at V=4000).")
    g.add_argument("--loss", choices=["exact", "sampled"], default=None,
                   help="exact: cross-entropy over all V nodes; sampled: the release's (true + K negatives).")
    g.add_argument("--num_negatives", type=int, default=None, help="K negatives of the sampled loss. [400]")
    g.add_argument("--negatives", choices=["frequency", "uniform"], default=None,
                   help="Negatives of the sampled loss: most frequent successors, or uniform.")
    g.add_argument("--signal_dropout", type=probability_or_auto, default=None,
                   help="Dropout on the signal leaving every token, training only (config.signal_dropout); auto: "
                   "0 up to 2 planned epochs E, then 0.5 x (1 - 2 / E) (docs/training.md). [auto]")
    g.add_argument("--non_edge_bias", action=argparse.BooleanOptionalAction, default=None,
                   help="A learned energy offset per node for non-successors, so unseen continuations differ "
                   "(config.non_edge_bias; exact loss, sparse graph). [off]")
    g.add_argument("--node_readout", action=argparse.BooleanOptionalAction, default=None,
                   help="Every node also reads the signal directly: its logit adds <x, r_v>, a learned d-vector per "
                   "node (config.node_readout; exact loss). [on; off with --loss sampled]")
    g.add_argument("--edge_backoff", action=argparse.BooleanOptionalAction, default=None,
                   help="Every edge adds a learned matrix all edges share to its own, so rare edges inherit what the "
                   "common ones learn (config.edge_backoff). [off]")
    g.add_argument("--node_embedding", action=argparse.BooleanOptionalAction, default=None,
                   help="Every node adds a learned d-vector to the edge output it passes on, so the signal carries "
                   "the recent tokens themselves (config.node_embedding). [on]")
    g.add_argument("--count_prior", action=argparse.BooleanOptionalAction, default=None,
                   help="Add a fixed smoothed bigram model of the training text to every logit, so the learned parts "
                   "model what the counts miss (config.count_prior; exact loss, sparse graph). [on; off with --loss "
                   "sampled or --dense_graph]")
    g.add_argument("--position_recency", type=float, default=None,
                   help="Position weights start at 1 + this x k, so the signal's mix starts weighted to the latest "
                   "edges (config.position_recency; 0 = the paper's all ones). [0.2]")

    g = p.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=int, default=None,
                   help="Blocks per process. [32; on a GPU 65,536 tokens // --block_size, halved until the step fits "
                   "its free memory (docs/gpu.md)]")
    g.add_argument("--per_device_eval_batch_size", type=int, default=None, help="[32]")
    g.add_argument("--learning_rate", type=positive_rate, default=None,
                   help="Peak learning rate (the paper: 5e-2). [2e-2]")
    g.add_argument("--weight_decay", type=float, default=None, help="AdamW weight decay on edge matrices. [0.1]")
    g.add_argument("--num_train_epochs", type=int, default=None, help="[1]")
    g.add_argument("--max_train_steps", type=int, default=None, help="Optimizer steps; overrides epochs.")
    g.add_argument("--max_train_time", type=float, default=None, metavar="SECONDS",
                   help="A training-time budget: train until the training clock (seconds of steps: data, forward, "
                   "backward, optimizer step; evaluations and checkpoints not counted) passes it, or --max_train_steps "
                   "if that comes first. The epochs it buys are timed on a few throwaway steps before the run and "
                   "planned where --num_train_epochs would be (the auto choices read them); past its warmup the "
                   "learning-rate schedule follows the clock to the budget.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=None, help="[1]")
    g.add_argument("--lr_scheduler_type", default=None,
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                            "constant_with_warmup", "inverse_sqrt", "warmup_stable_decay"], help="[linear]")
    g.add_argument("--num_warmup_steps", type=int, default=None, help="Linear warmup steps. [0]")
    g.add_argument("--max_grad_norm", type=float, default=None, help="Clip the gradient norm (0: off). [1.0]")
    g.add_argument("--lazy_weight_decay", action=argparse.BooleanOptionalAction, default=None,
                   help="SparseAdamW: decay every edge row as dense AdamW would, applied when the row is next touched "
                   "(off: only touched rows decay, once per step they are touched). [off]")
    g.add_argument("--shared_edge_lr_scale", type=float, default=None,
                   help="Learning-rate multiplier of the shared edge (row 0 of the edge tables; SparseAdamW). [1]")
    g.add_argument("--node_lr_scale", type=float, default=None,
                   help="Learning-rate multiplier of the per-node parameters (node_bias, non_edge_bias). [1]")
    g.add_argument("--signal_dropout_warmup_epochs", type=float, default=None,
                   help="The signal dropout grows linearly from 0 to --signal_dropout over this many epochs (0: the "
                   "full dropout from the first step). [0]")
    g.add_argument("--moment_dtype", choices=MOMENT_DTYPES, default=None,
                   help="SparseAdamW's moments: bfloat16 stores them with stochastic rounding (half their memory and "
                   "bytes). [bfloat16 under --mixed_precision bf16 with SparseAdamW on a GPU, else float32]")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="auto",
                   help="auto: sparse_adamw in one process, adamw with several; adamw: torch AdamW (fused) on "
                   "dense gradients; sparse_adamw: modeling_brillm.optimization.SparseAdamW on sparse edge "
                   "gradients, updating only the touched rows (one process, or with --edge_sharding source, where auto "
                   "picks it). All clip to --max_grad_norm (the global norm, also sharded).")
    g.add_argument("--edge_sharding", choices=EDGE_SHARDINGS, default="none",
                   help="none: every process holds the whole model (DDP with several processes); source: each "
                   "process owns the edge blocks of a set of source nodes and their AdamW state, exchanging "
                   "signals and edge rows instead of gradients (modeling_brillm/sharding.py).")
    g.add_argument("--seed", type=int, default=None, help="Seed of initialisation and data order. [42]")
    g.add_argument("--torch_threads", type=int, default=None,
                   help="CPU threads per process (torch.set_num_threads). BriLLM's steps are many small matrix "
                   "products, which extra threads barely speed up and slow down a lot on a busy machine. "
                   "[torch's default]")
    g.add_argument("--eval_steps", type=int, default=None, help="Validate every N optimizer steps.")
    g.add_argument("--eval_seconds", type=float, nargs="+", default=None, metavar="S",
                   help="Validate whenever the training clock passes one of these seconds (train_log.jsonl records "
                   "each with its train_seconds and train_tokens).")
    g.add_argument("--keep_best_model", action=argparse.BooleanOptionalAction, default=True,
                   help="With validation data: keep the weights of the evaluation with the lowest validation loss "
                   "and save those at the end (as Trainer's load_best_model_at_end), not the last step's. The best "
                   "so far is part of every checkpoint. --no-keep_best_model (or --no_keep_best) saves the last.")
    g.add_argument("--no_keep_best", dest="keep_best_model", action="store_false", help=S)
    g.add_argument("--checkpointing_steps", default=None,
                   help="Save the training state every N steps, or 'epoch' at the end of every epoch.")
    g.add_argument("--checkpoints_total_limit", type=int, default=None, help="Keep only the last N checkpoints.")
    g.add_argument("--resume_from_checkpoint", help="A checkpoint folder, or 'latest' (newest in --output_dir).")
    g.add_argument("--output_dir", default="outputs/pretrain", help="Where the model, tokenizer, logs go.")
    g.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers (--report_to).")
    g.add_argument("--report_to", default="all", help="Trackers: tensorboard, wandb, ... or 'all'.")

    g = p.add_argument_group("after training")
    g.add_argument("--num_generations", type=int, default=None, help="Prompts to continue at the end. [3]")
    g.add_argument("--max_new_tokens", type=int, default=None, help="Tokens per continuation. [20]")
    g.add_argument("--prompts", nargs="+", help="Prompts to continue (default: built in or from validation).")
    g.add_argument("--push_to_hub", action="store_true", help="Upload the final folder to the Hub.")
    g.add_argument("--hub_model_id", help="Repository name for --push_to_hub (default: output_dir's name).")
    g.add_argument("--hub_token", help="Token for --push_to_hub.")

    g.add_argument("--no_malloc_tuning", action="store_true",
                   help="On CPU (Linux/glibc) the script makes malloc keep freed memory (mallopt), which avoids "
                   "page-faulting the step's large temporaries back in every step; this turns that off.")
    # Hidden: for tests. Pretend this much memory is available; sleep after every optimizer step.
    p.add_argument("--available_memory_gb", type=float, default=None, help=S)
    p.add_argument("--step_sleep", type=float, default=0.0, help=S)
    return p.parse_args(argv)



def check_args(args, model_fields: dict):
    """Flag checks that need no data (after the preset is merged in)."""
    def positive(name, value=None):
        value = getattr(args, name) if value is None else value
        if value is None or value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}.")

    for name in ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "num_train_epochs"):
        positive(name)
    if args.min_bigram_count != "auto" and not isinstance(args.min_bigram_count, int):
        raise UsageError(f"--min_bigram_count must be a positive integer or 'auto', got {args.min_bigram_count!r} "
                         "(check the preset's training section).")
    if args.min_bigram_count != "auto":
        positive("min_bigram_count")
    warmup = args.signal_dropout_warmup_epochs
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < float("inf"):
        raise UsageError(f"--signal_dropout_warmup_epochs must be a number of epochs >= 0 (0: the full dropout from "
                         f"the first step), got {warmup!r}.")
    for name in ("max_train_steps", "eval_steps", "checkpoints_total_limit", "max_eval_samples"):
        if getattr(args, name) is not None:
            positive(name)
    check_time_budget(args)
    max_positions = model_fields.get("max_position_embeddings", 512)
    if args.block_size > max_positions:
        raise UsageError(
            f"--block_size {args.block_size} is beyond the model's max_position_embeddings={max_positions}: "
            f"BriLLM has {max_positions} learned position weights; use --block_size <= {max_positions}."
        )
    if args.block_size < 2:
        raise UsageError("--block_size must be at least 2 (a block needs one bigram).")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        try:
            args.checkpointing_steps = int(args.checkpointing_steps)
        except ValueError:
            raise UsageError(f"--checkpointing_steps must be a number or 'epoch', got "
                             f"{args.checkpointing_steps!r}.") from None
        positive("checkpointing_steps")
    if not 0 <= args.validation_split_percentage < 100:
        raise UsageError("--validation_split_percentage must be in [0, 100).")
    if args.validation_file and not (args.train_file or args.dataset_name):
        raise UsageError("--validation_file needs --train_file (or --dataset_name) too.")
    if args.train_file and args.dataset_name:
        raise UsageError("give either --train_file or --dataset_name, not both.")
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path is not None:
            file_builder(path, flag)
            if not os.path.isfile(path):
                raise UsageError(f"--{flag} {path}: no such file.")
            if os.path.getsize(path) == 0:
                raise UsageError(f"--{flag} {path} is empty: there is no text to train on.")
    for name in ("shared_edge_lr_scale", "node_lr_scale"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be a positive number, got {getattr(args, name)}.")
    if args.tokenizer_name and not os.path.isdir(args.tokenizer_name):
        raise UsageError(f"--tokenizer_name {args.tokenizer_name}: not a folder with a saved tokenizer.")


def check_time_budget(args):
    """--max_train_time and --eval_seconds: positive finite seconds, and a setup the timing probe can plan."""
    budget, points = args.max_train_time, args.eval_seconds or []
    if budget is not None and not 0 < budget < float("inf"):
        raise UsageError(f"--max_train_time must be a positive number of seconds, got {budget}.")
    if any(not 0 < s < float("inf") for s in points):
        raise UsageError(f"--eval_seconds must be positive numbers of seconds, got {points}.")
    if budget is not None and args.edge_sharding == "source":
        raise UsageError("--max_train_time times the whole model's step in every process, which --edge_sharding "
                         "source avoids; give --max_train_steps or --num_train_epochs instead.")
    if budget is not None and args.lr_scheduler_type == "inverse_sqrt":
        raise UsageError("--lr_scheduler_type inverse_sqrt has no end to follow the training clock to; with "
                         "--max_train_time choose another (e.g. linear, cosine, constant_with_warmup).")


# ---------------------------------------------------------------------------------------------- the steps
def settle_flags(args):
    """Preset < flags, the checks that need no data, the optimizer name the sharding allows."""
    args.shared_rate_from_preset = args.shared_edge_lr_scale is None  # a preset or default rate yields to dense AdamW
    model_fields, tok_settings = resolve_settings(args)
    check_args(args, model_fields)
    args.optimizer = resolve_optimizer(args.edge_sharding, args.optimizer)
    args.sharding = args.edge_sharding == "source"
    return model_fields, tok_settings


def start_run(args):
    """The accelerator, the checkpoint to resume from, and the output folder (cleared of an earlier run)."""
    accelerator, setup = make_accelerator(args, shards_on_cpu=True)
    accelerator.print(f"BriLLM pretraining: {setup}, preset {args.config or '(none: built-in defaults)'}")
    checkpoint = resolve_checkpoint(args)
    if checkpoint is not None and checkpoint_kind_error(checkpoint, args.sharding):
        raise checkpoint_kind_error(checkpoint, args.sharding)
    out_dir = prepare_output_dir(args.output_dir, checkpoint, bool(args.resume_from_checkpoint), accelerator)
    return accelerator, checkpoint, out_dir


def load_data(args, tok_settings, accelerator, out_dir, checkpoint):
    """Raw texts, the tokenizer (loaded or trained), and the training / validation blocks."""
    say = accelerator.print
    raw, description = load_raw_data(args)
    say(f"data: {description}")
    n_texts, n_nonblank = text_stats(raw["train"], args.text_column)
    if n_nonblank == 0:
        raise UsageError(f"the training data ({description}) contains no text: {n_texts} rows, all empty.")
    tokenizer, line = load_tokenizer(args, tok_settings, raw, out_dir, checkpoint, accelerator)
    if line:
        say(line)
    train_blocks, eval_blocks, line = prepare_blocks(raw, tokenizer, args, accelerator)
    say(line)
    return SimpleNamespace(raw=raw, description=description, tokenizer=tokenizer, train=train_blocks,
                           eval=eval_blocks)


def plan_model(args, model_fields, data, accelerator, checkpoint=None):
    """The batch on a GPU, the config and graph of the training blocks, the optimizer (its moments count in the
    memory check), the memory check; returns (config, graph, optimizer plan)."""
    say = accelerator.print
    fsdp = is_fsdp(accelerator)
    plan = choose_optimizer(args.optimizer, 1 if args.sharding else accelerator.num_processes, args.max_grad_norm,
                            fsdp=fsdp)
    args.moment_dtype = resolve_moment_dtype(args.moment_dtype, plan, accelerator.mixed_precision,
                                             accelerator.device.type)
    step, free = device_batch(args, data, accelerator, checkpoint)
    config, graph, min_count = plan_length_and_config(args, model_fields, data, accelerator, checkpoint, step, free)
    V, P, edges = config.vocab_size, config.num_parameters_formula(), config.num_edges
    say(f"graph: {config.graph}, V={V} nodes, {edges:,} real edges of {V * V:,} possible ({edges / (V * V):.2%})"
        + (f", bigrams seen >= {min_count} times" if graph is not None else "")
        + f"; d={config.node_size}; parameters {P:,} ({human_bytes(4 * P)} fp32)"
        + (f"; count prior of all {config.count_prior_bigrams:,} bigrams seen" if config.count_prior else ""))
    if args.sharding:  # clips by the global norm too (ShardedBriLLM.clip_grad_norm_)
        plan = dataclasses.replace(plan, reason="--edge_sharding source: each process updates the touched rows it "
                                   "owns")
    say(describe_optimizer(plan, args.max_grad_norm, args.moment_dtype))
    if plan.name != "sparse_adamw" and args.shared_edge_lr_scale != 1.0 and args.shared_rate_from_preset:
        say(f"the recipe's shared-edge rate ({args.shared_edge_lr_scale}x) needs sparse edge gradients: with "
            f"{plan.name} the shared edge trains at the base rate")
        args.shared_edge_lr_scale = 1.0
    say(check_memory(config, accelerator, args))
    say(settle_recipe(args, plan, accelerator))
    return config, graph, plan


def device_batch(args, data, accelerator, checkpoint):
    """On a CUDA device with no batch given, the batch GPU_STEP_TOKENS chooses (presets.choose_step_batch), before
    the run's length is planned from it; and the device's free memory (None off a CUDA device)."""
    device_type, free = memory.device_facts(accelerator.device)
    saved = read_train_state(checkpoint).get("signature", {}) if checkpoint is not None else {}
    step = choose_step_batch(args, device_type, len(data.train), accelerator.num_processes, saved.get("global_batch"))
    return step, memory.agreed_free(accelerator, free)


def plan_length_and_config(args, model_fields, data, accelerator, checkpoint, step, free):
    """The run's planned epochs and the recipe's config and graph for them (plan_config), with a batch that fits the
    device (presets.fit_step_batch): where the memory check halves the batch and the run's length in epochs follows
    from it (--max_train_steps, --max_train_time), the length and the recipe are planned again."""
    say = accelerator.print
    while True:
        args.planned_epochs = planned_epochs(args, data, accelerator, checkpoint)
        if args.planned_epochs is None:  # a time budget: the epochs it buys, timed
            args.planned_epochs = epochs_in_budget(args, model_fields, data, accelerator, step, free)
        budgeted = args.max_train_time is not None and args.min_bigram_count == "auto"  # a sparser graph trains faster
        config, graph, min_count = plan_config(args, model_fields, data, accelerator, args.planned_epochs, budgeted,
                                               say)
        batch = args.per_device_train_batch_size
        line = fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free)
        if line:
            say(line)
        if step is not None:  # the batch the device left, and why, in recipe.json
            key = "training.per_device_train_batch_size"
            args.recipe_choice.add(Setting("training", "per_device_train_batch_size", args.per_device_train_batch_size,
                                           args.recipe_choice.settings[key].rule, line or ""))
        if args.per_device_train_batch_size == batch or planned_epochs(args, data, accelerator, checkpoint) == \
                args.planned_epochs:
            return config, graph, min_count
        say(f"planning the run again for batch {args.per_device_train_batch_size}")


def plan_config(args, model_fields, data, accelerator, epochs, budgeted: bool, say):
    """The recipe of this data and run (presets.choose_recipe: the count and the dropout where "auto") and
    the config and graph it gives: (config, graph, the graph's count). Sets the rate and `args.recipe_choice`."""
    training = {name: getattr(args, name) for name in TRAINING_RECIPE}
    run_plan = RunPlan(epochs, budgeted, args.max_train_steps, global_batch(args, accelerator), len(data.train),
                       accelerator.device.type, accelerator.mixed_precision)
    recipe, sequences = plan_recipe(model_fields, data.tokenizer, data.train, training, run_plan,
                                    args.tokenizer_settings, args.setting_rules, say=say)
    config, graph = build_from_recipe(recipe, data.tokenizer, data.train, sequences)
    args.learning_rate, args.recipe_choice = recipe.value("training", "learning_rate"), recipe
    return config, graph, recipe.value("training", "min_bigram_count")


def settle_recipe(args, plan, accelerator) -> str:
    """The recipe with the moments' dtype the device gave, and what it came from; the start-up block."""
    recipe = args.recipe_choice
    recipe.add(Setting("training", "moment_dtype", args.moment_dtype, recipe.settings["training.moment_dtype"].rule,
                       f"{plan.name} on {accelerator.device.type}, mixed precision {accelerator.mixed_precision}"))
    recipe.inputs.update(preset=args.config, recipe_file=args.recipe)
    return recipe.describe()


def save_recipe_with_checkpoints(args, job: Job):
    """Every checkpoint folder holds the run's recipe.json too (`--recipe` reads it from there)."""
    extra = job.write_extra

    def write(tmp):
        if extra is not None:
            extra(tmp)
        if job.accelerator.is_main_process:
            args.recipe_choice.save(tmp)

    job.write_extra = write


def planned_epochs(args, data, accelerator, checkpoint=None) -> float | None:
    """The run's length in epochs of the training blocks, before the loaders exist (make_job fixes the steps); None
    for a time budget (epochs_in_budget times it). A resumed run takes the length its checkpoint was planned with,
    so `--min_bigram_count auto` rebuilds the graph the checkpoint was trained on even when the run is extended."""
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


def epochs_in_budget(args, model_fields, data, accelerator, step=None, free=None) -> float:
    """The epochs --max_train_time buys (at most --max_train_steps'): a throwaway model on the data's graph (at no
    planned length) times a few steps of the run's batches (epochs.seconds_per_step; the slowest process's pace),
    without touching the run's random state. The probe steps the model unprepared: no gradient exchange. A batch
    the device chose (`step`) is first fitted to the device's `free` memory with this graph, which has at least the
    edges of the run's (no planned length raises the count)."""
    import torch
    from torch.utils.data import DataLoader

    from modeling_brillm import BriLLMForCausalLM

    device = accelerator.device
    config, graph, _ = build_config_and_graph(model_fields, data.tokenizer, data.train, args.min_bigram_count)
    fit_step_batch(args, step, memory.step_memory(config, graph, accelerator, args), free)
    plan = choose_optimizer(args.optimizer, accelerator.num_processes, args.max_grad_norm, fsdp=is_fsdp(accelerator))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
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
                            batch_size=args.per_device_train_batch_size,
                            generator=torch.Generator().manual_seed(args.seed))
        batches = itertools.chain.from_iterable(itertools.repeat(loader))

        def one_step():  # one optimizer step: the accumulated micro-batches
            for _ in range(args.gradient_accumulation_steps):
                step({k: v.to(device) for k, v in next(batches).items()})

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        pace = seconds_per_step(one_step, sync)
    accelerator.step = 0  # the probe's micro-batches do not count towards the run's accumulation
    pace = float(accelerator.gather(torch.tensor([pace], device=device)).max())
    epochs = args.max_train_time / pace * global_batch(args, accelerator) / len(data.train)
    if args.max_train_steps is not None:
        epochs = min(epochs, args.max_train_steps * global_batch(args, accelerator) / len(data.train))
    accelerator.print(f"--max_train_time {args.max_train_time:g}s: {pace:.4f}s per step (timed on a throwaway "
                      f"model) plans {epochs:.2f} epoch(s)")
    return epochs


def build_model(args, config, graph, accelerator):
    """The model on every process, or None when a sharded run must build each process's shard directly."""
    from modeling_brillm import BriLLMForCausalLM

    if args.sharding and not whole_model_fits(config, accelerator, args):
        accelerator.print("the whole model does not fit one process: each process initialises only the blocks of "
                          "its own sources (ShardedBriLLM.from_config: seeded per source, not the one-process "
                          "initialisation)")
        return None
    return BriLLMForCausalLM.from_graph(graph, config=config)


def make_loaders(args, data, accelerator):
    """Training loader (shuffled, whole batches) and validation loader (None without validation blocks)."""
    from torch.utils.data import DataLoader

    W = accelerator.num_processes
    if len(data.train) < args.per_device_train_batch_size * W:
        raise UsageError(
            f"{len(data.train)} training blocks cannot fill one global batch of "
            f"{args.per_device_train_batch_size} x {W} process(es); lower --per_device_train_batch_size."
        )
    train_loader = DataLoader(data.train, shuffle=True, collate_fn=collate, drop_last=True,
                              batch_size=args.per_device_train_batch_size)
    # a sharded run does not prepare the validation loader: every process reads every batch and scores its share
    eval_batch = args.per_device_eval_batch_size * (W if args.sharding else 1)
    eval_loader = (DataLoader(data.eval, collate_fn=collate, batch_size=eval_batch)
                   if data.eval is not None else None)
    return train_loader, eval_loader


def prepare_model_and_optimizer(args, model, plan, loaders, config, graph, checkpoint, accelerator):
    """The optimizer, and everything handed to accelerate (or sharded by source node)."""
    import torch

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
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None and args.max_train_time is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch) if args.max_train_steps else None
    args.steps_per_epoch = steps_per_epoch
    clock = TrainingClock(args.max_train_time) if args.max_train_time is not None else None
    lr_scheduler = accelerator.prepare(make_scheduler(args, optimizer, clock))
    common = dict(learning_rate=args.learning_rate, per_device_batch_size=args.per_device_train_batch_size,
                  block_size=args.block_size, seed=args.seed)
    if args.sharding:  # the sharded model has no logits; evaluate_sharded gives the same figures
        train_step = ShardedTrainStep(accelerator, model, optimizer, lr_scheduler,
                                      max_grad_norm=args.max_grad_norm if plan.clip else None, **common)
        evaluate = evaluate_sharded
    else:
        train_step = TrainStep(accelerator, model, optimizer, lr_scheduler, max_grad_norm=args.max_grad_norm,
                               clip=plan.clip, **common)
        evaluate = evaluate_dense
    signature = {"global_batch": global_batch(args, accelerator), "block_size": args.block_size,
                 "block_mode": args.block_mode, "seed": args.seed, "num_edges": config.num_edges,
                 "vocab_size": config.vocab_size, "max_train_steps": args.max_train_steps,
                 "max_train_time": args.max_train_time,
                 "signal_dropout_warmup_epochs": args.signal_dropout_warmup_epochs}
    keep = args.keep_best_model and eval_loader is not None
    return Job(accelerator, model, optimizer, lr_scheduler, train_loader, eval_loader, train_step, evaluate,
               log=TrainLog(out_dir, accelerator, tracking=args.with_tracking),
               best=BestModel(out_dir, accelerator, enabled=keep), tokenizer=data.tokenizer, signature=signature,
               write_extra=(lambda tmp: model.save_shard(tmp, optimizer)) if args.sharding else None, clock=clock)


def make_scheduler(args, optimizer, clock: TrainingClock | None):
    """--lr_scheduler_type over --max_train_steps, or under a time budget over the training clock (after the warmup
    steps): epochs.follow_clock."""
    from transformers import get_scheduler

    if clock is None:
        return get_scheduler(args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                             num_training_steps=args.max_train_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=args.num_warmup_steps + CLOCK_STEPS)
    follow_clock(scheduler, clock, args.num_warmup_steps)
    return scheduler


def init_tracking(args, model_fields, accelerator):
    """Experiment trackers (--with_tracking) with the run's flags and the model's fields as hyperparameters."""
    if args.with_tracking:
        plain = (int, float, str, bool)
        hparams = {k: v for k, v in vars(args).items() if isinstance(v, plain)}
        model = {f"model_{k}": v for k, v in model_fields.items() if isinstance(v, plain)}
        accelerator.init_trackers("brillm_pretrain", {**hparams, **model})


def global_batch(args, accelerator) -> int:
    return args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps


def describe_training(args, job: Job, config) -> str:
    keep = "keeping the best model by validation loss" if job.best.enabled else "keeping the last model"
    length = f"{args.max_train_steps} steps ({args.steps_per_epoch} per epoch, {args.num_train_epochs} epoch(s))"
    if args.max_train_time is not None:
        length = (f"{args.max_train_time:g}s of training" + (f" or {args.max_train_steps} steps" if
                  args.max_train_steps else "") + f" ({args.steps_per_epoch} steps per epoch, "
                  f"{args.planned_epochs:.2f} epoch(s) planned)")
    return (f"training: {length}, global batch {job.signature['global_batch']} blocks = "
            f"{args.per_device_train_batch_size} x "
            f"{job.accelerator.num_processes} process(es) x {args.gradient_accumulation_steps} accumulation, lr "
            f"{args.learning_rate} ({args.lr_scheduler_type}, {args.num_warmup_steps} warmup), loss "
            f"{config.loss_type}{describe_dropout(args, config)}; {keep}")


def describe_dropout(args, config) -> str:
    if not config.signal_dropout:
        return ""
    text = f", signal dropout {config.signal_dropout:g}"
    warmup = args.signal_dropout_warmup_epochs
    return f"{text} (growing from 0 over the first {warmup:g} epoch(s))" if warmup else text


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
    accelerator = job.accelerator
    prompts = choose_prompts(args, data.raw["validation"] if "validation" in data.raw else None,
                             not (args.train_file or args.dataset_name))
    fsdp = is_fsdp(accelerator)
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


def start_summary(args, config, data, accelerator) -> dict:
    """The run's facts for pretrain_summary.json and the model card; the results are added as they come."""
    return {"data": data.description, "vocab_size": config.vocab_size, "num_edges": config.num_edges,
            "num_parameters": config.num_parameters_formula(), "node_size": config.node_size, "graph": config.graph,
            "processes": accelerator.num_processes, "global_batch": global_batch(args, accelerator)}


# ---------------------------------------------------------------------------------------------- the run
def run(args, data=None) -> int:
    """The whole job. `data`: what load_data returned for the same data flags (benchmarks/quality.py shares one
    preparation between runs); by default it is loaded here."""
    model_fields, tok_settings = settle_flags(args)
    accelerator, checkpoint, out_dir = start_run(args)
    data = data or load_data(args, tok_settings, accelerator, out_dir, checkpoint)
    config, graph, plan = plan_model(args, model_fields, data, accelerator, checkpoint)
    model = build_model(args, config, graph, accelerator)
    loaders = make_loaders(args, data, accelerator)
    parts = prepare_model_and_optimizer(args, model, plan, loaders, config, graph, checkpoint, accelerator)
    job = make_job(args, parts, plan, data, config, accelerator, out_dir)
    save_recipe_with_checkpoints(args, job)
    init_tracking(args, model_fields, accelerator)

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
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
