"""Recipe sweep: BriLLM recipes side by side on one corpus at fixed steps, each against the base and the seed noise
(an ablation); --seeds: the seed noise itself.

    python benchmarks/recipe_sweep.py --train_file outputs/corpora/small/train.jsonl \
        --validation_file outputs/corpora/small/validation.jsonl --vocab_size 2000 --block_size 64 --seed 1 \
        --max_train_steps 900 --eval_steps 300 --noise 0.015 --variant base= prior=prior:0 wd=wd:0
    python benchmarks/recipe_sweep.py --train_file ... --max_train_steps 900 --eval_steps 300 --seeds 1 2 3

A variant NAME=key:value,... (NAME= alone: the recipe) IS an examples/pretrain.py run over pretrain.py's recipe or
--config's, as a quality.py BriLLM row is, in <output_dir>/<NAME>: --max_train_steps steps evaluated every
--eval_steps (no time budget: the machine's load does not enter). The keys (KEYS) are pretrain.py flags (a 0/1 key
turns a flag on or off; `schedule`: constant, cosine or linear) and the probe's numbers (`recurrence`, `probe_runs`
(`blocks`: every block a run), `probe_every`), whose chosen count and dropout are passed on as numbers. Each final
perplexity is compared with the base's (the variant named base, else the first, or --base_perplexity), in % and in
units of --noise; a change counts past twice the noise. --seeds: each variant once per seed (NAME-sSEED) and, at each
evaluation, the spread (max - min) / mean. Variants with the same flags train once (`same_run_as`).
"""

import argparse
import functools
import math
import re
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import quality  # (pretrain.py rows, the GPT-2 harness)
from common import machine, wait_for_quiet, write_record

UsageError = quality.UsageError
SWITCH = ("0", "1")  # a key whose value turns a pretrain.py --flag / --no-flag on or off
KEYS = {"lr": ("--learning_rate", float), "wd": ("--weight_decay", float),
        "lazy_wd": ("--lazy_weight_decay", SWITCH), "warmup": ("--num_warmup_steps", int),
        "schedule": (None, ("constant", "cosine", "linear")), "shared_lr": ("--shared_edge_lr_scale", float),
        "node_lr": ("--node_lr_scale", float), "clip": ("--max_grad_norm", float), "d": ("--node_size", int),
        "min_count": ("--min_bigram_count", int, "auto"), "dropout": ("--signal_dropout", float, "auto"),
        "dropout_warmup": ("--signal_dropout_warmup_epochs", float), "non_edge": ("--non_edge_bias", SWITCH),
        "readout": ("--node_readout", SWITCH), "recency": ("--position_recency", float),
        "backoff": ("--edge_backoff", SWITCH), "embed": ("--node_embedding", SWITCH),
        "prior": ("--count_prior", SWITCH), "seed": (None, int),
        "recurrence": (None, float), "probe_runs": (None, int, "blocks"), "probe_every": (None, int)}
PROBE = {"recurrence": "recurrence", "probe_runs": "runs", "probe_every": "probe_every"}  # key -> probe_bigrams'
LEAST = {"probe_runs": 1, "probe_every": 2, "recurrence": 0}
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
BAR = 2.0  # a change counts where it passes this many times the seed-to-seed spread


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", nargs="+", default=["base="], metavar="NAME=key:value,...")
    p.add_argument("--eval_steps", type=int, default=300)
    p.add_argument("--noise", type=float, metavar="SPREAD", help="the seed noise of the base's final perplexity")
    p.add_argument("--base_perplexity", type=float, help="compare with this (a base run recorded before)")
    p.add_argument("--seeds", type=int, nargs="+", help="every variant once per seed, and their spread")
    return quality.shared_arguments(p, max_train_steps=900, batch_size=64, eval_batch_size=64, threads=1, seed=42,
                                    output_dir="outputs/recipe_sweep").parse_args(argv)


def parse_value(spec: str, key: str, value: str):
    kind, word = KEYS[key][1], KEYS[key][2:]  # word: the one text a numeric key also takes ("auto", "blocks")
    if isinstance(kind, tuple):
        if value not in kind:
            raise UsageError(f"--variant {spec!r}: {key} is one of {', '.join(kind)}, got {value!r}.")
        return value
    if value in word:
        return value
    try:
        number = kind(value)
    except ValueError:
        number = None
    least = LEAST.get(key)
    if number is None or (least is not None and not number >= least):
        what = ("an integer" if kind is int else "a number") + (f" >= {least}" if least is not None else "")
        raise UsageError(f"--variant {spec!r}: {key} needs {what}{''.join(' or ' + w for w in word)}, got {value!r}.")
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


