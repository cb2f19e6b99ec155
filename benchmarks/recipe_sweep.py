"""Recipe sweep: BriLLM recipes side by side on one corpus under quality.py's rules, at one training-time budget or
at fixed steps (an ablation of the recipe's rules against the seed noise).

    python benchmarks/recipe_sweep.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 --seed 1 \
        --max_train_steps 900 --eval_steps 300 --noise 0.015 --variant base= prior=prior:0 wd=wd:0

Every variant IS an examples/pretrain.py run, as a quality.py BriLLM row is (its command printed and stored as
`pretrain_command`, its folder <output_dir>/<NAME>); --gpt2 adds references in gpt2.py's harness. A variant is
NAME=key:value,... over pretrain.py's built-in recipe or --config's (NAME= alone: the recipe); the keys (KEYS below)
are pretrain.py flags (a 0/1 key turns a flag on or off; `schedule` is constant, cosine or linear), and at fixed steps
also the probe's numbers (recipe.py): `recurrence`, `probe_runs` (`blocks`: every block a run), `probe_every`; the
count and the dropout the probe then chooses are passed as numbers, so the printed command reproduces the run.

Fixed steps (`--eval_steps` with `--max_train_steps`): every variant trains exactly that many steps with
benchmarks/seed_noise.py's flags (with the same --seed, the base variant IS a seed-noise run), and its final perplexity
is compared with the base's (the variant named base, else the first, or --base_perplexity): the change in % and in
units of --noise, past twice which it counts. Variants with the same flags train once (`same_run_as`). A variant keeps
its last model, and its final held-out NLL is split into targets that are real edges of its graph and those that are
not. Writes <output_dir>/recipe_sweep.{json,md,png} and the record; exit status 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quality  # noqa: E402  (benchmarks/quality.py: pretrain.py rows, the GPT-2 harness)

UsageError = quality.UsageError
SWITCH = "0/1"  # a key whose value turns a pretrain.py --flag / --no-flag on or off
KEYS = {"lr": ("--learning_rate", float), "wd": ("--weight_decay", float),
        "lazy_wd": ("--lazy_weight_decay", SWITCH), "warmup": ("--num_warmup_steps", int),
        "schedule": (None, ("constant", "cosine", "linear")), "shared_lr": ("--shared_edge_lr_scale", float),
        "node_lr": ("--node_lr_scale", float), "clip": ("--max_grad_norm", float), "d": ("--node_size", int),
        "min_count": ("--min_bigram_count", "auto"), "dropout": ("--signal_dropout", "auto"),
        "dropout_warmup": ("--signal_dropout_warmup_epochs", float), "non_edge": ("--non_edge_bias", SWITCH),
        "readout": ("--node_readout", SWITCH), "recency": ("--position_recency", float),
        "backoff": ("--edge_backoff", SWITCH), "embed": ("--node_embedding", SWITCH),
        "prior": ("--count_prior", SWITCH),
        "recurrence": (None, float), "probe_runs": (None, "blocks"), "probe_every": (None, int)}
PROBE = {"recurrence": "recurrence", "probe_runs": "runs", "probe_every": "probe_every"}  # key -> probe_bigrams'

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
BAR = 2.0  # a change counts where it passes this many times the seed-to-seed spread


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variant", nargs="+", default=["base="], metavar="NAME=key:value,...",
                   help="Recipes to compare (keys in the module docstring); NAME= alone is the preset's recipe.")
    p.add_argument("--budget", type=float, default=90.0,
                   help="Training seconds per variant, evaluation excluded (pretrain.py --max_train_time).")
    p.add_argument("--curve_points", type=int, default=6, help="Evaluations, log-spaced up to the budget.")
    p.add_argument("--max_train_steps", type=int, default=None,
                   help="Stop every run after this many steps if its clock has not passed the budget first.")
    p.add_argument("--eval_steps", type=int, default=None,
                   help="Fixed steps: no time budget, every run trains --max_train_steps steps, evaluated every this "
                        "many (seed_noise.py's flags; --budget and --curve_points are not used).")
    p.add_argument("--noise", type=float, default=None, metavar="SPREAD",
                   help="The seed-to-seed spread of the base's final perplexity, a fraction (seed_noise.py's): each "
                        "variant's change against the base is also given in units of it.")
    p.add_argument("--base_perplexity", type=float, default=None,
                   help="Compare with this final perplexity (a base run recorded before) instead of the variant "
                        "named base (else the first).")
    p.add_argument("--gpt2", nargs="*", default=[], metavar="LxE[xH][@LR]", help="GPT-2 references (quality.py's).")
    p.add_argument("--gpt2_lr", type=float, default=3e-3)
    p.add_argument("--gpt2_warmup", type=int, default=20)
    p.add_argument("--gpt2_schedule", choices=["constant", "cosine"], default="constant",
                   help="GPT-2's schedule after warmup (cosine over the budget's training clock to zero).")
    p.add_argument("--config", default=None, help="A preset (default: pretrain.py's built-in defaults).")
    p.add_argument("--train_file")
    p.add_argument("--validation_file")
    p.add_argument("--text_column", default="text")
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--block_size", type=int)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--max_eval_blocks", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default="outputs/recipe_sweep")
    p.add_argument("--no-wait-quiet", "--no_wait_quiet", dest="wait_quiet", action="store_false",
                   help="Do not wait (up to 30 s) for other processes to leave the CPUs before training.")
    from common import add_results_dir

    return add_results_dir(p).parse_args(argv)


def parse_value(spec: str, key: str, value: str):
    kind = KEYS[key][1]
    if kind == SWITCH or isinstance(kind, tuple):
        choices = ("0", "1") if kind == SWITCH else kind
        if value not in choices:
            raise UsageError(f"--variant {spec!r}: {key} is one of {', '.join(choices)}, got {value!r}.")
        return value
    if kind in ("auto", "blocks") and value == kind:
        return value
    convert = int if key in ("min_count", "probe_runs") else (float if kind == "auto" else kind)
    try:
        number = convert(value)
    except ValueError:
        number = None
    least = {"probe_runs": 1, "probe_every": 2, "recurrence": 0}.get(key)
    if number is None or (least is not None and not number >= least):
        what = "an integer" if convert is int else "a number"
        what += f" >= {least}" if least is not None else ""
        raise UsageError(f"--variant {spec!r}: {key} needs {what}{f' or {kind}' if isinstance(kind, str) else ''}, "
                         f"got {value!r}.") from None
    return number


def parse_variant(spec: str) -> tuple[str, dict]:
    name, sep, body = spec.partition("=")
    if not sep or not NAME.match(name):
        raise UsageError(f"--variant {spec!r}: write NAME=key:value,key:value (or NAME= for the preset's recipe), "
                         "NAME of letters, digits, '_', '.', '-' (it names the run's folder).")
    settings = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition(":")
        if not sep or key not in KEYS:
            raise UsageError(f"--variant {spec!r}: {item!r} is not key:value with a key of {sorted(KEYS)}.")
        settings[key] = parse_value(spec, key, value)
    return name, settings


def fixed_steps_argv(args, name: str) -> list[str]:
    """seed_noise.py's run flags: --max_train_steps steps, evaluated every --eval_steps, no time budget, and
    pretrain.py's own schedule and evaluation batch."""
    argv = ["--seed", str(args.seed), "--text_column", args.text_column]
    argv += ["--config", args.config] if args.config else []
    argv += [x for flag in ("train_file", "validation_file", "vocab_size", "block_size")
             if getattr(args, flag) is not None for x in (f"--{flag}", str(getattr(args, flag)))]
    argv += ["--per_device_train_batch_size", str(args.batch_size), "--max_train_steps", str(args.max_train_steps),
             "--eval_steps", str(args.eval_steps)]
    argv += ["--max_eval_samples", str(args.max_eval_blocks)] if args.max_eval_blocks else []
    return argv + ["--torch_threads", str(args.threads), "--num_generations", "0",
                   "--output_dir", str(Path(args.output_dir) / name)]


