"""Training throughput: tokens/s of forward + backward + optimizer step, and peak memory; or how the cost scales.

    python benchmarks/train_throughput.py                      # both shapes, all objectives, + reference
    python benchmarks/train_throughput.py --shape small --objective exact --steps 10
    python benchmarks/train_throughput.py --shape small --grads dense   # dense grads + torch AdamW
    python benchmarks/train_throughput.py --sweep successors            # around the small shape, one knob at a time

Shapes (benchmarks/common.py's synthetic graphs and Zipf paths): "paper" = V 4000, d 32, 227 successors (0.959B
parameters), "small" = V 1000, 100 successors (106M); batch 32 x 32. Objectives: "exact" (full softmax), "freq" /
"uniform" (K=400 sampled negatives by frequency / uniformly). Each shape runs in its own subprocess, so its peak memory
(the process's resident high-water mark: weights, optimizer state, gradients) is its own; tokens/s is B x L over the
median timed step. --reference (the small shape) also times reference_impl.py's per-candidate loop on the same batch.

--sweep batch|length|successors|vocab|all: one knob at a time around the small shape (sparse gradients, SparseAdamW):
tokens/s, step time, the distinct sources of a batch and the edge rows a step touches (their successors, plus row 0).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    SHAPES,
    CpuMonitor,
    ZipfPaths,
    add_results_dir,
    machine,
    make_model,
    peak_rss_gb,
    rss_gb,
    wait_for_quiet,
    write_record,
)

OBJECTIVES = {
    "exact": dict(loss_type="exact"),
    "freq": dict(loss_type="sampled", num_negatives=400, negative_sampling="frequency"),
    "uniform": dict(loss_type="sampled", num_negatives=400, negative_sampling="uniform"),
}
SWEEPS = {"batch": [8, 16, 32, 64, 128], "length": [16, 32, 64, 128], "successors": [25, 50, 100, 200, 400],
          "vocab": [500, 1000, 2000, 4000]}


def set_objective(model, name):
    for key, value in OBJECTIVES[name].items():
        setattr(model.config, key, value)


def timed_steps(model, optimizer, paths, B, L, args):
    """(step seconds, (forward, backward, optimizer) seconds, distinct sources) of each timed step; the load others put
    on the CPUs meanwhile; the last loss."""
    times, monitor = [], CpuMonitor()
    for step in range(args.warmup + args.steps):
        batch = paths.batch(B, L)
        if step == args.warmup:
            monitor.start()
        t0 = time.perf_counter()
        out = model(input_ids=batch, labels=batch, return_logits=False)
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0, (t1 - t0, t2 - t1, time.perf_counter() - t2),
                          torch.unique(batch[:, :-1]).numel()))
    return times, monitor.stop(), float(out.loss.detach())


def reference_rows(args, model, paths, rows, B, L):
    """The per-candidate reference last, so that the peak memory above is ours alone."""
    from reference_impl import PerCandidateReference

    for row in rows:
        set_objective(model, row["objective"])
        ref, batch = PerCandidateReference(model, lr=args.lr), paths.batch(B, L)
        with torch.no_grad():
            ours = float(model(input_ids=batch, labels=batch, return_logits=False).loss)
        seconds, losses = [], []
        for _ in range(args.reference_steps):
            t0 = time.perf_counter()
            losses.append(float(ref.train_step(batch)))
            seconds.append(time.perf_counter() - t0)
        match = abs(losses[0] - ours) <= 1e-4 * max(1.0, abs(ours))  # its first step sees our parameters
        row.update(reference_tokens_per_s=B * L / min(seconds), reference_step_s=min(seconds),
                   ratio=row["tokens_per_s"] * min(seconds) / (B * L),
                   reference_loss_matches=match if row["objective"] != "uniform" else None)
        print(json.dumps(row), flush=True)


def run_shape(args, shape_name):
    from modeling_brillm.optimization import SparseAdamW

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, graph = make_model(shape["vocab"], shape["successors"])
    build_s = time.perf_counter() - t0
    model.sparse_gradients = args.grads == "sparse"
    optimizer = (SparseAdamW if model.sparse_gradients else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    paths, B, L = ZipfPaths(graph, seed=1), shape["batch"], shape["length"]
    results = []
    for objective in args.objective:
        set_objective(model, objective)
        if args.wait_quiet:
            wait_for_quiet()
        times, load, loss = timed_steps(model, optimizer, paths, B, L, args)
        med = statistics.median(t for t, _, _ in times)
        fwd, bwd, opt = (statistics.median(p[i] for _, p, _ in times) for i in range(3))
        results.append(dict(shape=shape_name, objective=objective, grads=args.grads,
                            params=sum(p.numel() for p in model.parameters()), tokens_per_s=B * L / med,
                            best_tokens_per_s=B * L / min(t for t, _, _ in times), step_s=med, forward_s=fwd,
                            backward_s=bwd, optimizer_s=opt, peak_rss_gb=peak_rss_gb(), other_cpu_load=load, loss=loss))
        print(json.dumps(results[-1]), flush=True)
    if args.reference and shape_name == "small":
        reference_rows(args, model, paths, results, B, L)
    return dict(build_s=build_s, rss_after_gb=rss_gb(), results=results)


def sweep_point(args, cfg) -> dict:
    from modeling_brillm.optimization import SparseAdamW

    model, graph = make_model(cfg["vocab"], cfg["successors"])
    model.sparse_gradients = True
    times, load, _ = timed_steps(model, SparseAdamW(model.parameters(), lr=1e-3), ZipfPaths(graph, seed=1),
                                 cfg["batch"], cfg["length"], args)
    step_s = statistics.median(t for t, _, _ in times)
    rows = statistics.mean(n for _, _, n in times) * cfg["successors"] + 1
    touched_gb = rows * model.config.node_size ** 2 * 4 / 1e9
    return dict(cfg, params=sum(p.numel() for p in model.parameters()), step_ms=1e3 * step_s,
                tokens_per_s=cfg["batch"] * cfg["length"] / step_s, touched_rows=rows, touched_gb=touched_gb,
                gb_per_s=touched_gb / step_s, other_cpu_load=load)


def sweeps(args):
    rows = []
    for name in (SWEEPS if args.sweep == "all" else [args.sweep]):
        for value in SWEEPS[name]:
            if args.wait_quiet:
                wait_for_quiet()
            rows.append(dict(sweep=name, **sweep_point(args, dict(SHAPES["small"], **{name: value}))))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'sweep':10} {'V':>5} {'succ':>5} {'B':>4} {'L':>4} {'params':>7} {'tokens/s':>9} {'step ms':>8} "
          f"{'rows':>7} {'GB/s':>5} {'load':>5}")
    for r in rows:
        print(f"{r['sweep']:10} {r['vocab']:5d} {r['successors']:5d} {r['batch']:4d} {r['length']:4d} "
              f"{r['params'] / 1e6:6.0f}M {r['tokens_per_s']:9.0f} {r['step_ms']:8.1f} {r['touched_rows']:7.0f} "
              f"{r['gb_per_s']:5.2f} {r['other_cpu_load']:5.2f}")
    write_record("train_throughput", args, dict(sweep=rows))


def child_command(args, shape) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shape", shape, "--grads", args.grads, "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--reference-steps",
           str(args.reference_steps), "--threads", str(args.threads), "--objective",
           args.objective[0] if len(args.objective) == 1 else "all"]
    return cmd + ["--no-reference"] * (not args.reference) + ["--no-wait-quiet"] * (not args.wait_quiet)


def print_rows(rows):
    print(f"\n{'shape':6} {'objective':8} {'grads':6} {'params':>7} {'tokens/s':>9} {'best':>7} {'fwd s':>6} "
          f"{'bwd s':>6} {'opt s':>6} {'peak GB':>7} {'ref tok/s':>9} {'ratio':>6} {'ref loss':>8} {'other load':>10}")
    for r in rows:
        ref = f"{r['reference_tokens_per_s']:9.1f}" if "reference_tokens_per_s" in r else f"{'-':>9}"
        ratio = f"{r['ratio']:6.0f}" if "ratio" in r else f"{'-':>6}"
        same = {True: "same", False: "DIFFERS", None: "-"}[r.get("reference_loss_matches")]
        print(f"{r['shape']:6} {r['objective']:8} {r['grads']:6} {r['params'] / 1e6:6.0f}M {r['tokens_per_s']:9.0f} "
              f"{r['best_tokens_per_s']:7.0f} {r['forward_s']:6.3f} {r['backward_s']:6.3f} {r['optimizer_s']:6.3f} "
              f"{r['peak_rss_gb']:7.2f} {ref} {ratio} {same:>8} {r['other_cpu_load']:10.2f}")
    print("\n(peak GB: the process's RSS high-water mark; ref loss: the reference's loss on the same batch and "
          "parameters equals ours (uniform negatives are random); other load: cores others used, ~0 when clean)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["paper", "small", "all"], default="all")
    parser.add_argument("--objective", choices=list(OBJECTIVES) + ["all"], default="all")
    parser.add_argument("--grads", choices=["sparse", "dense"], default="sparse",
                        help="sparse: model.sparse_gradients=True + SparseAdamW; dense: torch.optim.AdamW")
    parser.add_argument("--sweep", choices=list(SWEEPS) + ["all"], help="scale one knob around the small shape")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--reference", dest="reference", action="store_true", default=True)
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument("--reference-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--no-wait-quiet", dest="wait_quiet", action="store_false", default=True,
                        help="do not wait (up to 5 min) for other processes to leave the CPUs before timing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = add_results_dir(parser).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.objective = list(OBJECTIVES) if args.objective == "all" else [args.objective]
    if args.child:
        print("RESULT " + json.dumps(run_shape(args, args.shape)), flush=True)
        return
    print(f"# machine: {machine()}")
    if args.sweep:
        return sweeps(args)
    rows = []
    for shape in ["small", "paper"] if args.shape == "all" else [args.shape]:
        proc = subprocess.run(child_command(args, shape), capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"{shape}: child failed")
        rows += json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])["results"]
    print_rows(rows)
    write_record("train_throughput", args, dict(rows=rows))


if __name__ == "__main__":
    main()