def variant_argv(args, name: str, settings: dict) -> list[str]:
    """The pretrain.py flags of one variant: fixed steps, pretrain.py's schedule, then its own flags; no best model."""
    argv = quality.data_argv(args, settings.get("seed", args.seed))
    argv += ["--per_device_train_batch_size", str(args.batch_size), "--max_train_steps", str(args.max_train_steps),
             "--eval_steps", str(args.eval_steps)]
    argv += ["--max_eval_samples", str(args.max_eval_blocks)] if args.max_eval_blocks else []
    argv += ["--torch_threads", str(args.threads), "--num_generations", "0", "--output_dir",
             str(Path(args.output_dir) / name)]
    argv += ["--lr_scheduler_type", quality.SCHEDULERS[settings["schedule"]]] if "schedule" in settings else []
    for key, value in settings.items():
        flag = KEYS[key][0]
        if flag and KEYS[key][1] == SWITCH:
            argv.append(flag if value == "1" else f"--no-{flag[2:]}")
        elif flag:
            argv += [flag, str(value)]
    return argv + ["--no-keep_best_model"]


class Prober:
    """`pruning.probe_bigrams` of the training blocks for given probe numbers, each set of numbers probed once."""

    def __init__(self, data):
        self.data, self._probes = data, {}

    @functools.cached_property
    def sequences(self) -> list:
        from modeling_brillm.training.data import block_sequences

        return list(block_sequences(self.data.train, self.data.tokenizer.pad_token_id))

    def __call__(self, **numbers):
        from modeling_brillm.training.pruning import probe_bigrams

        key = tuple(sorted(numbers.items()))
        if key not in self._probes:
            self._probes[key] = probe_bigrams(self.sequences, len(self.data.tokenizer), **numbers)
        return self._probes[key]


def with_probe_choice(settings: dict, probe_of: Prober, epochs, pargs, model_fields: dict) -> dict:
    """A variant that sets the probe's numbers: its settings plus the count and the dropout its probe chooses for this
    run of `epochs` planned passes (where the recipe leaves them "auto"); none where the recipe's own probe chooses
    the same (the variant is then the recipe's run)."""
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
    same = chosen == choose(probe_of())
    print(f"probe {numbers}: data count {probe.held_out.data_count}, novelty {probe.held_out.novelty:.2%}, "
          f"{epochs:.3g} planned epochs: {chosen}{' (the recipe chooses the same)' if same else ''}")
    return {**settings, **({} if same else chosen)}


def verdict(units: float) -> str:
    if units > BAR:
        return f"worse by more than {BAR:g}x the noise: the setting it changes earns its place"
    if units < -BAR:
        return f"better by more than {BAR:g}x the noise: the setting it changes costs"
    return f"within {BAR:g}x the noise: the setting it changes does not show"


def compare(models, args) -> dict | None:
    """Each variant's final perplexity against the base's: the change in % and, with --noise, in its units."""
    if args.base_perplexity is None and args.noise is None:
        return None
    base_row = next((m for m in models if m["label"] == "base"), models[0])
    base = args.base_perplexity or base_row["curve"][-1]["perplexity"]
    for m in models:
        change = m["curve"][-1]["perplexity"] / base - 1
        m["vs_base_percent"] = 100 * change
        if args.noise:
            m["vs_base_in_noise"], m["verdict"] = change / args.noise, verdict(change / args.noise)
        m["vs_base"] = comparison_line(m)
    return dict(base=("--base_perplexity" if args.base_perplexity else base_row["label"]), base_perplexity=base,
                noise_percent=None if args.noise is None else 100 * args.noise, bar_in_noise=BAR)


def comparison_line(m) -> str:
    line = f"{m['label']}: perplexity {m['curve'][-1]['perplexity']:.3f}, {m['vs_base_percent']:+.2f}% vs base"
    return line + (f" = {m['vs_base_in_noise']:+.2f}x the noise: {m['verdict']}" if "verdict" in m else "")


def seed_spread(models, groups: dict) -> dict:
    """Per variant and evaluation step: each seed's held-out perplexity and their spread (max - min) / mean."""
    out = {}
    for name, labels in groups.items():
        curves = [{p["steps"]: p["perplexity"] for p in m["curve"] if p["steps"]} for m in models
                  if m["label"] in labels]
        at_step = {step: [c[step] for c in curves] for step in sorted(set.intersection(*map(set, curves)))}
        out[name] = {s: dict(perplexity=v, spread=(max(v) - min(v)) / statistics.fmean(v)) for s, v in at_step.items()}
        for step, row in out[name].items():
            print(f"{name} step {step}: " + "  ".join(f"{v:.3f}" for v in row["perplexity"])
                  + f"   spread {row['spread']:.2%}")
    return out


