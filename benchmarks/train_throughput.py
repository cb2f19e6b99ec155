"""Training throughput: tokens/s of forward + backward + optimizer step, and peak memory.

    python benchmarks/train_throughput.py                      # both shapes, all objectives, + reference
    python benchmarks/train_throughput.py --shape small --objective exact --steps 10
    python benchmarks/train_throughput.py --shape small --grads dense   # dense grads + torch AdamW

Shapes (synthetic graphs with exactly the stated real successors per node, Zipf token paths along real
edges, see benchmarks/common.py): "paper" = V 4000, d 32, 227 successors (0.959B parameters), "small" =
V 1000, 100 successors (106M parameters); batch 32 x length 32. Objectives: "exact" (full softmax over all V
nodes), "freq" / "uniform" (loss_type="sampled", K=400 negatives by frequency / uniformly).

Every (shape) runs in its own subprocess so its peak memory is its own: peak RSS is the process's high-water
resident set (resource.getrusage ru_maxrss), which includes the weights, the optimizer state (AdamW moments,
allocated in full on the first step) and the gradients. tokens/s counts the B x L input tokens of a step
(B x (L-1) positions are scored); the step time is the median over the timed steps, after warm-up steps.
With --reference (default on for the small shape), the per-candidate implementation in reference_impl.py
runs one step on the same batch in the same process and the ratio of the two is printed.
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


def set_objective(model, name):
    for key, value in OBJECTIVES[name].items():
        setattr(model.config, key, value)


def run_shape(args, shape_name):
    from modeling_brillm.optimization import SparseAdamW

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, graph = make_model(shape["vocab"], shape["successors"])
    build_s = time.perf_counter() - t0
    sparse = args.grads == "sparse"
    model.sparse_gradients = sparse
    if sparse:
        optimizer = SparseAdamW(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    paths = ZipfPaths(graph, seed=1)
    B, L = shape["batch"], shape["length"]
    n_params = sum(p.numel() for p in model.parameters())
    results = []
    for objective in args.objective:
        set_objective(model, objective)
        times, phases = [], []
        if args.wait_quiet:
            wait_for_quiet()
        monitor = CpuMonitor()
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
            t3 = time.perf_counter()
            if step >= args.warmup:
                times.append(t3 - t0)
                phases.append((t1 - t0, t2 - t1, t3 - t2))
        busy_others = monitor.stop()
        med = statistics.median(times)
        fwd, bwd, opt = (statistics.median(p[i] for p in phases) for i in range(3))
        row = dict(shape=shape_name, objective=objective, grads=args.grads, params=n_params,
                   tokens_per_s=B * L / med, best_tokens_per_s=B * L / min(times), step_s=med,
                   forward_s=fwd, backward_s=bwd, optimizer_s=opt, peak_rss_gb=peak_rss_gb(),
                   other_cpu_load=busy_others, loss=float(out.loss))
        results.append(row)
        print(json.dumps(row), flush=True)
    # the per-candidate reference last, so that the peak memory above is ours alone
    if args.reference and shape_name == "small":
        from reference_impl import PerCandidateReference

        for row in results:
            set_objective(model, row["objective"])
            ref = PerCandidateReference(model, lr=args.lr)
            batch = paths.batch(B, L)
            with torch.no_grad():
                ours_loss = float(model(input_ids=batch, labels=batch, return_logits=False).loss)
            ref_times = []
            for k in range(args.reference_steps):
                t0 = time.perf_counter()
                ref_loss = float(ref.train_step(batch))
                ref_times.append(time.perf_counter() - t0)
                if k == 0:  # the first step sees the same parameters as ours
                    match = abs(ref_loss - ours_loss) <= 1e-4 * max(1.0, abs(ours_loss))
            ref_s = min(ref_times)
            row.update(reference_tokens_per_s=B * L / ref_s, reference_step_s=ref_s,
                       ratio=row["tokens_per_s"] / (B * L / ref_s),
                       reference_loss_matches=match if row["objective"] != "uniform" else None)
            print(json.dumps(row), flush=True)
            del ref
    return dict(build_s=build_s, rss_after_gb=rss_gb(), results=results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["paper", "small", "all"], default="all")
    parser.add_argument("--objective", choices=list(OBJECTIVES) + ["all"], default="all")
    parser.add_argument("--grads", choices=["sparse", "dense"], default="sparse",
                        help="sparse: model.sparse_gradients=True + SparseAdamW; dense: torch.optim.AdamW")
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
    shapes = ["small", "paper"] if args.shape == "all" else [args.shape]
    rows = []
    for shape in shapes:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shape", shape, "--grads", args.grads,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
               "--reference-steps", str(args.reference_steps), "--threads", str(args.threads),
               "--objective", args.objective[0] if len(args.objective) == 1 else "all"]
        if not args.reference:
            cmd.append("--no-reference")
        if not args.wait_quiet:
            cmd.append("--no-wait-quiet")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"{shape}: child failed")
        result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
        rows.extend(result["results"])
    print()
    print(f"{'shape':6} {'objective':8} {'grads':6} {'params':>7} {'tokens/s':>9} {'best':>7} {'fwd s':>6} "
          f"{'bwd s':>6} {'opt s':>6} {'peak GB':>7} {'ref tok/s':>9} {'ratio':>6} {'ref loss':>8} {'other load':>10}")
    for r in rows:
        ref = f"{r['reference_tokens_per_s']:9.1f}" if "reference_tokens_per_s" in r else f"{'-':>9}"
        ratio = f"{r['ratio']:6.0f}" if "ratio" in r else f"{'-':>6}"
        same = {True: "same", False: "DIFFERS", None: "-"}[r.get("reference_loss_matches")]
        print(f"{r['shape']:6} {r['objective']:8} {r['grads']:6} {r['params'] / 1e6:6.0f}M {r['tokens_per_s']:9.0f} "
              f"{r['best_tokens_per_s']:7.0f} {r['forward_s']:6.3f} {r['backward_s']:6.3f} {r['optimizer_s']:6.3f} "
              f"{r['peak_rss_gb']:7.2f} {ref} {ratio} {same:>8} {r['other_cpu_load']:10.2f}")
    print("\n(peak GB: process RSS high-water, weights + optimizer state + gradients; ref loss: the reference's loss "
          "on the same batch and parameters equals ours (uniform negatives are random, not compared); other load: CPU "
          "cores used by other processes during the timed steps, ~0 for clean figures)")
    write_record("train_throughput", args, dict(rows=rows))


if __name__ == "__main__":
    main()
