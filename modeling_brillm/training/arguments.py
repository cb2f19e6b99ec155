"""The command line of `examples/pretrain.py` (the flags of transformers' `run_clm_no_trainer.py` where the concept is
the same, plus BriLLM's own) and the checks that need no data. A flag left out takes the preset's value, or the default
preset's (shown in brackets: recipe.RULES)."""

import argparse
import os

from .data import file_builder
from .errors import UsageError
from .optimizers import MOMENT_DTYPES, OPTIMIZERS
from .presets import flag_of, known_presets
from .recipe import DEFAULT_PRESET
from .sharded import EDGE_SHARDINGS

SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "warmup_stable_decay"]


def number_in(valid, expected: str, auto: bool = False, kind=float):
    """An argparse type: a number (of `kind`) for which `valid` holds, or "auto" where `auto`."""
    def parse(value: str):
        if auto and value == "auto":
            return value
        try:
            if valid(number := kind(value)):
                return number
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"expected {expected}{' or ' + repr('auto') if auto else ''}, got {value!r}")
    return parse


count_or_auto = number_in(lambda count: True, "a positive integer", auto=True, kind=int)  # checked with the preset's
positive_rate = number_in(lambda r: 0 < r < float("inf"), "a positive learning rate")
probability_or_auto = number_in(lambda p: 0 <= p < 1, "a probability in [0, 1)", auto=True)


def setting(group, key: str, text: str, **kwargs):
    """A flag that sets one setting of the run; its help ends with the default preset's value and rule."""
    rule = DEFAULT_PRESET[key]
    group.add_argument(f"--{flag_of(key)}", help=f"{text} [default: {rule.value!r}, rule {rule.name}]", **kwargs)