def markdown(results) -> str:
    lines = ["| variant | recipe | final ppl | steps | tokens/s | vs base |", "|---|---|---|---|---|---|"]
    for m in results["models"]:
        units = f" ({m['vs_base_in_noise']:+.1f}x noise)" if "vs_base_in_noise" in m else ""
        change = f"{m['vs_base_percent']:+.1f}%{units}" if "vs_base_percent" in m else ""
        lines.append(f"| {m['label']} | {m['recipe_text']} | **{m['curve'][-1]['perplexity']:.2f}** | {m['steps']:,} | "
                     f"{m['tokens_per_second']:,.0f} | {change} |")
    return "\n".join(lines)


def check_args(args):
    quality.check_positive(args, ("batch_size", "eval_batch_size", "threads", "max_train_steps", "max_eval_blocks",
                                  "eval_steps"))
    for name in ("noise", "base_perplexity"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a positive number, got {value}.")
    variants = [parse_variant(v) for v in args.variant]
    variants = [(f"{n}-s{s}", {**st, "seed": s}) for n, st in variants for s in args.seeds] if args.seeds else variants
    if len({n for n, _ in variants}) != len(variants):
        raise UsageError(f"--variant names must differ: {[n for n, _ in variants]}.")
    return variants


def train(variants, argvs, pretrain_data) -> list[dict]:
    """Every variant's row; those with the same pretrain.py flags (their folder aside) train once."""
    models, trained = [], {}
    for argv, (name, settings) in zip(argvs, variants):
        at, text = argv.index("--output_dir"), ", ".join(f"{k}:{v}" for k, v in settings.items()) or "preset"
        flags = tuple(argv[:at] + argv[at + 2:])
        if flags in trained:
            print(f"\n{name}: the same pretrain.py run as {trained[flags]['label']}")
            models.append(dict(trained[flags], label=name, recipe_text=text, same_run_as=trained[flags]["label"]))
            continue
        row = quality.brillm_row(argv, pretrain_data, f" ({name})")
        models.append(dict(row, label=name, recipe_text=text, edges=row["num_edges"]))
        trained[flags] = models[-1]
    return models


def run(args) -> dict:
    variants, started, out = check_args(args), time.time(), Path(args.output_dir)
    argvs = [variant_argv(args, name, settings) for name, settings in variants]
    # every variant checked by pretrain.py's own rules before any of them trains
    fields = [quality.pretrain.settle(quality.parse_pretrain(argv)).section("model") for argv in argvs]
    pretrain_data, first, accelerator = quality.shared_data(argvs[0], out / "data")  # no variant changes the data
    probe_of, epochs = Prober(pretrain_data), quality.pretrain.planned_epochs(first, pretrain_data, accelerator)
    variants = [(name, with_probe_choice(settings, probe_of, epochs, first, model_fields))
                for (name, settings), model_fields in zip(variants, fields)]
    argvs = [variant_argv(args, name, settings) for name, settings in variants]
    data = quality.harness_data(pretrain_data, first, accelerator, args.batch_size)
    load_before = wait_for_quiet(max_wait_s=30) if args.wait_quiet else None
    models = train(variants, argvs, pretrain_data)
    settings = dict(budget=None, device=str(accelerator.device), order="one run after the other",
                    other_cpu_load_before=load_before and round(load_before, 3), machine=machine(),
                    started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
                    **{k: getattr(args, k) for k in ("batch_size", "threads", "max_train_steps", "eval_steps", "seed",
                                                     "config", "seeds")})
    results = dict(settings=settings, data=data["fields"], models=models, comparison=compare(models, args))
    if args.seeds:
        names = dict.fromkeys(name.rsplit("-s", 1)[0] for name, _ in variants)
        results["seed_noise"] = seed_spread(models, {n: [f"{n}-s{s}" for s in args.seeds] for n in names})
    out.mkdir(parents=True, exist_ok=True)
    quality.write_json(out / "recipe_sweep.json", results)
    quality.plot(results, out / "recipe_sweep.png", "BriLLM recipes")
    print("\n" + markdown(results))
    for m in (m for m in models if "vs_base" in m):
        print(m["vs_base"])
    return results


def main(argv=None) -> int:
    def recorded(args) -> int:
        write_record("recipe_sweep", args, run(args), argv=argv)
        return 0

    return quality.run_cli(parse_args, recorded, argv)


if __name__ == "__main__":
    sys.exit(main())
