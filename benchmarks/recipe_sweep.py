"""Recipe sweep: BriLLM training recipes side by side on one corpus at one wall-clock budget (quality.py's rules).

    python benchmarks/recipe_sweep.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 --budget 90 \
        --variant base= wd=lazy_wd:1,wd:0.1 drop=dropout:0.1 --gpt2 4x256@1e-3

Every variant is one BriLLM training run; the runs (and any --gpt2 references) take turns of --interleave training
seconds, so a shared machine's load falls on all alike, on the same data, tokenizer, blocks, batch order and held-out
targets as benchmarks/quality.py (whose data preparation, training step and clock this script reuses). A variant is
NAME=key:value,key:value over examples/pretrain.py's built-in recipe, or --config's (lr auto: 1e-2 where the signal
drops, else 2e-2; weight decay 0.1, 10 warmup steps, clip 1.0, non-edge bias, node readout, position recency
0.2, node rate 2x, shared-edge rate 0.5x, min_count auto, a matrix every edge shares, the nodes' own vectors in the
signal):

    lr        peak learning rate                       wd        weight decay on edge matrices
    lazy_wd   1: SparseAdamW's lazy decay of every row  warmup    linear warmup steps
    schedule  constant | cosine (over --horizon s of training clock, to min_lr x the peak)
    min_lr    floor of the cosine, a fraction of the peak (default 0.1)
    shared_lr learning-rate multiplier of the shared edge (row 0)
    node_lr   learning-rate multiplier of node_bias / non_edge_bias
    clip      gradient-norm clip (0: off)               d         node_size
    min_count graph pruning: real edges for bigrams seen at least this often (auto: the count chosen from the data
              and the budget for the base recipe, as quality.py chooses it)
    dropout   config.signal_dropout (default: the base recipe's, chosen from the data and the budget as quality.py
              chooses it)
    dropout_warmup  epochs over which the dropout grows from 0 (0: all of it from the first step; default:
              pretrain.py's, 1)
    non_edge  1: config.non_edge_bias
    readout   1: config.node_readout                    recency   config.position_recency
    backoff   1: config.edge_backoff (0: every edge its own matrix only)
    embed     1: config.node_embedding (every node adds its own vector to the signal it passes on)

At every curve point the held-out NLL is also split by target: bigrams u->v that are real edges of the variant's
graph ("seen") and those that are not ("unseen": every non-successor of u gets the shared energy). Writes
<output_dir>/recipe_sweep.json, recipe_sweep.md (the table) and recipe_sweep.png (held-out perplexity and training
loss against training seconds).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quality  # noqa: E402  (benchmarks/quality.py: data, step, clock, GPT-2 references)

UsageError = quality.UsageError
def count_or_auto(value: str):
    return value if value == "auto" else int(value)


KEYS = {"lr": float, "wd": float, "lazy_wd": int, "warmup": int, "schedule": str, "min_lr": float, "shared_lr": float,
        "node_lr": float, "clip": float, "d": int, "min_count": count_or_auto, "dropout": float,
        "dropout_warmup": float, "non_edge": int,
        "readout": int, "recency": float, "backoff": int,
        "embed": int}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variant", nargs="+", default=["base="], metavar="NAME=key:value,...",
                   help="Recipes to compare (keys in the module docstring); NAME= alone is the preset's recipe.")
    p.add_argument("--budget", type=float, default=90.0, help="Training seconds per variant (evaluation excluded).")
    p.add_argument("--horizon", type=float, default=None, help="Seconds of the cosine schedule (default: --budget).")
    p.add_argument("--curve_points", type=int, default=6, help="Evaluations, log-spaced up to the budget.")
    p.add_argument("--gpt2", nargs="*", default=[], metavar="LxE[xH][@LR]", help="GPT-2 references (quality.py's).")
    p.add_argument("--gpt2_lr", type=float, default=3e-3)
    p.add_argument("--gpt2_warmup", type=int, default=20)
    p.add_argument("--gpt2_schedule", choices=["constant", "cosine"], default="constant",
                   help="GPT-2's schedule after warmup (cosine over --budget seconds, to --min_lr_ratio).")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="End of GPT-2's cosine.")
    p.add_argument("--config", default=None, help="A preset (default: pretrain.py's built-in defaults).")
    p.add_argument("--train_file")
    p.add_argument("--validation_file")
    p.add_argument("--text_column", default="text")
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--block_size", type=int)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--max_eval_blocks", type=int, default=None)
    p.add_argument("--interleave", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default="outputs/recipe_sweep")
    from common import add_results_dir

    return add_results_dir(p).parse_args(argv)


def parse_variant(spec: str) -> tuple[str, dict]:
    name, sep, body = spec.partition("=")
    if not sep or not name:
        raise UsageError(f"--variant {spec!r}: write NAME=key:value,key:value (or NAME= for the preset's recipe).")
    settings = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition(":")
        if not sep or key not in KEYS:
            raise UsageError(f"--variant {spec!r}: {item!r} is not key:value with a key of {sorted(KEYS)}.")
        try:
            settings[key] = KEYS[key](value)
        except ValueError:
            raise UsageError(f"--variant {spec!r}: {key} needs a {KEYS[key].__name__}, got {value!r}.") from None
    if settings.get("schedule", "constant") not in ("constant", "cosine"):
        raise UsageError(f"--variant {spec!r}: schedule is constant or cosine.")
    return name, settings


def make_variant(name, settings, data, args, accelerator, device):
    import torch

    from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
    from modeling_brillm.training.optimizers import build_optimizer, choose_optimizer
    from modeling_brillm.training.presets import build_config_and_graph

    pargs = data["pargs"]
    base = data["config"].to_dict()
    fields = {k: base[k] for k in ("vocab_size", "max_position_embeddings", "position_encoding", "initializer_range",
                                   "loss_type", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    fields.update(node_size=settings.get("d", base["node_size"]),
                  signal_dropout=settings.get("dropout", base["signal_dropout"]),
                  non_edge_bias=bool(settings.get("non_edge", base["non_edge_bias"])),
                  node_readout=bool(settings.get("readout", base["node_readout"])),
                  position_recency=settings.get("recency", base["position_recency"]),
                  edge_backoff=bool(settings.get("backoff", base["edge_backoff"])),
                  node_embedding=bool(settings.get("embed", base.get("node_embedding", False))))
    min_count = settings.get("min_count", pargs.min_bigram_count)
    count = getattr(data["min_count"], "min_count", "auto") if min_count == "auto" else min_count  # the base's
    _, graph, _ = build_config_and_graph(dict(graph="sparse", node_size=fields["node_size"]), data["tokenizer"],
                                         data["train_blocks"], count)
    min_count = f"auto ({count})" if min_count == "auto" else min_count
    config = BriLLMConfig(graph="sparse", num_edges=graph.num_edges, **fields)
    torch.manual_seed(args.seed)
    model = BriLLMForCausalLM.from_graph(graph, config=config).to(device)
    lr, wd = settings.get("lr", quality.brillm_rate(pargs, config)), settings.get("wd", pargs.weight_decay)
    clip = settings.get("clip", pargs.max_grad_norm)
    plan = choose_optimizer("sparse_adamw", 1, clip)
    lazy = bool(settings.get("lazy_wd", pargs.lazy_weight_decay))
    optimizer = build_optimizer(model, plan, lr, wd, accelerator, lazy_weight_decay=lazy,
                                shared_edge_lr_scale=settings.get("shared_lr", pargs.shared_edge_lr_scale),
                                node_lr_scale=settings.get("node_lr", pargs.node_lr_scale))
    clock = quality.TrainingClock()
    warmup = settings.get("warmup", pargs.num_warmup_steps)
    scheduler = quality.clock_schedule(optimizer, warmup, settings.get("schedule", "constant"),
                                       args.horizon or args.budget, settings.get("min_lr", 0.1), clock)
    step = quality.package_step(accelerator, model, optimizer, scheduler, args, pargs.block_size, clip or None)
    dropout_warmup = settings.get("dropout_warmup", pargs.signal_dropout_warmup_epochs)
    step = quality.warm_dropout(step, model, len(data["train"][0]) // args.batch_size, dropout_warmup)
    recipe = dict(lr=lr, weight_decay=wd, lazy_weight_decay=bool(settings.get("lazy_wd", pargs.lazy_weight_decay)),
                  warmup=warmup,
                  schedule=settings.get("schedule", "constant"), clip=clip, min_bigram_count=min_count,
                  node_size=config.node_size, signal_dropout=config.signal_dropout,
                  signal_dropout_warmup_epochs=dropout_warmup, non_edge_bias=config.non_edge_bias,
                  node_readout=config.node_readout, edge_backoff=config.edge_backoff,
                  node_embedding=config.node_embedding, position_recency=config.position_recency,
                  shared_edge_lr_scale=settings.get("shared_lr", pargs.shared_edge_lr_scale),
                  node_lr_scale=settings.get("node_lr", pargs.node_lr_scale))
    if recipe["schedule"] == "cosine":
        recipe.update(min_lr=settings.get("min_lr", 0.1), horizon_seconds=args.horizon or args.budget)
    return model, optimizer, step, clock, recipe


def split_nll(model, held, batch_size: int, device) -> dict:
    """Held-out NLL of BriLLM split by target: real edge u->v (seen) or not (unseen), with the full softmax."""
    import torch
    import torch.nn.functional as F

    ids_all, mask_all = held
    sums = {"seen": [0.0, 0], "unseen": [0.0, 0]}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids_all), batch_size):
            ids, mask = ids_all[start:start + batch_size].to(device), mask_all[start:start + batch_size].to(device)
            keep = quality.target_mask(mask)
            if not bool(keep.any()):
                continue
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            nll = -F.log_softmax(logits.float(), -1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            real = model.edge_rows(ids[:, :-1], ids[:, 1:]) > 0
            for key, sel in (("seen", keep & real), ("unseen", keep & ~real)):
                sums[key][0] += float(nll[sel].double().sum())
                sums[key][1] += int(sel.sum())
    model.train()
    total = sums["seen"][1] + sums["unseen"][1]
    out = {f"{k}_targets": n for k, (_, n) in sums.items()}
    out.update({f"{k}_nll": (s / n if n else None) for k, (s, n) in sums.items()})
    out["unseen_share_of_targets"] = sums["unseen"][1] / max(total, 1)
    out["unseen_share_of_nll"] = sums["unseen"][0] / max(sums["seen"][0] + sums["unseen"][0], 1e-12)
    return out


class SweepRun(quality.BudgetRun):
    """quality.BudgetRun (clock-driven schedule, lazy weight decay brought up to date before every evaluation) that
    also splits BriLLM's held-out NLL into seen / unseen bigrams at the later curve points."""

    def __init__(self, *a, brillm=True, **kw):
        self.brillm = brillm
        super().__init__(*a, **kw)

    def evaluate(self):
        point = super().evaluate()
        if self.brillm and self.clock >= 0.3 * self.args.budget:  # the split costs a second pass: later points only
            point.update(split_nll(self.model, self.data["held"], self.args.eval_batch_size, self.device))
        return point


