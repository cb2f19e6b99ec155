"""Quality against a Transformer: BriLLM and small GPT-2 models, the same data, the same training-time budget; a
BriLLM row IS an examples/pretrain.py run in this process (docs/benchmarks.md).

    python benchmarks/quality.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 \
        --budgets 60 600 --gpt2 4x128 4x256@1e-3
"""

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import add_results_dir, machine, other_cpu_load, wait_for_quiet, write_record
from gpt2 import SCHEDULERS, batch_order, bigram_reference, heldout_nll, labels_of, make_gpt2, target_mask  # noqa: F401
from gpt2 import row as gpt2_row
from gpt2 import sizes as gpt2_sizes

from modeling_brillm.training import pretraining as pretrain
from modeling_brillm.training.checkpoints import LOG_NAME, read_log, write_json
from modeling_brillm.training.epochs import TrainingClock, make_schedule  # noqa: F401  (the one clock)
from modeling_brillm.training.errors import UsageError, run_cli

GPT2_BATCH = 64
CONFIG_KEYS = ("node_size", "num_edges", "signal_dropout", "non_edge_bias", "node_readout", "edge_backoff",
               "node_embedding", "count_prior", "position_recency", "edge_rank")
ROW_ARGS = dict(batch_size="per_device_train_batch_size", optimizer="optimizer", lr="learning_rate",  # pretrain.py's
                weight_decay="weight_decay", warmup_steps="num_warmup_steps", lazy_weight_decay="lazy_weight_decay",
                shared_edge_lr_scale="shared_edge_lr_scale", node_lr_scale="node_lr_scale",
                min_bigram_count="min_bigram_count", schedule="lr_scheduler_type", grad_clip="max_grad_norm",
                signal_dropout_warmup_epochs="signal_dropout_warmup_epochs", preset="config")


def shared_arguments(p, **defaults) -> argparse.ArgumentParser:
    """The flags quality.py and recipe_sweep.py share: the preset, the data, the batch, threads, seed, folders."""
    for name in ("config", "train_file", "validation_file", "tokenizer_name"):  # default: pretrain.py's (the
        p.add_argument(f"--{name}")  # built-in recipe, the embedded corpus, every 20th text held out, one trained)
    p.add_argument("--text_column", default="text")
    for name in ("vocab_size", "block_size", "batch_size", "eval_batch_size", "max_eval_blocks", "max_train_steps",
                 "threads", "seed"):
        p.add_argument(f"--{name}", type=int, default=defaults.get(name))
    p.add_argument("--output_dir", default=defaults["output_dir"])
    return add_results_dir(p, wait_quiet=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[30.0, 90.0, 180.0], help="training seconds")
    p.add_argument("--curve_points", type=int, default=10, help="more evaluations, log-spaced from 1/64 of the top")
    p.add_argument("--gpt2", nargs="*", default=["2x64", "4x128", "4x256@1e-3"], metavar="LxE[xH][@LR]",
                   help="GPT-2 sizes (heads: width/32); `none`: no GPT-2")
    p.add_argument("--no_brillm", action="store_true", help="only the GPT-2 models")
    p.add_argument("--node_sizes", type=int, nargs="*", default=[], metavar="D", help="one BriLLM per node size")
    p.add_argument("--pretrain_flags", default="", help="more pretrain.py flags for every BriLLM row (one string)")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=FLAGS", help="one BriLLM row per variant, "
                   "with its own pretrain.py flags, e.g. full= \"rank4=--config_overrides edge_rank=4\"")
    p.add_argument("--gpt2_batch", type=int, help=f"GPT-2's batch (default --batch_size, else {GPT2_BATCH})")
    p.add_argument("--gpt2_lr", type=float, default=3e-3, help="GPT-2's peak rate without an @lr")
    p.add_argument("--gpt2_warmup", type=int, default=20, help="GPT-2's warmup steps")
    p.add_argument("--schedule", choices=list(SCHEDULERS), default="linear", help="every model's (pretrain.py's)")
    return shared_arguments(p, eval_batch_size=256, threads=2, seed=42, output_dir="outputs/quality").parse_args(argv)


def check_positive(args, names):
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")


