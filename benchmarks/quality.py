"""Quality against a Transformer: BriLLM and small GPT-2 models, the same data, the same training-time budget.

    python benchmarks/quality.py                                   # embedded corpus, budgets 30 90 180 s
    python benchmarks/quality.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 \
        --budgets 60 600 --gpt2 4x128 4x256@1e-3
    python benchmarks/quality.py --node_sizes 32 64 128 --gpt2 4x256@1e-3 6x384@1e-3 --gpt2_batch 1024 ...  # a GPU

Every BriLLM row IS an examples/pretrain.py run: `pretraining.run()` in this process on data prepared once, with
`--max_train_time` the largest budget and the curve points as `--eval_seconds`; its command line is printed and
stored (`pretrain_command`), and running it alone gives the same losses (up to the timing of the steps). Its folder
(`<output_dir>/brillm...`) holds what pretrain.py writes. `--node_sizes` trains one row per node size, `--more_brillm`
one per preset (its model and training sections, the first row's data).

The same for every model: pretrain.py's tokenizer, blocks and held-out blocks; its seeded batch order (GPT-2 draws the
same permutations); the pretraining code's TrainStep, training clock and schedule (after a warmup in steps, the rate
follows --schedule over the clock, to zero at the largest budget: a smaller budget's figure is taken on the way) and
evaluator (token-weighted held-out perplexity, the full softmax, the same targets); the torch threads. The clock
counts forward, backward and optimizer step, not evaluation. BriLLM's batch is pretrain.py's own (32 on a CPU, the
device-sized step on a GPU), GPT-2's `--gpt2_batch` (64), or --batch_size for every model. The models train one after
the other (run it on a quiet machine: the load others put on it is reported per model). GPT-2's recipe: gpt2.py.

Writes <output_dir>/quality.json (settings, data, each model's curve and settings, the table per budget),
<output_dir>/quality.png (held-out perplexity against training seconds and tokens) and the record. On the GPU when
there is one (CUDA_VISIBLE_DEVICES= for the CPU). Exit status 2 with a one-line message on bad input.
"""

from __future__ import annotations

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

from common import CpuMonitor, add_results_dir, machine, wait_for_quiet, write_record  # noqa: E402
from gpt2 import SCHEDULERS, BatchOrder, bigram_reference, heldout_nll, labels_of, make_gpt2, target_mask  # noqa: E402,F401
from gpt2 import row as gpt2_row  # noqa: E402
from gpt2 import sizes as gpt2_sizes  # noqa: E402

from modeling_brillm.training import pretraining as pretrain  # noqa: E402
from modeling_brillm.training.checkpoints import LOG_NAME, read_log  # noqa: E402
from modeling_brillm.training.epochs import TrainingClock, make_schedule  # noqa: E402,F401  (the one clock)
from modeling_brillm.training.errors import UsageError  # noqa: E402

GPT2_BATCH = 64  # GPT-2's blocks per step unless --gpt2_batch or --batch_size says otherwise
DEFAULT_GPT2 = ["2x64", "4x128", "4x256@1e-3"]
CONFIG_KEYS = ("node_size", "num_edges", "signal_dropout", "non_edge_bias", "node_readout", "edge_backoff",
               "node_embedding", "count_prior", "position_recency")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[30.0, 90.0, 180.0],
                   help="Training budgets in seconds; one run per model up to the largest.")
    p.add_argument("--curve_points", type=int, default=10, help="More evaluations, log-spaced from 1/64 of the "
                   "largest budget.")
    p.add_argument("--gpt2", nargs="*", default=DEFAULT_GPT2, metavar="LxE[xH][@LR]",
                   help="GPT-2 sizes (heads default width/32); `--gpt2 none` trains none.")
    p.add_argument("--no_brillm", action="store_true", help="Train only the GPT-2 models.")
    p.add_argument("--config", help="BriLLM's preset (default none: pretrain.py's built-in defaults).")
    p.add_argument("--more_brillm", nargs="*", default=[], metavar="PRESET",
                   help="More BriLLM recipes on the same data.")
    p.add_argument("--node_sizes", type=int, nargs="*", default=[], metavar="D",
                   help="One BriLLM row per node size (pretrain.py --node_size), the defaults otherwise.")
    p.add_argument("--pretrain_flags", default="", help="More pretrain.py flags for every BriLLM row (one string).")
    p.add_argument("--train_file", help="Training text (.txt, .json/.jsonl, .csv); default: the embedded corpus.")
    p.add_argument("--validation_file", help="Held-out text (default: every 20th training text).")
    p.add_argument("--text_column", default="text")
    p.add_argument("--tokenizer_name", help="A saved tokenizer folder (default: pretrain.py trains one).")
    p.add_argument("--vocab_size", type=int, help="BPE vocabulary to train (default: the preset's).")
    p.add_argument("--block_size", type=int, help="Tokens per block (default: the preset's).")
    p.add_argument("--batch_size", type=int, help="Blocks per step for every model (default: each model's own).")
    p.add_argument("--gpt2_batch", type=int, help=f"GPT-2's blocks per step (default --batch_size, else {GPT2_BATCH}).")
    p.add_argument("--eval_batch_size", type=int, default=256, help="Blocks per evaluation forward pass.")
    p.add_argument("--max_eval_blocks", type=int, help="Score at most this many held-out blocks.")
    p.add_argument("--gpt2_lr", type=float, default=3e-3, help="GPT-2's peak learning rate without an @lr.")
    p.add_argument("--gpt2_warmup", type=int, default=20, help="GPT-2's linear warmup steps.")
    p.add_argument("--schedule", choices=list(SCHEDULERS), default="linear",
                   help="The rate after the warmup over the training clock, every model (linear: pretrain.py's).")
    p.add_argument("--max_train_steps", type=int, help="Stop every model after this many steps.")
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same for every model.")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default="outputs/quality")
    p.add_argument("--no-wait-quiet", "--no_wait_quiet", dest="wait_quiet", action="store_false",
                   help="Do not wait (up to a minute) for other processes to leave the CPUs.")
    return add_results_dir(p).parse_args(argv)