def variant_argv(args, name: str, settings: dict, points) -> list[str]:
    """The pretrain.py flags of one variant: quality.py's row flags for this data, batch, budget and clock points
    (at fixed steps, seed_noise.py's), then the variant's own; it keeps its last model, which the seen / unseen split
    scores."""
    schedule = settings.get("schedule")
    if args.eval_steps:
        argv = fixed_steps_argv(args, name)
        argv += ["--lr_scheduler_type", quality.SCHEDULERS[schedule]] if schedule else []
    else:
        argv = quality.brillm_argv(args, args.config, points, name=name, schedule=schedule or "constant")
    for key, value in settings.items():
        flag = KEYS[key][0]
        if flag is None:
            continue
        if KEYS[key][1] == SWITCH:
            argv.append(flag if value == "1" else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(value)]
    return argv + ["--no-keep_best_model"]


class Prober:
    """`pruning.probe_bigrams` of the training blocks for given probe numbers: the blocks read once, each set of
    numbers probed once (the recipe's own too, which every probe variant is compared with)."""

    def __init__(self, data):
        self.data, self._sequences, self._probes = data, None, {}

    @property
    def sequences(self) -> list:
        if self._sequences is None:
            from modeling_brillm.training.data import block_sequences

            self._sequences = list(block_sequences(self.data.train, self.data.tokenizer.pad_token_id))
        return self._sequences

    def __call__(self, **numbers):
        from modeling_brillm.training.pruning import probe_bigrams

        key = tuple(sorted(numbers.items()))
        if key not in self._probes:
            self._probes[key] = probe_bigrams(self.sequences, len(self.data.tokenizer), **numbers)
        return self._probes[key]