def check_args(args):
    if any(not (b > 0 and math.isfinite(b)) for b in args.budgets) or len(set(args.budgets)) < len(args.budgets):
        raise UsageError(f"--budgets must be positive numbers of seconds, none repeated; got {args.budgets}.")
    check_positive(args, ("batch_size", "gpt2_batch", "eval_batch_size", "threads", "max_train_steps",
                          "max_eval_blocks"))
    if args.curve_points < 0 or any(d < 1 for d in args.node_sizes) or not args.gpt2_lr > 0 or args.gpt2_warmup < 0:
        raise UsageError("--curve_points and --gpt2_warmup must be >= 0, --node_sizes and --gpt2_lr positive.")
    names = [variant.partition("=")[0] for variant in args.variants]
    if any("=" not in v or not n for v, n in zip(args.variants, names)) or len(set(names)) < len(names) or \
            (names and args.node_sizes):
        raise UsageError("--variants takes NAME=FLAGS items with distinct names (FLAGS may be empty), without "
                         "--node_sizes (give a variant --node_size D instead).")
    if args.no_brillm and not args.gpt2:
        raise UsageError("nothing to train: --no_brillm and no --gpt2 size.")


def gpt2_batch(args) -> int:
    return args.gpt2_batch or args.batch_size or GPT2_BATCH


def curve_points(budgets, extra: int) -> list[float]:
    top = max(budgets)
    return sorted(set(budgets) | {top / 64 * 64 ** (i / extra) for i in range(extra)})


def data_argv(args, seed: int) -> list[str]:
    """pretrain.py's flags for the seed, the preset and the data, the same in quality.py and recipe_sweep.py."""
    argv = ["--seed", str(seed), "--text_column", args.text_column] + (["--config", args.config] if args.config else [])
    return argv + [x for flag in ("train_file", "validation_file", "tokenizer_name", "vocab_size", "block_size")
                   if getattr(args, flag) is not None for x in (f"--{flag}", str(getattr(args, flag)))]


def brillm_argv(args, points, name: str = "brillm", node_size=None) -> list[str]:
    """pretrain.py's flags for one BriLLM row, its folder `name` under --output_dir."""
    top = max(args.budgets)
    evals = [f"{p:.6g}" for p in points if p < top]
    argv = data_argv(args, args.seed)
    argv += ["--per_device_train_batch_size", str(args.batch_size)] if args.batch_size else []
    argv += ["--per_device_eval_batch_size", str(args.eval_batch_size)]
    argv += ["--max_eval_samples", str(args.max_eval_blocks)] if args.max_eval_blocks else []
    argv += ["--max_train_time", f"{top:g}"] + (["--eval_seconds", *evals] if evals else [])
    argv += ["--max_train_steps", str(args.max_train_steps)] if args.max_train_steps else []
    if args.schedule != "linear" or args.config:  # linear is pretrain.py's default; a preset may name another
        argv += ["--lr_scheduler_type", SCHEDULERS[args.schedule]]
    argv += ["--node_size", str(node_size)] if node_size else []
    return argv + shlex.split(args.pretrain_flags) + ["--torch_threads", str(args.threads), "--num_generations", "0",
                                                      "--output_dir", str(Path(args.output_dir) / name)]


def brillm_rows(args, points) -> list[tuple[list[str], str]]:
    """(pretrain.py's flags, label suffix) of every BriLLM row: one per --variants, else per --node_sizes, else one."""
    if args.variants:
        named = [variant.partition("=")[::2] for variant in args.variants]
        return [(brillm_argv(args, points, f"brillm-{name}") + shlex.split(flags), f" {name}") for name, flags in named]
    return [(brillm_argv(args, points, f"brillm-d{d}", d), "") for d in args.node_sizes] or \
        [(brillm_argv(args, points), "")]


def command_line(argv) -> str:
    return "python examples/pretrain.py " + shlex.join(argv)


def parse_pretrain(argv):
    try:
        return pretrain.parse_args(argv)
    except SystemExit:
        raise UsageError(f"the pretraining script refused the arguments {argv}.") from None


def shared_data(argv, folder=None):
    """(pretrain.py's data for these flags, prepared once for every row with its tokenizer in `folder` (default the
    row's own), their settled arguments, the one-process accelerator)."""
    from modeling_brillm.training.launch import make_accelerator

    if folder:
        argv = list(argv)
        argv[argv.index("--output_dir") + 1] = str(folder)
    pargs = parse_pretrain(argv)
    resolved = pretrain.settle(pargs)
    tok = resolved.section("tokenizer")
    pargs.vocab_size, pargs.tokenizer_kind, pargs.tokenizer_min_frequency = tok["vocab_size"], tok["kind"], \
        tok["min_frequency"]
    accelerator, _ = make_accelerator(pargs, shards_on_cpu=True)
    Path(pargs.output_dir).mkdir(parents=True, exist_ok=True)
    data = pretrain.load_data(pargs, resolved, accelerator, Path(pargs.output_dir), None)
    if data.eval is None:
        raise UsageError("no held-out text: give --validation_file, or more training texts (every 20th is held out).")
    return data, pargs, accelerator