def check_args(args):
    if any(not (b > 0 and math.isfinite(b)) for b in args.budgets):
        raise UsageError(f"--budgets must be positive numbers of seconds, got {args.budgets}.")
    if len(set(args.budgets)) != len(args.budgets):
        raise UsageError(f"--budgets has repeated values: {args.budgets}.")
    for name in ("batch_size", "gpt2_batch", "eval_batch_size", "threads", "max_train_steps", "max_eval_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.curve_points < 0 or any(d < 1 for d in args.node_sizes):
        raise UsageError("--curve_points must be >= 0 and --node_sizes positive.")
    if not args.gpt2_lr > 0 or args.gpt2_warmup < 0:
        raise UsageError("--gpt2_lr must be positive and --gpt2_warmup >= 0.")
    if args.no_brillm and not args.gpt2:
        raise UsageError("nothing to train: --no_brillm and no --gpt2 size.")


def gpt2_batch(args) -> int:
    return args.gpt2_batch or args.batch_size or GPT2_BATCH


def curve_points(budgets, extra: int) -> list[float]:
    top = max(budgets)
    return sorted(set(budgets) | {top / 64 * 64 ** (i / extra) for i in range(extra)})


def brillm_argv(args, preset, points, first=None, name=None, schedule=None, node_size=None) -> list[str]:
    """pretrain.py's flags for one BriLLM row. `first`: the first row's settled arguments, whose data settings a
    --more_brillm row keeps; `name`: its folder under --output_dir; `schedule`: another than --schedule."""
    argv = ["--seed", str(args.seed), "--text_column", args.text_column] + (["--config", preset] if preset else [])
    for flag in ("train_file", "validation_file", "tokenizer_name"):
        argv += [f"--{flag}", str(getattr(args, flag))] if getattr(args, flag, None) else []
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
    argv += ["--node_size", str(node_size)] if node_size else []
    argv += shlex.split(getattr(args, "pretrain_flags", ""))
    name = name or ("brillm" if first is None else f"brillm-{Path(preset).stem}")
    return argv + ["--torch_threads", str(args.threads), "--num_generations", "0",
                   "--output_dir", str(Path(args.output_dir) / name)]


def command_line(argv) -> str:
    return "python examples/pretrain.py " + " ".join(shlex.quote(a) for a in argv)


def parse_pretrain(argv):
    try:
        return pretrain.parse_args(argv)
    except SystemExit:
        raise UsageError(f"the pretraining script refused the arguments {argv}.") from None


def shared_data(argv, folder=None):
    """pretrain.py's data for the first row's flags, prepared once for every row (its tokenizer saved in `folder`, by
    default the row's own); the first row's settled arguments (what a --more_brillm row is told, so that it prepares
    the same data); the one-process accelerator."""
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
    out = Path(pargs.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = pretrain.load_data(pargs, resolved, accelerator, out, None)
    if data.eval is None:
        raise UsageError("no held-out text: give --validation_file, or more training texts (every 20th is held out).")
    return data, pargs, accelerator


def log_curve(folder: Path) -> list[dict]:
    """Every evaluation of a run's train_log.jsonl, with the mean training loss of the steps since the one before."""
    curve, losses = [], []
    for record in read_log(folder / LOG_NAME):
        if "loss" in record:
            losses.append(record["loss"])
        elif "eval_loss" in record:
            curve.append(dict(train_seconds=record["train_seconds"], steps=record["step"],
                              train_tokens=record["train_tokens"], train_loss=sum(losses) / len(losses) if losses
                              else None, eval_nll=record["eval_loss"], perplexity=record["perplexity"],
                              eval_tokens=record["eval_tokens"]))
            losses = []
    return curve


def brillm_row(argv, data, label_suffix: str) -> dict:
    """One BriLLM row: pretrain.py's run() in this process on the shared data, its curve from train_log.jsonl."""
    import torch

    print(f"\nBriLLM{label_suffix}: {command_line(argv)}", flush=True)
    pargs = parse_pretrain(argv)
    monitor, wall = CpuMonitor(), time.perf_counter()
    monitor.start()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if pretrain.run(pargs, data=data) != 0:
        raise RuntimeError(f"the pretraining run failed: {command_line(argv)}")
    load, wall = monitor.stop(), time.perf_counter() - wall
    peak = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next row's model is as large again
    out = Path(pargs.output_dir)
    summary = json.loads((out / pretrain.SUMMARY_NAME).read_text(encoding="utf-8"))
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    batch = next(s for s in json.loads((out / "recipe.json").read_text())["settings"]
                 if s["name"] == "per_device_train_batch_size")
    return dict(kind="brillm", label=f"BriLLM d={config['node_size']}{label_suffix}",
                parameters=summary["num_parameters"], preset=pargs.config, pretrain_command=command_line(argv),
                pretrain_argv=argv, output_dir=str(out), batch_size=pargs.per_device_train_batch_size,
                batch_rule=batch["rule"], batch_why=batch["why"], optimizer=pargs.optimizer, lr=pargs.learning_rate,
                weight_decay=pargs.weight_decay, warmup_steps=pargs.num_warmup_steps,
                lazy_weight_decay=pargs.lazy_weight_decay, shared_edge_lr_scale=pargs.shared_edge_lr_scale,
                node_lr_scale=pargs.node_lr_scale, min_bigram_count=pargs.min_bigram_count,
                planned_epochs=round(pargs.planned_epochs, 3), schedule=pargs.lr_scheduler_type,
                signal_dropout_warmup_epochs=pargs.signal_dropout_warmup_epochs, grad_clip=pargs.max_grad_norm,
                curve=log_curve(out), steps=summary["steps"], train_seconds=summary["train_seconds"],
                tokens_per_second=summary["tokens_per_second"], other_cpu_load=round(load, 3),
                wall_seconds=round(wall, 1),
                peak_gb=peak and round(peak, 2),
                **{k: config[k] for k in CONFIG_KEYS})


def tensors(blocks):
    rows = blocks.with_format("torch")[:]
    return rows["input_ids"].long(), rows["attention_mask"].long()


def harness_data(pretrain_data, first, accelerator, batch_size: int) -> dict:
    """The shared blocks as tensors, for the GPT-2 harness and the bigram reference."""
    data = dict(tokenizer=pretrain_data.tokenizer, train=tensors(pretrain_data.train),
                held=tensors(pretrain_data.eval), pargs=first, accelerator=accelerator)
    if len(data["train"][0]) < batch_size:
        raise UsageError(f"{len(data['train'][0])} training blocks cannot fill one batch of {batch_size}; lower "
                         "--batch_size or give more text.")
    return data


def at_budget(curve, budget: float) -> dict:
    """The evaluation taken when the clock first passed `budget`; the last of a run that stopped before it."""
    return next((p for p in curve if p["train_seconds"] >= budget), curve[-1])


def brillm_rows(args, argv0, first, points) -> list[tuple[list[str], str]]:
    """(pretrain.py flags, label suffix) of every BriLLM row."""
    if args.no_brillm:
        return []
    if args.node_sizes:
        return [(brillm_argv(args, args.config, points, name=f"brillm-d{d}", node_size=d), "") for d in args.node_sizes]
    rows = [(argv0, "")]
    rows += [(brillm_argv(args, preset, points, first), f" ({Path(preset).stem})") for preset in args.more_brillm]
    if args.more_brillm:
        rows[0] = (argv0, f" ({Path(args.config).stem if args.config else 'defaults'})")
    return rows


def run(args) -> dict:
    check_args(args)
    sizes = gpt2_sizes(args.gpt2, args.gpt2_lr)
    points = curve_points(args.budgets, args.curve_points)
    started = time.time()
    d0 = (args.node_sizes or [None])[0]
    argv0 = brillm_argv(args, args.config, points, name=d0 and f"brillm-d{d0}", node_size=d0)
    pretrain_data, first, accelerator = shared_data(argv0, Path(args.output_dir) / "data")
    data = harness_data(pretrain_data, first, accelerator, gpt2_batch(args))
    held_targets = int(target_mask(data["held"][1]).sum())
    print(f"data: {pretrain_data.description}; {len(data['tokenizer'])} tokens; {len(data['train'][0]):,} training "
          f"blocks, {len(data['held'][0]):,} held out ({held_targets:,} targets); prepared in "
          f"{time.time() - started:.1f}s\nmachine: {machine()}, device {accelerator.device}; curve points "
          f"{[round(p, 1) for p in points]}", flush=True)
    load_before = wait_for_quiet(max_wait_s=60) if args.wait_quiet else None
    out, models = Path(args.output_dir), []
    for argv, suffix in brillm_rows(args, argv0, first, points):
        models.append(brillm_row(argv, pretrain_data, suffix))
        write_json_atomic(out / "quality.json", dict(partial=True, models=models))  # a cut-off run keeps its rows
    for size in sizes:
        models.append(gpt2_row(size, data, points, args, gpt2_batch(args)))
        write_json_atomic(out / "quality.json", dict(partial=True, models=models))
    budgets = sorted(args.budgets)
    results = dict(
        settings=dict(budgets=budgets, curve_points=points, batch_size=args.batch_size,
                      gpt2_batch_size=gpt2_batch(args),
                      threads=args.threads, device=str(accelerator.device), seed=args.seed, config=args.config,
                      max_train_steps=args.max_train_steps, gpt2_lr=args.gpt2_lr, gpt2_warmup=args.gpt2_warmup,
                      schedule=args.schedule, order="one model after the other", machine=machine(),
                      other_cpu_load_before=None if load_before is None else round(load_before, 3),
                      started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))),
        data=dict(description=pretrain_data.description, vocab_size=len(data["tokenizer"]),
                  block_size=int(data["train"][0].shape[1]), train_blocks=len(data["train"][0]),
                  train_tokens=int(data["train"][1].sum()), heldout_blocks=len(data["held"][0]),
                  heldout_targets=held_targets),
        models=models, bigram_add_0_1_perplexity=round(bigram_reference(data), 3),
        perplexity_at_budget={str(b): {m["label"]: round(at_budget(m["curve"], b)["perplexity"], 3) for m in models}
                              for b in budgets})
    write_json_atomic(out / "quality.json", results)
    plot(results, out / "quality.png")
    report(results)
    return results