def parse_args(argv=None) -> argparse.Namespace:  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(description="Pretrain BriLLM (a graph language model) with accelerate. A setting not "
                                "given on the command line comes from --config (a preset) or --recipe, else from the "
                                "default preset (docs/training.md).")
    S, boolean = argparse.SUPPRESS, argparse.BooleanOptionalAction
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", help="A dataset on the Hugging Face Hub (needs network access).")
    g.add_argument("--dataset_config_name", help="Its configuration name.")
    g.add_argument("--train_file", help="Training text: .txt/.text (one text per line), .json/.jsonl, .csv.")
    g.add_argument("--validation_file", help="Validation text, same formats as --train_file.")
    g.add_argument("--text_column", default="text", help="Column/field holding the text in json/csv/hub data.")
    g.add_argument("--skip_records_without_text", action="store_true", help="Train on the records that have the "
                   "--text_column field and say how many lack it (without this flag such records are refused).")
    setting(g, "training.validation_split_percentage", "Share of the training texts held out (every k-th) when "
            "there is no validation set.", type=float)
    setting(g, "training.max_eval_samples", "Evaluate on at most this many blocks.", type=int)
    g.add_argument("--preprocessing_num_workers", type=int, help="Processes for datasets.map.")
    g.add_argument("--overwrite_cache", action="store_true", help="Recompute the tokenized datasets.")
    setting(g, "training.block_size", "Tokens per training block (the paper: 32).", type=int)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--sentence_blocks", dest="block_mode", action="store_const", const="sentence",
                      help="One sentence per block: <s> sentence </s>, truncated, padding masked (the default).")
    mode.add_argument("--contiguous_blocks", dest="block_mode", action="store_const", const="contiguous",
                      help="Concatenate all texts (<s> text </s> ...) and cut blocks of --block_size tokens.")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer_name", help="A saved Hugging Face tokenizer folder; else one is trained.")
    setting(g, "tokenizer.kind", "Tokenizer to train: byte-level BPE or characters.", choices=["bpe", "char"])
    setting(g, "tokenizer.vocab_size", "Vocabulary (= graph nodes) to train.", type=int)
    setting(g, "tokenizer.min_frequency", "Min count of a merge/character.", type=int)

    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"A preset name ({', '.join(known_presets())}) or a JSON path.")
    g.add_argument("--recipe", metavar="FILE", help="A recipe.json an earlier run saved: apply its settings "
                   "verbatim (no probing of the data) in place of a preset.")
    setting(g, "model.node_size", "Neurons per node, d.", type=int)
    graph = g.add_mutually_exclusive_group()
    setting(graph, "training.min_bigram_count", "Sparse graph: real edges for the bigrams seen at least this often; "
            "auto: chosen from held-back training text and the planned epochs (printed).", type=count_or_auto)
    graph.add_argument("--dense_graph", action="store_true", default=None,
                       help="Every ordered pair of nodes is a real edge (V^2 edges: 16.9B parameters at V=4000).")
    setting(g, "model.loss_type", "exact: cross-entropy over all V nodes; sampled: the release's (true + K "
            "negatives).", choices=["exact", "sampled"])
    setting(g, "model.num_negatives", "K negatives of the sampled loss.", type=int)
    setting(g, "model.negative_sampling", "Negatives of the sampled loss.", choices=["frequency", "uniform"])
    setting(g, "model.signal_dropout", "Dropout on the signal leaving every token, training only; auto: 0 up to 2 "
            "planned epochs E, then 0.5 x s x (1 - 2 / E).", type=probability_or_auto)
    setting(g, "model.non_edge_bias", "A learned energy offset per node for non-successors.", action=boolean)
    setting(g, "model.node_readout", "Every logit adds <x, r_v>, a learned d-vector per node (exact loss; off with "
            "--loss sampled).", action=boolean)
    setting(g, "model.edge_backoff", "Every edge adds a matrix all edges share to its own.", action=boolean)
    setting(g, "model.node_embedding", "Every node adds a learned d-vector to the edge output it passes on.",
            action=boolean)
    setting(g, "model.count_prior", "Add a fixed smoothed bigram model of the training text to every logit (off "
            "with --loss sampled or --dense_graph).", action=boolean)
    setting(g, "model.position_recency", "Position weights start at 1 + this x k (0: the paper's).", type=float)
    g.add_argument("--config_overrides", metavar="FIELD=VALUE,...", help="Other BriLLMConfig fields, e.g. "
                   "\"edge_rank=4\" (low-rank edges); a preset's \"model\" section takes them too [the config's own]")

    g = p.add_argument_group("training")
    setting(g, "training.per_device_train_batch_size", "Blocks per process (on a GPU, unless given: 65,536 tokens "
            "// --block_size, halved until the step fits).", type=int)
    setting(g, "training.per_device_eval_batch_size", "Blocks per process and validation batch.", type=int)
    setting(g, "training.learning_rate", "Peak learning rate (the paper: 5e-2).", type=positive_rate)
    setting(g, "training.weight_decay", "AdamW weight decay on edge matrices.", type=float)
    setting(g, "training.num_train_epochs", "Epochs.", type=int)
    setting(g, "training.max_train_steps", "Optimizer steps; overrides epochs.", type=int)
    g.add_argument("--max_train_time", type=float, metavar="SECONDS", help="A training-time budget: train until the "
                   "training clock (the steps, not evaluations or checkpoints) passes it, or --max_train_steps first; "
                   "the epochs it buys are timed on throwaway steps, and the schedule follows the clock.")
    setting(g, "training.gradient_accumulation_steps", "Micro-batches per optimizer step.", type=int)
    setting(g, "training.lr_scheduler_type", "The learning-rate schedule.", choices=SCHEDULERS)
    setting(g, "training.num_warmup_steps", "Linear warmup steps.", type=int)
    setting(g, "training.max_grad_norm", "Clip the gradient norm (0: off).", type=float)
    setting(g, "training.lazy_weight_decay", "SparseAdamW: decay every edge row as dense AdamW would, when the row "
            "is next touched.", action=boolean)
    setting(g, "training.shared_edge_lr_scale", "Rate multiplier of the shared edge (SparseAdamW).", type=float)
    setting(g, "training.node_lr_scale", "Rate multiplier of the per-node parameters.", type=float)
    setting(g, "training.signal_dropout_warmup_epochs", "The dropout grows from 0 over this many epochs.", type=float)
    setting(g, "training.moment_dtype", "SparseAdamW's moments (bfloat16: stochastic rounding, half the bytes; "
            "none: bfloat16 under bf16 on a GPU).", choices=MOMENT_DTYPES)
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="auto", help="auto: sparse_adamw (only the touched edge "
                   "rows) in one process and with --edge_sharding source, adamw (fused, dense) with several [auto]")
    g.add_argument("--edge_sharding", choices=EDGE_SHARDINGS, default="none", help="source: each process owns the "
                   "edge blocks of a set of source nodes and their AdamW state (modeling_brillm/sharding/) [none]")
    setting(g, "training.seed", "Seed of initialisation and data order.", type=int)
    setting(g, "training.torch_threads", "CPU threads per process (none: torch's default).", type=int)
    setting(g, "training.eval_steps", "Validate every N optimizer steps.", type=int)
    g.add_argument("--eval_seconds", type=float, nargs="+", metavar="S",
                   help="Validate whenever the training clock passes one of these seconds.")
    g.add_argument("--keep_best_model", action=boolean, default=True, help="Save the weights of the evaluation "
                   "with the lowest validation loss, not the last step's (--no_keep_best: the last) [on]")
    g.add_argument("--no_keep_best", dest="keep_best_model", action="store_false", help=S)
    setting(g, "training.checkpointing_steps", "Save the training state every N steps, or 'epoch'.")
    setting(g, "training.checkpoints_total_limit", "Keep only the last N checkpoints.", type=int)
    g.add_argument("--resume_from_checkpoint", help="A checkpoint folder, or 'latest' (newest in --output_dir).")
    g.add_argument("--output_dir", default="outputs/pretrain", help="Where the model, tokenizer, logs go.")
    g.add_argument("--overwrite_output_dir", action="store_true", help="Replace the earlier run in --output_dir: its "
                   "checkpoints and log go once this run's inputs are checked, its model when this run's is saved.")
    g.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers (--report_to).")
    g.add_argument("--report_to", default="all", help="Trackers: tensorboard, wandb, ... or 'all'.")

    g = p.add_argument_group("after training")
    setting(g, "training.num_generations", "Prompts to continue at the end.", type=int)
    setting(g, "training.max_new_tokens", "Tokens per continuation.", type=int)
    g.add_argument("--prompts", nargs="+", help="Prompts to continue (default: built in or from validation).")
    g.add_argument("--push_to_hub", action="store_true", help="Upload the final folder to the Hub.")
    g.add_argument("--hub_model_id", help="Repository name for --push_to_hub (default: output_dir's name).")
    g.add_argument("--hub_token", help="Token for --push_to_hub; better HF_TOKEN or `hf auth login`, which keep it off "
                   "the command line.")
    g.add_argument("--no_malloc_tuning", action="store_true", help="Do not make glibc keep freed memory (CPU).")
    p.add_argument("--available_memory_gb", type=float, help=S)  # tests: pretend this much memory is free
    p.add_argument("--step_sleep", type=float, default=0.0, help=S)  # tests: sleep after every optimizer step
    return p.parse_args(argv)