def log_curve(folder: Path) -> list[dict]:
    """Every evaluation of a run's train_log.jsonl, with the mean training loss since the one before."""
    curve, losses = [], []
    for r in read_log(folder / LOG_NAME):
        if "loss" in r:
            losses.append(r["loss"])
        elif "eval_loss" in r:
            curve.append(dict(train_seconds=r["train_seconds"], steps=r["step"], train_tokens=r["train_tokens"],
                              train_loss=sum(losses) / len(losses) if losses else None, eval_nll=r["eval_loss"],
                              perplexity=r["perplexity"], eval_tokens=r["eval_tokens"]))
            losses = []
    return curve


def brillm_row(argv, data, label_suffix: str) -> dict:
    """One BriLLM row: pretrain.py's run() in this process on the shared data, its curve from train_log.jsonl."""
    import torch

    print(f"\nBriLLM{label_suffix}: {command_line(argv)}", flush=True)
    pargs, others, wall, cuda = parse_pretrain(argv), other_cpu_load(), time.perf_counter(), torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if pretrain.run(pargs, data=data) != 0:
        raise RuntimeError(f"the pretraining run failed: {command_line(argv)}")
    load, wall = others(), time.perf_counter() - wall
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None
    torch.cuda.empty_cache()  # the next row's model is as large again (nothing where CUDA never started)
    out = Path(pargs.output_dir)
    summary, config = (json.loads((out / name).read_text()) for name in (pretrain.SUMMARY_NAME, "config.json"))
    batch = next(s for s in json.loads((out / "recipe.json").read_text())["settings"]
                 if s["name"] == "per_device_train_batch_size")
    return dict(kind="brillm", label=f"BriLLM d={config['node_size']}{label_suffix}",
                parameters=summary["num_parameters"], pretrain_command=command_line(argv), pretrain_argv=argv,
                output_dir=str(out), batch_rule=batch["rule"], batch_why=batch["why"],
                planned_epochs=round(pargs.planned_epochs, 3), curve=log_curve(out), steps=summary["steps"],
                train_seconds=summary["train_seconds"], tokens_per_second=summary["tokens_per_second"],
                other_cpu_load=round(load, 3), wall_seconds=round(wall, 1), peak_gb=peak,
                **{k: getattr(pargs, v) for k, v in ROW_ARGS.items()}, **{k: config.get(k) for k in CONFIG_KEYS})


def harness_data(pretrain_data, first, accelerator, batch_size: int) -> dict:
    """The shared blocks as tensors, for the GPT-2 harness and the bigram reference, and what they are (`fields`)."""
    train, held = ((rows["input_ids"].long(), rows["attention_mask"].long()) for rows in
                   (blocks.with_format("torch")[:] for blocks in (pretrain_data.train, pretrain_data.eval)))
    if len(train[0]) < batch_size:
        raise UsageError(f"{len(train[0])} training blocks cannot fill one batch of {batch_size}; lower --batch_size "
                         "or give more text.")
    fields = dict(description=pretrain_data.description, vocab_size=len(pretrain_data.tokenizer),
                  block_size=int(train[0].shape[1]), train_blocks=len(train[0]), train_tokens=int(train[1].sum()),
                  heldout_blocks=len(held[0]), heldout_targets=int(target_mask(held[1]).sum()))
    return dict(tokenizer=pretrain_data.tokenizer, train=train, held=held, pargs=first, accelerator=accelerator,
                fields=fields)


def at_budget(curve, budget: float) -> dict:
    """The evaluation taken when the clock first passed `budget`; the last of a run that stopped before it."""
    return next((p for p in curve if p["train_seconds"] >= budget), curve[-1])