def with_probe_choice(settings: dict, probe_of: Prober, epochs, pargs, model_fields: dict) -> dict:
    """A variant that sets the probe's numbers: its settings plus the count and the dropout the probe then chooses
    for this run of `epochs` planned passes (where the recipe leaves them "auto"), as pretrain.py's flags take them;
    none where the recipe's own probe chooses the same (the variant is then the recipe's run)."""
    numbers = {PROBE[k]: v for k, v in settings.items() if k in PROBE}
    if not numbers:
        return settings
    from modeling_brillm.training.pruning import choose_signal_dropout, decide_min_count

    if numbers.get("runs") == "blocks":
        numbers["runs"] = len(probe_of.sequences)

    def choose(probe) -> dict:
        chosen = {}
        if pargs.min_bigram_count == "auto" and "min_count" not in settings:
            chosen["min_count"] = decide_min_count(probe, epochs).min_count
        if model_fields.get("signal_dropout") == "auto" and "dropout" not in settings:
            chosen["dropout"] = choose_signal_dropout(probe.held_out.novelty, epochs)[0]
        return chosen

    probe = probe_of(**numbers)
    chosen = choose(probe)
    same = chosen == choose(probe_of())  # then it is the recipe's own run
    print(f"probe {numbers}: data count {probe.held_out.data_count}, novelty {probe.held_out.novelty:.2%}, "
          f"{epochs:.3g} planned epochs: {chosen}{' (the recipe chooses the same)' if same else ''}")
    return {**settings, **({} if same else chosen)}


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
    total = sums["seen"][1] + sums["unseen"][1]
    out = {f"{k}_targets": n for k, (_, n) in sums.items()}
    out.update({f"{k}_nll": (s / n if n else None) for k, (s, n) in sums.items()})
    out["unseen_share_of_targets"] = sums["unseen"][1] / max(total, 1)
    out["unseen_share_of_nll"] = sums["unseen"][0] / max(sums["seen"][0] + sums["unseen"][0], 1e-12)
    return out


def variant_row(argv, name: str, settings: dict, pretrain_data, held, args, device) -> dict:
    """One variant: quality.py's BriLLM row (the pretrain.py run, its curve from train_log.jsonl), its final point
    split into seen / unseen targets on the model the run saved."""
    from modeling_brillm import BriLLMForCausalLM

    row = quality.brillm_row(argv, pretrain_data, f" ({name})")
    model = BriLLMForCausalLM.from_pretrained(row["output_dir"]).to(device)
    row["curve"][-1].update(split_nll(model, held, args.eval_batch_size, device))
    return dict(row, label=name, recipe_text=recipe_text(settings), edges=row["num_edges"])


def recipe_text(settings: dict) -> str:
    return ", ".join(f"{k}:{v}" for k, v in settings.items()) or "preset"


