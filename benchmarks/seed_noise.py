"""How much the default recipe's held-out perplexity moves with the seed alone: the noise a recipe change must beat.

    python benchmarks/seed_noise.py --corpora outputs/corpora/small outputs/corpora/literature --seeds 1 2 3
    python benchmarks/seed_noise.py --corpora outputs/corpora/small --seeds 1 2 --steps 60 --eval_steps 30   # check

Runs `examples/pretrain.py` with no recipe flag once per corpus and seed, for a fixed number of steps (not a time
budget, so the machine's load does not enter the figure), evaluating every `--eval_steps`, at the shape of the
quality benchmark (V 2000, blocks of 64 tokens, batch 64, one thread). A corpus is a folder with `train.jsonl` and
`validation.jsonl` (`benchmarks/corpora.py` builds them). Prints, per corpus and evaluation step, each seed's
held-out perplexity and the spread (max - min) / mean, and writes the record. Arguments after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_results_dir, write_record  # noqa: E402


def run_once(corpus: Path, seed: int, args, out_dir: Path) -> dict[int, float]:
    """One pretrain.py run; its held-out perplexity by step (from train_log.jsonl)."""
    cmd = [sys.executable, str(ROOT / "examples" / "pretrain.py"), "--seed", str(seed),
           "--train_file", str(corpus / "train.jsonl"), "--validation_file", str(corpus / "validation.jsonl"),
           "--text_column", "text", "--vocab_size", "2000", "--block_size", "64", "--per_device_train_batch_size",
           "64", "--max_train_steps", str(args.steps), "--eval_steps", str(args.eval_steps), "--torch_threads",
           str(args.threads), "--num_generations", "0", "--no-keep_best_model", "--output_dir", str(out_dir),
           *args.extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"pretrain.py failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    with open(out_dir / "train_log.jsonl", encoding="utf-8") as log:
        return {r["step"]: r["perplexity"] for r in map(json.loads, log) if "perplexity" in r and r["step"] > 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", nargs="+", required=True, help="folders holding train.jsonl, validation.jsonl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=900, help="training steps per run [900]")
    parser.add_argument("--eval_steps", type=int, default=300, help="evaluate every this many steps [300]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run [1]")
    parser.add_argument("extra", nargs="*", help="more pretrain.py flags for every run (after --)")
    args = add_results_dir(parser).parse_args(argv)
    for corpus in map(Path, args.corpora):
        if not (corpus / "train.jsonl").is_file() or not (corpus / "validation.jsonl").is_file():
            parser.error(f"{corpus} holds no train.jsonl and validation.jsonl (build it with benchmarks/corpora.py)")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for corpus in map(Path, args.corpora):
            curves = {seed: run_once(corpus, seed, args, Path(tmp) / f"{corpus.name}-{seed}") for seed in args.seeds}
            rows = {}
            print(f"{corpus.name}: held-out perplexity by step, seeds {args.seeds}")
            for step in sorted(set.intersection(*(set(c) for c in curves.values()))):
                values = [curves[seed][step] for seed in args.seeds]
                spread = (max(values) - min(values)) / (sum(values) / len(values))
                rows[step] = {"perplexity": values, "spread": spread}
                print(f"  step {step:5d}  " + "  ".join(f"{v:8.3f}" for v in values) + f"   spread {spread:.2%}")
            figures[corpus.name] = rows
    write_record("seed_noise", args, figures, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
