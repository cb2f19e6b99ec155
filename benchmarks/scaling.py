"""How exact-objective training cost grows with batch, length, vocabulary and successors per node.

    python benchmarks/scaling.py                 # all four sweeps around the small shape (about 4 minutes)
    python benchmarks/scaling.py --sweep batch

Around the small shape (V 1000, 100 successors, batch 32 x length 32, sparse gradients + SparseAdamW), one
knob at a time. For every point: tokens/s and step time (median of the timed steps, forward + backward +
optimizer), the distinct source nodes of a batch, the edge rows a step touches (their successors' blocks,
plus row 0), and those rows' bytes; "GB/s" is touched edge-matrix bytes per second of step, the figure that
stays roughly constant when the cost is the memory traffic of the touched edges.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CpuMonitor, ZipfPaths, add_results_dir, machine, make_model, wait_for_quiet, write_record  # noqa: E402

BASE = dict(vocab=1000, successors=100, batch=32, length=32)
SWEEPS = {
    "batch": [("batch", b) for b in (8, 16, 32, 64, 128)],
    "length": [("length", n) for n in (16, 32, 64, 128)],
    "successors": [("successors", k) for k in (25, 50, 100, 200, 400)],
    "vocab": [("vocab", v) for v in (500, 1000, 2000, 4000)],
}


def measure(cfg, steps, warmup):
    from modeling_brillm.optimization import SparseAdamW

    model, graph = make_model(cfg["vocab"], cfg["successors"])
    model.sparse_gradients = True
    optimizer = SparseAdamW(model.parameters(), lr=1e-3)
    paths = ZipfPaths(graph, seed=1)
    B, L = cfg["batch"], cfg["length"]
    times, sources = [], []
    monitor = CpuMonitor()
    for step in range(warmup + steps):
        batch = paths.batch(B, L)
        if step == warmup:
            monitor.start()
        t0 = time.perf_counter()
        model(input_ids=batch, labels=batch, return_logits=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            sources.append(torch.unique(batch[:, :-1]).numel())
    load = monitor.stop()
    step_s = statistics.median(times)
    distinct = statistics.mean(sources)
    rows = distinct * cfg["successors"] + 1
    d = model.config.node_size
    touched_gb = rows * d * d * 4 / 1e9
    n_params = sum(p.numel() for p in model.parameters())
    del model, optimizer, graph, paths
    gc.collect()
    return dict(cfg, params=n_params, tokens_per_s=B * L / step_s, step_ms=1000 * step_s, distinct_sources=distinct,
                touched_rows=rows, touched_gb=touched_gb, gb_per_s=touched_gb / step_s, other_cpu_load=load)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", choices=list(SWEEPS) + ["all"], default="all")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-wait-quiet", dest="wait_quiet", action="store_false", default=True)
    args = add_results_dir(parser).parse_args()
    print(f"# machine: {machine()}")
    rows = []
    for name in (SWEEPS if args.sweep == "all" else [args.sweep]):
        for key, value in SWEEPS[name]:
            cfg = dict(BASE, **{key: value})
            if args.wait_quiet:
                wait_for_quiet()
            row = dict(sweep=name, **measure(cfg, args.steps, args.warmup))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'sweep':10} {'V':>5} {'succ':>5} {'B':>4} {'L':>4} {'params':>7} {'tokens/s':>9} {'step ms':>8} "
          f"{'sources':>7} {'rows':>7} {'GB':>6} {'GB/s':>5} {'load':>5}")
    for r in rows:
        print(f"{r['sweep']:10} {r['vocab']:5d} {r['successors']:5d} {r['batch']:4d} {r['length']:4d} "
              f"{r['params'] / 1e6:6.0f}M {r['tokens_per_s']:9.0f} {r['step_ms']:8.1f} {r['distinct_sources']:7.0f} "
              f"{r['touched_rows']:7.0f} {r['touched_gb']:6.3f} {r['gb_per_s']:5.2f} {r['other_cpu_load']:5.2f}")
    write_record("scaling", args, dict(rows=rows))


if __name__ == "__main__":
    main()
