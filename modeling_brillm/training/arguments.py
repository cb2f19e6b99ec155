"""The command line of `examples/pretrain.py`: the flags of transformers' `run_clm_no_trainer.py` wherever the
concept is the same, plus BriLLM's own, and the checks that need no data. A flag left out takes the preset's value,
or the default preset's (shown in brackets: recipe.RULES)."""

from __future__ import annotations

import argparse
import os

from .data import file_builder
from .errors import UsageError
from .optimizers import MOMENT_DTYPES, OPTIMIZERS
from .presets import known_presets
from .recipe import DEFAULT_PRESET
from .sharded import EDGE_SHARDINGS

SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "warmup_stable_decay"]


def count_or_auto(value: str):
    """--min_bigram_count: a positive count, or "auto" (pruning.decide_min_count)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def number_in(valid, expected: str, auto: bool = False):
    """An argparse type: a number for which `valid` holds (and "auto" where `auto`)."""
    def parse(value: str):
        if auto and value == "auto":
            return value
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or not valid(number):
            raise argparse.ArgumentTypeError(f"expected {expected}{' or ' + repr('auto') if auto else ''}, "
                                             f"got {value!r}")
        return number
    return parse


positive_rate = number_in(lambda r: 0 < r < float("inf"), "a positive learning rate")
probability_or_auto = number_in(lambda p: 0 <= p < 1, "a probability in [0, 1)", auto=True)


def default(key: str) -> str:
    """The default preset's value of a setting, for a flag's help."""
    return f" [{DEFAULT_PRESET[key].value}]"


def parse_args(argv=None) -> argparse.Namespace:  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(
        description="Pretrain BriLLM (a graph language model) with accelerate. Values not given on the command "
        "line come from --config (a preset), then from the default preset (the paper's model with a recipe sized by "
        "the data: docs/training.md).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    S = argparse.SUPPRESS
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", help="A dataset on the Hugging Face Hub (needs network access).")
    g.add_argument("--dataset_config_name", help="Its configuration name.")
    g.add_argument("--train_file", help="Training text: .txt/.text (one text per line), .json/.jsonl, .csv.")
    g.add_argument("--validation_file", help="Validation text, same formats as --train_file.")
    g.add_argument("--text_column", default="text", help="Column/field holding the text in json/csv/hub data.")
    g.add_argument("--validation_split_percentage", type=float, help="Share of the training texts held out for "
                   "validation when there is no validation set (every k-th text)."
                   + default("training.validation_split_percentage"))
    g.add_argument("--max_eval_samples", type=int, help="Evaluate on at most this many blocks.")
    g.add_argument("--preprocessing_num_workers", type=int, help="Processes for datasets.map.")
    g.add_argument("--overwrite_cache", action="store_true", help="Recompute the tokenized datasets.")
    g.add_argument("--block_size", type=int, help="Tokens per training block (the paper: 32)."
                   + default("training.block_size"))
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--sentence_blocks", dest="block_mode", action="store_const", const="sentence", default=None,
                      help="One sentence per block: <s> sentence </s>, truncated to --block_size, padding masked "
                      "(the paper's setup; the default).")
    mode.add_argument("--contiguous_blocks", dest="block_mode", action="store_const", const="contiguous",
                      help="Concatenate all texts (<s> text </s> ...) and cut blocks of --block_size tokens.")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer_name", help="A saved Hugging Face tokenizer folder; else one is trained.")
    g.add_argument("--tokenizer_kind", choices=["bpe", "char"], help="Tokenizer to train: byte-level BPE "
                   "(English) or characters (Chinese)." + default("tokenizer.kind"))
    g.add_argument("--vocab_size", type=int, help="Vocabulary (= graph nodes) to train."
                   + default("tokenizer.vocab_size"))
    g.add_argument("--tokenizer_min_frequency", type=int, help="Min count of a merge/character."
                   + default("tokenizer.min_frequency"))

    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"A preset name ({', '.join(known_presets())}) or a JSON path.")
    g.add_argument("--recipe", metavar="FILE",
                   help="A recipe.json an earlier run saved (in its output folder or a checkpoint): apply its "
                   "settings verbatim (no probing of the data), in place of the default preset and a preset.")
    g.add_argument("--node_size", type=int, help="Neurons per node, d (the paper: 32).")
    graph = g.add_mutually_exclusive_group()
    graph.add_argument("--min_bigram_count", type=count_or_auto,
                       help="Sparse graph: real edges for the bigrams seen at least this often; auto: the smallest "
                       "count whose bigrams recur in held-back training text (at least 2 where that text strays), "
                       "raised if need be until every edge is a training target at least twice in the planned "
                       "epochs (printed at start-up)." + default("training.min_bigram_count"))
    graph.add_argument("--dense_graph", action="store_true", default=None,
                       help="Every ordered pair of nodes is a real edge (V^2 edges: 16.9B parameters at V=4000).")
    g.add_argument("--loss", choices=["exact", "sampled"],
                   help="exact: cross-entropy over all V nodes; sampled: the release's (true + K negatives).")
    g.add_argument("--num_negatives", type=int, help="K negatives of the sampled loss."
                   + default("model.num_negatives"))
    g.add_argument("--negatives", choices=["frequency", "uniform"],
                   help="Negatives of the sampled loss: most frequent successors, or uniform.")
    g.add_argument("--signal_dropout", type=probability_or_auto,
                   help="Dropout on the signal leaving every token, training only (config.signal_dropout); auto: "
                   "0 up to 2 planned epochs E, then 0.5 x (1 - 2 / E) (docs/training.md)."
                   + default("model.signal_dropout"))
    g.add_argument("--non_edge_bias", action=argparse.BooleanOptionalAction,
                   help="A learned energy offset per node for non-successors, so unseen continuations differ "
                   "(config.non_edge_bias; exact loss, sparse graph). [off]")
    g.add_argument("--node_readout", action=argparse.BooleanOptionalAction,
                   help="Every node also reads the signal directly: its logit adds <x, r_v>, a learned d-vector per "
                   "node (config.node_readout; exact loss). [on; off with --loss sampled]")
    g.add_argument("--edge_backoff", action=argparse.BooleanOptionalAction,
                   help="Every edge adds a learned matrix all edges share to its own, so rare edges inherit what the "
                   "common ones learn (config.edge_backoff). [off]")
    g.add_argument("--node_embedding", action=argparse.BooleanOptionalAction,
                   help="Every node adds a learned d-vector to the edge output it passes on, so the signal carries "
                   "the recent tokens themselves (config.node_embedding). [on]")
    g.add_argument("--count_prior", action=argparse.BooleanOptionalAction,
                   help="Add a fixed smoothed bigram model of the training text to every logit, so the learned parts "
                   "model what the counts miss (config.count_prior; exact loss, sparse graph). [on; off with --loss "
                   "sampled or --dense_graph]")
    g.add_argument("--position_recency", type=float,
                   help="Position weights start at 1 + this x k, so the signal's mix starts weighted to the latest "
                   "edges (config.position_recency; 0 = the paper's all ones)." + default("model.position_recency"))

    g = p.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=int,
                   help="Blocks per process. [32; on a GPU 65,536 tokens // --block_size, halved until the step fits "
                   "its free memory (docs/gpu.md)]")
    g.add_argument("--per_device_eval_batch_size", type=int, help=default("training.per_device_eval_batch_size"))
    g.add_argument("--learning_rate", type=positive_rate, help="Peak learning rate (the paper: 5e-2)."
                   + default("training.learning_rate"))
    g.add_argument("--weight_decay", type=float, help="AdamW weight decay on edge matrices."
                   + default("training.weight_decay"))
    g.add_argument("--num_train_epochs", type=int, help=default("training.num_train_epochs"))
    g.add_argument("--max_train_steps", type=int, help="Optimizer steps; overrides epochs.")
    g.add_argument("--max_train_time", type=float, metavar="SECONDS",
                   help="A training-time budget: train until the training clock (seconds of steps: data, forward, "
                   "backward, optimizer step; evaluations and checkpoints not counted) passes it, or --max_train_steps "
                   "if that comes first. The epochs it buys are timed on a few throwaway steps before the run and "
                   "planned where --num_train_epochs would be (the auto choices read them); past its warmup the "
                   "learning-rate schedule follows the clock to the budget.")
    g.add_argument("--gradient_accumulation_steps", type=int, help=default("training.gradient_accumulation_steps"))
    g.add_argument("--lr_scheduler_type", choices=SCHEDULERS, help=default("training.lr_scheduler_type"))
    g.add_argument("--num_warmup_steps", type=int, help="Linear warmup steps." + default("training.num_warmup_steps"))
    g.add_argument("--max_grad_norm", type=float, help="Clip the gradient norm (0: off)."
                   + default("training.max_grad_norm"))
    g.add_argument("--lazy_weight_decay", action=argparse.BooleanOptionalAction,
                   help="SparseAdamW: decay every edge row as dense AdamW would, applied when the row is next touched "
                   "(off: only touched rows decay, once per step they are touched). [off]")
    g.add_argument("--shared_edge_lr_scale", type=float, help="Learning-rate multiplier of the shared edge (row 0 of "
                   "the edge tables; SparseAdamW)." + default("training.shared_edge_lr_scale"))
    g.add_argument("--node_lr_scale", type=float, help="Learning-rate multiplier of the per-node parameters "
                   "(node_bias, non_edge_bias)." + default("training.node_lr_scale"))
    g.add_argument("--signal_dropout_warmup_epochs", type=float,
                   help="The signal dropout grows linearly from 0 to --signal_dropout over this many epochs (0: the "
                   "full dropout from the first step)." + default("training.signal_dropout_warmup_epochs"))
    g.add_argument("--moment_dtype", choices=MOMENT_DTYPES,
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
    g.add_argument("--seed", type=int, help="Seed of initialisation and data order." + default("training.seed"))
    g.add_argument("--torch_threads", type=int,
                   help="CPU threads per process (torch.set_num_threads). BriLLM's steps are many small matrix "
                   "products, which extra threads barely speed up and slow down a lot on a busy machine. "
                   "[torch's default]")
    g.add_argument("--eval_steps", type=int, help="Validate every N optimizer steps.")
    g.add_argument("--eval_seconds", type=float, nargs="+", metavar="S",
                   help="Validate whenever the training clock passes one of these seconds (train_log.jsonl records "
                   "each with its train_seconds and train_tokens).")
    g.add_argument("--keep_best_model", action=argparse.BooleanOptionalAction, default=True,
                   help="With validation data: keep the weights of the evaluation with the lowest validation loss "
                   "and save those at the end (as Trainer's load_best_model_at_end), not the last step's. The best "
                   "so far is part of every checkpoint. --no-keep_best_model (or --no_keep_best) saves the last.")
    g.add_argument("--no_keep_best", dest="keep_best_model", action="store_false", help=S)
    g.add_argument("--checkpointing_steps",
                   help="Save the training state every N steps, or 'epoch' at the end of every epoch.")
    g.add_argument("--checkpoints_total_limit", type=int, help="Keep only the last N checkpoints.")
    g.add_argument("--resume_from_checkpoint", help="A checkpoint folder, or 'latest' (newest in --output_dir).")
    g.add_argument("--output_dir", default="outputs/pretrain", help="Where the model, tokenizer, logs go.")
    g.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers (--report_to).")
    g.add_argument("--report_to", default="all", help="Trackers: tensorboard, wandb, ... or 'all'.")

    g = p.add_argument_group("after training")
    g.add_argument("--num_generations", type=int, help="Prompts to continue at the end."
                   + default("training.num_generations"))
    g.add_argument("--max_new_tokens", type=int, help="Tokens per continuation." + default("training.max_new_tokens"))
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


POSITIVE = ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "num_train_epochs")
POSITIVE_IF_GIVEN = ("max_train_steps", "eval_steps", "checkpoints_total_limit", "max_eval_samples")


def check_args(args, max_positions: int):
    """The checks that need no data, on the resolved settings (a preset's values included)."""
    def positive(name, value):
        if value is None or value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}.")

    for name in POSITIVE:
        positive(name, getattr(args, name))
    for name in POSITIVE_IF_GIVEN:
        if getattr(args, name) is not None:
            positive(name, getattr(args, name))
    check_graph_and_dropout(args)
    check_time_budget(args)
    if args.block_size > max_positions:
        raise UsageError(
            f"--block_size {args.block_size} is beyond the model's max_position_embeddings={max_positions}: "
            f"BriLLM has {max_positions} learned position weights; use --block_size <= {max_positions}.")
    if args.block_size < 2:
        raise UsageError("--block_size must be at least 2 (a block needs one bigram).")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        try:
            args.checkpointing_steps = int(args.checkpointing_steps)
        except ValueError:
            raise UsageError(f"--checkpointing_steps must be a number or 'epoch', got "
                             f"{args.checkpointing_steps!r}.") from None
        positive("checkpointing_steps", args.checkpointing_steps)
    for name in ("shared_edge_lr_scale", "node_lr_scale"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be a positive number, got {getattr(args, name)}.")
    check_data_flags(args)


def check_graph_and_dropout(args):
    count, warmup = args.min_bigram_count, args.signal_dropout_warmup_epochs
    if count != "auto" and (not isinstance(count, int) or count < 1):
        if isinstance(count, int):
            raise UsageError(f"--min_bigram_count must be a positive integer, got {count}.")
        raise UsageError(f"--min_bigram_count must be a positive integer or 'auto', got {count!r} "
                         "(check the preset's training section).")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < float("inf"):
        raise UsageError(f"--signal_dropout_warmup_epochs must be a number of epochs >= 0 (0: the full dropout from "
                         f"the first step), got {warmup!r}.")


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


def check_data_flags(args):
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
    if args.tokenizer_name and not os.path.isdir(args.tokenizer_name):
        raise UsageError(f"--tokenizer_name {args.tokenizer_name}: not a folder with a saved tokenizer.")