def markdown(results) -> str:
    head = ("| variant | recipe | ppl @ budget | best ppl (at s) | train loss | held-out NLL seen / unseen | "
            "unseen targets | share of NLL from unseen | steps | tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in results["models"]:
        last = quality.at_budget(m["curve"], results["settings"]["budget"])
        best = min(m["curve"][1:] or m["curve"], key=lambda p: p["perplexity"])
        split = (f"{last['seen_nll']:.2f} / {last['unseen_nll']:.2f}" if last.get("seen_nll") is not None
                 and last.get("unseen_nll") is not None else "")
        share = f"{last['unseen_share_of_targets']:.1%}" if "unseen_share_of_targets" in last else ""
        nll_share = f"{last['unseen_share_of_nll']:.1%}" if "unseen_share_of_nll" in last else ""
        loss = f"{last['train_loss']:.3f}" if last.get("train_loss") is not None else ""
        lines.append(f"| {m['label']} | {m['recipe_text']} | **{last['perplexity']:.2f}** | {best['perplexity']:.2f} "
                     f"({best['train_seconds']:.0f}) | {loss} | {split} | {share} | {nll_share} | {m['steps']:,} | "
                     f"{m['tokens_per_second']:,.0f} |")
    return "\n".join(lines)


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=80)
    for m in results["models"]:
        curve = [p for p in m["curve"] if p["steps"] > 0]
        style = dict(marker="o", markersize=3, linewidth=2.0 if m["kind"] == "brillm" else 1.2,
                     linestyle="-" if m["kind"] == "brillm" else "--")
        line, = axes[0].plot([p["train_seconds"] for p in curve], [p["perplexity"] for p in curve], label=m["label"],
                             **style)
        losses = [(p["train_seconds"], math.exp(p["train_loss"])) for p in curve if p.get("train_loss") is not None]
        if losses:
            axes[1].plot(*zip(*losses), color=line.get_color(), **style)
    for ax, title in zip(axes, ("held-out perplexity",
                                "training perplexity (exp of the mean loss since the last point)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", linewidth=0.3)
    axes[0].legend(fontsize=7)
    s = results["settings"]
    fig.suptitle(f"BriLLM recipes, {s['budget']:g} s each, batch {s['batch_size']}, {s['threads']} thread(s); "
                 f"{results['data']['description'][:70]}", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


def run(args) -> dict:
    import torch
    from common import machine, wait_for_quiet

    from modeling_brillm.training.memory import keep_freed_memory

    variants = [parse_variant(v) for v in args.variant]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise UsageError(f"--variant names must differ: {names}.")
    if not args.budget > 0:
        raise UsageError("--budget must be positive.")
    sizes = quality.gpt2_sizes(args.gpt2, args.gpt2_lr)
    args.budgets, args.schedule = [args.budget], args.gpt2_schedule  # what quality.gpt2_trainer reads
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    keep_freed_memory()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    accelerator = quality.make_accelerator(device)
    data = quality.prepare_data(args, out, accelerator)
    points = quality.curve_points([args.budget], args.curve_points)
    print(f"data: {data['description']}; {len(data['train'][0]):,} training blocks, {len(data['held'][0]):,} held out")
    for line in data["choices"]:
        print(f"base recipe: {line}")
    runs, models = [], []
    for name, settings in variants:
        model, optimizer, step, clock, recipe = make_variant(name, settings, data, args, accelerator, device)
        text = ", ".join(f"{k}:{v}" for k, v in settings.items()) or "preset"
        print(f"{name}: {text}; {model.config.num_edges:,} edges, {quality.count_parameters(model):,} parameters")
        models.append(dict(kind="brillm", label=name, recipe=recipe, recipe_text=text,
                           parameters=quality.count_parameters(model), edges=model.config.num_edges))
        runs.append(SweepRun(name, model, step, data, points, args, device, clock=clock, optimizer=optimizer))
    for size in sizes:
        model = quality.make_gpt2(data, size, args.seed).to(device)
        step, info, clock = quality.gpt2_trainer(model, size[3], args.gpt2_warmup, data, args, accelerator, device)
        label = f"GPT-2 {size[0]}L {size[1]}w"
        models.append(dict(kind="gpt2", label=label, recipe=info, recipe_text=f"AdamW lr {size[3]:g}",
                           parameters=quality.count_parameters(model)))
        runs.append(SweepRun(label, model, step, data, points, args, device, brillm=False, clock=clock))
    load_before = wait_for_quiet(max_wait_s=30)
    quality.run_all(runs, args.interleave)
    for model, r in zip(models, runs):
        model.update(r.result())
    results = dict(settings=dict(budget=args.budget, horizon=args.horizon or args.budget, batch_size=args.batch_size,
                                 threads=args.threads, interleave=args.interleave, seed=args.seed, config=args.config,
                                 other_cpu_load_before=round(load_before, 3), machine=machine(),
                                 started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))),
                   data=dict(description=data["description"], vocab_size=len(data["tokenizer"]),
                             block_size=int(data["train"][0].shape[1]), train_blocks=len(data["train"][0]),
                             train_tokens=int(data["train"][1].sum()), heldout_blocks=len(data["held"][0])),
                   models=models)
    quality.write_json_atomic(out / "recipe_sweep.json", results)
    table = markdown(results)
    (out / "recipe_sweep.md").write_text(table + "\n", encoding="utf-8")
    plot(results, out / "recipe_sweep.png")
    print("\n" + table)
    print(f"other load per run: {[m['other_cpu_load'] for m in models]}; wrote {out}/recipe_sweep.{{json,md,png}}")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    from common import write_record

    write_record("recipe_sweep", args, results, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
