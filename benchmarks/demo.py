"""`make demo`'s run and other recipes on the same data: the figures of docs/benchmarks.md's demo section.

    python benchmarks/demo.py                                  # the demo, then each --variants entry
    python benchmarks/demo.py --variants "" "--edge_backoff"   # only these

Runs `examples/pretrain.py --config demo` (what `make demo` launches, in one process) once per variant, the
variant's flags added after the preset's, and reads each run's pretrain_summary.json: held-out perplexity before
and after training, the training time and throughput, and the sampled continuations. The runs have a fixed number
of steps, so the perplexities do not depend on the machine's load; the time and tokens/s do (run it on a quiet
machine for those). Prints one line per variant and writes the record.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_results_dir, write_record  # noqa: E402

VARIANTS = ["", "--edge_backoff", "--non_edge_bias", "--count_prior", "--node_embedding", "--config demo-release"]


def run_variant(flags: str, out_dir: Path) -> dict:
    """One `pretrain.py --config demo` run with `flags` added; its pretrain_summary.json."""
    cmd = [sys.executable, str(ROOT / "examples" / "pretrain.py"), "--config", "demo", *shlex.split(flags),
           "--output_dir", str(out_dir)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"pretrain.py failed ({done.returncode}): {shlex.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads((out_dir / "pretrain_summary.json").read_text(encoding="utf-8"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help="pretrain.py flags added to --config demo, one string per run; \"\" is the demo itself")
    args = add_results_dir(parser).parse_args(argv)
    keys = ("perplexity_before", "perplexity", "eval_loss_before", "eval_loss", "steps", "train_seconds",
            "tokens_per_second", "num_edges", "num_parameters", "generations")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, flags in enumerate(args.variants):
            summary = run_variant(flags, Path(tmp) / f"run{i}")
            figures[flags or "demo"] = {k: summary[k] for k in keys}
            print(f"{flags or '(the demo)':24s} perplexity {summary['perplexity_before']:.1f} -> "
                  f"{summary['perplexity']:.2f}  {summary['train_seconds']:.1f} s of training, "
                  f"{summary['tokens_per_second']:,.0f} tokens/s", flush=True)
    write_record("demo", args, figures, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