def gpt2_row(size, data, points, args, accelerator) -> dict:
    row = quality.gpt2_row(size, data, points, args, args.batch_size)
    return dict(row, recipe_text=f"AdamW lr {size[3]:g}, {row['schedule']}")


def verdict(units: float) -> str:
    if units > BAR:
        return f"worse by more than {BAR:g}x the noise: the setting it changes earns its place"
    if units < -BAR:
        return f"better by more than {BAR:g}x the noise: the setting it changes costs"
    return f"within {BAR:g}x the noise: the setting it changes does not show"


def compare(models, args) -> dict | None:
    """Each BriLLM variant's final perplexity against the base's (--base_perplexity, else the variant named base,
    else the first): the change in % and, with --noise, in units of the seed-to-seed spread, with its verdict."""
    brillm = [m for m in models if m["kind"] == "brillm"]
    if args.base_perplexity is None and args.noise is None:
        return None
    base_row = next((m for m in brillm if m["label"] == "base"), brillm[0])
    base = args.base_perplexity or base_row["curve"][-1]["perplexity"]
    for m in brillm:
        change = m["curve"][-1]["perplexity"] / base - 1
        m["vs_base_percent"] = 100 * change
        if args.noise:
            m["vs_base_in_noise"] = change / args.noise
            m["verdict"] = verdict(change / args.noise)
        m["vs_base"] = comparison_line(m)  # as printed: its figures unsigned for docs/benchmarks.md's check
    return dict(base=("--base_perplexity" if args.base_perplexity else base_row["label"]), base_perplexity=base,
                noise_percent=None if args.noise is None else 100 * args.noise, bar_in_noise=BAR)


def comparison_line(m) -> str:
    line = f"{m['label']}: perplexity {m['curve'][-1]['perplexity']:.3f}, {m['vs_base_percent']:+.2f}% vs base"
    return line + (f" = {m['vs_base_in_noise']:+.2f}x the noise: {m['verdict']}" if "verdict" in m else "")