POSITIVE = ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "num_train_epochs")
POSITIVE_IF_GIVEN = ("max_train_steps", "eval_steps", "checkpoints_total_limit", "max_eval_samples")


def positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"--{name} must be a positive integer, got {value}.")


def check_args(args, max_positions: int):
    """The checks that need no data, on the resolved settings (a preset's values included)."""
    for name in POSITIVE + tuple(n for n in POSITIVE_IF_GIVEN if getattr(args, n) is not None):
        positive(name, getattr(args, name))
    if args.block_size > max_positions:
        raise UsageError(f"--block_size {args.block_size} is beyond the model's max_position_embeddings="
                         f"{max_positions}: BriLLM has {max_positions} learned position weights; use --block_size <= "
                         f"{max_positions}.")
    if args.block_size < 2:
        raise UsageError("--block_size must be at least 2 (a block needs one bigram).")
    if args.checkpointing_steps not in (None, "epoch"):
        try:
            args.checkpointing_steps = int(args.checkpointing_steps)
        except ValueError:
            raise UsageError(f"--checkpointing_steps must be a number or 'epoch', got "
                             f"{args.checkpointing_steps!r}.") from None
        positive("checkpointing_steps", args.checkpointing_steps)
    for name in ("shared_edge_lr_scale", "node_lr_scale"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be a positive number, got {getattr(args, name)}.")
    count, warmup = args.min_bigram_count, args.signal_dropout_warmup_epochs
    if count != "auto" and not isinstance(count, int):
        raise UsageError(f"--min_bigram_count must be a positive integer or 'auto', got {count!r} (check the preset's "
                         "training section).")
    if count != "auto":
        positive("min_bigram_count", count)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < float("inf"):
        raise UsageError(f"--signal_dropout_warmup_epochs must be a number of epochs >= 0 (0: the full dropout from "
                         f"the first step), got {warmup!r}.")
    budget, points = args.max_train_time, args.eval_seconds or []  # a setup the timing probe can plan
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
    check_data_flags(args)


def check_data_flags(args):
    if not 0 <= args.validation_split_percentage < 100:
        raise UsageError("--validation_split_percentage must be in [0, 100).")
    if args.validation_file and not (args.train_file or args.dataset_name):
        raise UsageError("--validation_file needs --train_file (or --dataset_name) too.")
    if args.train_file and args.dataset_name:
        raise UsageError("give either --train_file or --dataset_name, not both.")
    for flag, path in (("train_file", args.train_file), ("validation_file", args.validation_file)):
        if path is not None:
            file_builder(path, flag)
            if not os.path.isfile(path):
                raise UsageError(f"--{flag} {path}: no such file.")
            if os.path.getsize(path) == 0:
                raise UsageError(f"--{flag} {path} is empty: there is no text to train on.")
    if args.tokenizer_name and not os.path.isdir(args.tokenizer_name):
        raise UsageError(f"--tokenizer_name {args.tokenizer_name}: not a folder with a saved tokenizer.")