def write_json_atomic(path: Path, obj):
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=1)
    os.replace(tmp, path)


def plot(results: dict, path: Path, title: str = "BriLLM vs GPT-2"):
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
    for budget in results["settings"].get("budgets", []):
        axes[0].axvline(budget, color="grey", linewidth=0.6, linestyle=":")
    axes[0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"{title}, the same tokenizer (V={results['data']['vocab_size']}) and blocks; {s['threads']} "
                 f"thread(s), {s['device']}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def markdown_table(results: dict) -> str:
    budgets = results["settings"]["budgets"]
    head = ("| model | parameters | batch | " + " | ".join(f"ppl @ {b:g} s" for b in budgets)
            + " | steps | tokens/s | train tokens | other load |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in results["models"]:
        cells = " | ".join(f"{results['perplexity_at_budget'][str(b)][m['label']]:,.1f}" for b in budgets)
        lines.append(f"| {m['label']} | {m['parameters'] / 1e6:.2f}M | {m['batch_size']} | {cells} | {m['steps']:,} | "
                     f"{m['tokens_per_second']:,.0f} | {m['curve'][-1]['train_tokens']:,} | {m['other_cpu_load']} |")
    return "\n".join(lines)


def report(results):
    print("\nheld-out perplexity at each budget (token-weighted, the same targets):")
    print(markdown_table(results))
    print(f"bigram counts, add-0.1 (reference): held-out perplexity {results['bigram_add_0_1_perplexity']:.2f}")
    for m in results["models"]:
        if m["kind"] == "brillm":
            print(f"{m['label']} is: {m['pretrain_command']}")
    top = str(results["settings"]["budgets"][-1])
    best = {kind: min((results["perplexity_at_budget"][top][m["label"]], m["label"]) for m in results["models"]
                      if m["kind"] == kind) for kind in ("brillm", "gpt2")
            if any(m["kind"] == kind for m in results["models"])}
    if len(best) == 2:
        ratio = best["brillm"][0] / best["gpt2"][0]
        print(f"at {float(top):g} s the best BriLLM ({best['brillm'][1]}) is {ratio:.2f}x the best GPT-2's "
              f"perplexity ({best['gpt2'][1]})")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    write_record("quality", args, results, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
