"""How far a source-sharded run's losses are from one process's, through examples/pretrain.py.

    python benchmarks/sharded_parity.py                               # the demo preset, 20 steps, default flags
    python benchmarks/sharded_parity.py --steps 20 -- --max_grad_norm 0 --lr_scheduler_type constant
    BRILLM_ROOT=/path/to/other/checkout python benchmarks/sharded_parity.py   # measure another copy of the code

Runs `pretrain.py --config demo` (the embedded corpus; the preset's whole recipe, the node readout, the shared
edge matrix and the rate scales among it; `--config ""` for the built-in defaults) twice on the same global batch:
one process (`--optimizer auto`, i.e. SparseAdamW) with the whole batch, and two processes with `--edge_sharding
source` and half the batch each (`configuration/accelerate/cpu_2.yaml`). Prints both loss curves (from
train_log.jsonl) and the relative difference |sharded - one| / one at every step, its maximum and at the last step.
Arguments after `--` go to both runs. Takes ~1-2 minutes on 2 CPU cores (mostly start-up and tokenizer training).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(os.environ.get("BRILLM_ROOT") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_results_dir, write_record  # noqa: E402


def _run(cmd, env):
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(map(str, cmd))}\n{result.stdout[-2000:]}\n"
                 f"{result.stderr[-4000:]}")
    return result.stdout


def _losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "train_log.jsonl") as handle:
        return {r["step"]: r["loss"] for r in map(json.loads, handle) if "loss" in r}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo", help="pretrain.py preset [demo]")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global_batch", type=int, default=256, help="the demo preset's batch [256]")
    parser.add_argument("extra", nargs="*", help="more pretrain.py flags for both runs (after --)")
    args = add_results_dir(parser).parse_args()
    python = sys.executable
    accelerate = str(Path(python).with_name("accelerate"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT",
                                                            "MASTER_ADDR", "ACCELERATE_USE_CPU")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    preset = ["--config", args.config] if args.config else []
    common = [*preset, "--max_train_steps", str(args.steps), "--num_generations", "0", *args.extra]
    script = str(ROOT / "examples" / "pretrain.py")
    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one", Path(tmp) / "sharded"
        _run([python, script, *common, "--per_device_train_batch_size", str(args.global_batch),
              "--output_dir", str(one)], env)
        _run([accelerate, "launch", "--config_file", str(ROOT / "configuration" / "accelerate" / "cpu_2.yaml"),
              "--main_process_port", str(random.randint(20000, 40000)), script, *common,
              "--per_device_train_batch_size", str(args.global_batch // 2), "--edge_sharding", "source",
              "--output_dir", str(two)], env)
        ref, got = _losses(one), _losses(two)
    print(f"code: {ROOT}; pretrain.py {' '.join(common)}; global batch {args.global_batch}")
    print("step  one process   sharded (2)   relative difference")
    rel = {}
    for step in sorted(ref):
        rel[step] = abs(got[step] - ref[step]) / abs(ref[step])
        print(f"{step:4d}  {ref[step]:.7f}     {got[step]:.7f}     {rel[step]:.2e}")
    last = max(rel)
    print(f"max relative difference {max(rel.values()):.2e}; at step {last}: {rel[last]:.2e}")
    write_record("sharded_parity", args, dict(pretrain_flags=common, one_process=ref, sharded=got, relative=rel,
                                              max_relative=max(rel.values()), last_relative=rel[last]))


if __name__ == "__main__":
    main()
