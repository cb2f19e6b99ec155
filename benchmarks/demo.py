"""`make demo`'s run and other recipes on its data: `examples/pretrain.py --config demo` in a subprocess once per
variant, the variant's flags added, and the KEYS of each run's pretrain_summary.json. The steps are fixed: the
perplexities do not depend on the machine's load, the time and tokens/s do.

    python benchmarks/demo.py                                  # the demo, then each --variants entry
    python benchmarks/demo.py --variants "" "--edge_backoff"   # only these
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, add_results_dir, write_record

VARIANTS = ["", "--edge_backoff", "--non_edge_bias", "--count_prior", "--node_embedding", "--config demo-release"]
KEYS = ("perplexity_before", "perplexity", "eval_loss_before", "eval_loss", "steps", "train_seconds",
        "tokens_per_second", "num_edges", "num_parameters", "generations")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help='pretrain.py flags per run; "": the demo')
    args = add_results_dir(parser).parse_args(argv)
    figures, env = {}, dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        for i, flags in enumerate(args.variants):
            cmd = [sys.executable, os.path.join(ROOT, "examples", "pretrain.py"), "--config", "demo",
                   *shlex.split(flags), "--output_dir", os.path.join(tmp, f"run{i}")]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
            if done.returncode != 0:
                sys.exit(f"pretrain.py failed ({done.returncode}): {shlex.join(cmd)}\n{done.stderr[-3000:]}")
            summary = json.loads(Path(tmp, f"run{i}", "pretrain_summary.json").read_text(encoding="utf-8"))
            figures[flags or "demo"] = {k: summary[k] for k in KEYS}
            print(f"{flags or '(the demo)':24s} perplexity {summary['perplexity_before']:.1f} -> "
                  f"{summary['perplexity']:.2f}, {summary['train_seconds']:.1f} s of training, "
                  f"{summary['tokens_per_second']:,.0f} tokens/s", flush=True)
    write_record("demo", args, figures, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