def markdown(results) -> str:
    compared = results.get("comparison") is not None
    head = ("| variant | recipe | final ppl | best ppl (at s) | train loss | held-out NLL seen / unseen | "
            "unseen targets | share of NLL from unseen | steps | tokens/s |" + (" vs base |" if compared else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in results["models"]:
        last = m["curve"][-1]  # the end of the budget (or of --max_train_steps)
        best = min(m["curve"][1:] or m["curve"], key=lambda p: p["perplexity"])
        split = (f"{last['seen_nll']:.2f} / {last['unseen_nll']:.2f}" if last.get("seen_nll") is not None
                 and last.get("unseen_nll") is not None else "")
        share = f"{last['unseen_share_of_targets']:.1%}" if "unseen_share_of_targets" in last else ""
        nll_share = f"{last['unseen_share_of_nll']:.1%}" if "unseen_share_of_nll" in last else ""
        loss = f"{last['train_loss']:.3f}" if last.get("train_loss") is not None else ""
        lines.append(f"| {m['label']} | {m['recipe_text']} | **{last['perplexity']:.2f}** | {best['perplexity']:.2f} "
                     f"({best['train_seconds']:.0f}) | {loss} | {split} | {share} | {nll_share} | {m['steps']:,} | "
                     f"{m['tokens_per_second']:,.0f} |")
        if compared:
            units = f" ({m['vs_base_in_noise']:+.1f}x noise)" if "vs_base_in_noise" in m else ""
            lines[-1] += f" {m['vs_base_percent']:+.1f}%{units} |" if "vs_base_percent" in m else " |"
    return "\n".join(lines)


def check_args(args):
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}.")
    for name in ("batch_size", "eval_batch_size", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    for name in ("max_train_steps", "max_eval_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.curve_points < 0:
        raise UsageError(f"--curve_points must be >= 0, got {args.curve_points}.")
    check_fixed_steps(args)
    variants = [parse_variant(v) for v in args.variant]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise UsageError(f"--variant names must differ: {names}.")
    return variants


def check_fixed_steps(args):
    if args.eval_steps is not None:
        if args.eval_steps < 1:
            raise UsageError(f"--eval_steps must be a positive integer, got {args.eval_steps}.")
        if args.max_train_steps is None:
            raise UsageError("--eval_steps trains a fixed number of steps: give --max_train_steps too.")
        if args.gpt2:
            raise UsageError("--gpt2 references train to a time budget: leave them out with --eval_steps.")
    elif any(key in PROBE for spec in args.variant for key in parse_variant(spec)[1]):
        raise UsageError(f"the probe's keys ({', '.join(PROBE)}) need fixed steps: give --eval_steps and "
                         "--max_train_steps (under a time budget the count depends on the timed epochs).")
    for name in ("noise", "base_perplexity"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a positive number, got {value}.")


def run(args) -> dict:
    from common import machine, wait_for_quiet

    variants = check_args(args)
    sizes = quality.gpt2_sizes(args.gpt2, args.gpt2_lr)
    args.budgets, args.schedule = [args.budget], args.gpt2_schedule  # what quality's rows read
    out = Path(args.output_dir)
    started = time.time()
    points = quality.curve_points([args.budget], args.curve_points)
    argvs = [variant_argv(args, name, settings, points) for name, settings in variants]
    # every variant checked by pretrain.py's own rules before any of them trains
    fields = [quality.pretrain.settle(quality.parse_pretrain(argv)).section("model") for argv in argvs]
    pretrain_data, first, accelerator = quality.shared_data(argvs[0], out / "data")  # no variant changes the data
    probe_of = Prober(pretrain_data)
    epochs = quality.pretrain.planned_epochs(first, pretrain_data, accelerator)
    variants = [(name, with_probe_choice(settings, probe_of, epochs, first, model_fields))
                for (name, settings), model_fields in zip(variants, fields)]
    argvs = [variant_argv(args, name, settings, points) for name, settings in variants]
    data = quality.harness_data(pretrain_data, first, accelerator, args.batch_size)
    print(f"data: {pretrain_data.description}; {len(data['train'][0]):,} training blocks, "
          f"{len(data['held'][0]):,} held out")
    load_before = wait_for_quiet(max_wait_s=30) if args.wait_quiet else None
    models, trained = [], {}  # variants with the same pretrain.py flags (their folder aside) train once
    for argv, (name, settings) in zip(argvs, variants):
        flags = tuple(argv[:argv.index("--output_dir")] + argv[argv.index("--output_dir") + 2:])
        if flags in trained:
            models.append(dict(trained[flags], label=name, recipe_text=recipe_text(settings),
                               same_run_as=trained[flags]["label"]))
            print(f"\n{name}: the same pretrain.py run as {trained[flags]['label']}")
            continue
        models.append(variant_row(argv, name, settings, pretrain_data, data["held"], args, accelerator.device))
        trained[flags] = models[-1]
    models += [gpt2_row(size, data, points, args, accelerator) for size in sizes]
    comparison = compare(models, args)
    results = dict(settings=dict(budget=None if args.eval_steps else args.budget, batch_size=args.batch_size,
                                 threads=args.threads, max_train_steps=args.max_train_steps,
                                 eval_steps=args.eval_steps, seed=args.seed, config=args.config,
                                 device=str(accelerator.device), order="one run after the other",
                                 other_cpu_load_before=None if load_before is None else round(load_before, 3),
                                 machine=machine(), started_utc=time.strftime("%Y-%m-%d %H:%M:%S",
                                                                             time.gmtime(started))),
                   data=dict(description=pretrain_data.description, vocab_size=len(data["tokenizer"]),
                             block_size=int(data["train"][0].shape[1]), train_blocks=len(data["train"][0]),
                             train_tokens=int(data["train"][1].sum()), heldout_blocks=len(data["held"][0])),
                   models=models, comparison=comparison)
    out.mkdir(parents=True, exist_ok=True)
    quality.write_json_atomic(out / "recipe_sweep.json", results)
    table = markdown(results)
    (out / "recipe_sweep.md").write_text(table + "\n", encoding="utf-8")
    quality.plot(results, out / "recipe_sweep.png", "BriLLM recipes")
    print("\n" + table)
    for m in models:
        if m["kind"] == "brillm":
            print(f"{m['label']} is: {m['pretrain_command']}")
    for m in (m for m in models if "vs_base" in m):
        print(m["vs_base"])
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