def run(args) -> dict:
    check_args(args)
    sizes, points = gpt2_sizes(args.gpt2, args.gpt2_lr), curve_points(args.budgets, args.curve_points)
    started = time.time()
    rows = brillm_rows(args, points)
    pretrain_data, first, accelerator = shared_data(rows[0][0], Path(args.output_dir) / "data")
    data = harness_data(pretrain_data, first, accelerator, gpt2_batch(args))
    fields = data["fields"]
    print(f"data: {fields['description']}; {fields['train_blocks']:,} training blocks, {fields['heldout_blocks']:,} "
          f"held out ({fields['heldout_targets']:,} targets), prepared in {time.time() - started:.1f}s\nmachine: "
          f"{machine()}, device {accelerator.device}; curve points {[round(p, 1) for p in points]}", flush=True)
    load_before = wait_for_quiet(max_wait_s=60) if args.wait_quiet else None
    out, models = Path(args.output_dir), []

    def keep(row):  # quality.json after every model: a run cut off by its time limit keeps the rows it finished
        models.append(row)
        write_json(out / "quality.json", dict(partial=True, models=models))

    for argv, suffix in [] if args.no_brillm else rows:
        keep(brillm_row(argv, pretrain_data, suffix))
    for size in sizes:
        keep(gpt2_row(size, data, points, args, gpt2_batch(args)))
    budgets = sorted(args.budgets)
    settings = dict(budgets=budgets, curve_points=points, gpt2_batch_size=gpt2_batch(args),
                    device=str(accelerator.device), order="one model after the other", machine=machine(),
                    other_cpu_load_before=load_before and round(load_before, 3),
                    started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
                    **{k: getattr(args, k) for k in ("batch_size", "threads", "seed", "config", "max_train_steps",
                                                     "gpt2_lr", "gpt2_warmup", "schedule")})
    results = dict(settings=settings, data=fields, models=models,
                   bigram_add_0_1_perplexity=round(bigram_reference(data), 3),
                   perplexity_at_budget={str(b): {m["label"]: round(at_budget(m["curve"], b)["perplexity"], 3)
                                                  for m in models} for b in budgets})
    write_json(out / "quality.json", results)
    plot(results, out / "quality.png")
    report(results)
    return results


def plot(results: dict, path: Path, title: str = "BriLLM vs GPT-2"):
    """Held-out perplexity against training seconds and tokens, every model, the bigram counts dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for model in results["models"]:
        curve = [p for p in model["curve"] if p["steps"] > 0]
        for ax, x in zip(axes, ("train_seconds", "train_tokens")):
            ax.plot([p[x] for p in curve], [p["perplexity"] for p in curve], marker="o", markersize=3,
                    linewidth=2.2 if model["kind"] == "brillm" else 1.4, label=model["label"])
    for ax, name in zip(axes, ("training seconds (evaluation excluded)", "training tokens")):
        if "bigram_add_0_1_perplexity" in results:
            ax.axhline(results["bigram_add_0_1_perplexity"], color="black", linewidth=0.8, linestyle="--",
                       label="bigram counts (add-0.1)")
        ax.set(xscale="log", yscale="log", xlabel=name, ylabel="held-out perplexity (token-weighted)")
        ax.grid(True, which="both", linewidth=0.3)
    axes[0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"{title}, the same tokenizer (V={results['data']['vocab_size']}) and blocks; {s['threads']} "
                 f"thread(s), {s['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_name(f".tmp-{path.name}"), format="png")
    plt.close(fig)
    os.replace(path.with_name(f".tmp-{path.name}"), path)


def report(results):
    budgets, at = results["settings"]["budgets"], results["perplexity_at_budget"]
    print("\nheld-out perplexity at each budget (token-weighted, the same targets):\n| model | parameters | batch | "
          + " | ".join(f"ppl @ {b:g} s" for b in budgets) + " | steps | tokens/s | other load |")
    for m in results["models"]:
        print(f"| {m['label']} | {m['parameters'] / 1e6:.2f}M | {m['batch_size']} | "
              + " | ".join(f"{at[str(b)][m['label']]:,.1f}" for b in budgets)
              + f" | {m['steps']:,} | {m['tokens_per_second']:,.0f} | {m['other_cpu_load']} |")
    print(f"bigram counts, add-0.1 (reference): held-out perplexity {results['bigram_add_0_1_perplexity']:.2f}")
    best = {m["kind"]: min((at[str(budgets[-1])][n["label"]], n["label"]) for n in results["models"]
                           if n["kind"] == m["kind"]) for m in results["models"]}
    if len(best) == 2:
        print(f"at {budgets[-1]:g} s the best BriLLM ({best['brillm'][1]}) is {best['brillm'][0] / best['gpt2'][0]:.2f}"
              f"x the best GPT-2's perplexity ({best['gpt2'][1]})")


def main(argv=None) -> int:
    def recorded(args) -> int:
        write_record("quality", args, run(args), argv=argv)
        return 0

    return run_cli(parse_args, recorded, argv)


if __name__ == "__main__":
    sys.exit(main())
