"""Training throughput: tokens/s of forward + backward + optimizer step and peak memory, or (--checkpointing) the
activation memory gradient checkpointing saves (each figure: docs/benchmarks.md).

    python benchmarks/train_throughput.py                      # both shapes, every objective
    python benchmarks/train_throughput.py --shape small --grads dense   # dense gradients + torch AdamW
    python benchmarks/train_throughput.py --checkpointing --shape paper --batch 8 --length 256
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
import common

OBJECTIVES = {"exact": dict(loss_type="exact"),
              "freq": dict(loss_type="sampled", num_negatives=400, negative_sampling="frequency"),
              "uniform": dict(loss_type="sampled", num_negatives=400, negative_sampling="uniform")}


def timed_steps(model, optimizer, paths, B, L, args):
    """((step, forward, backward, optimizer) seconds of each timed step, the others' CPU load, the last loss)."""
    times = []
    for step in range(args.warmup + args.steps):
        batch = paths.batch(B, L)
        if step == args.warmup:
            others = common.other_cpu_load()
        t0 = time.perf_counter()
        out = model(input_ids=batch, labels=batch, return_logits=False)
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0, t1 - t0, t2 - t1, time.perf_counter() - t2))
    return times, others(), float(out.loss.detach())


def run_shape(args, shape_name) -> list[dict]:
    from modeling_brillm.optimization import SparseAdamW

    shape = common.SHAPES[shape_name]
    model, graph = common.make_model(shape["vocab"], shape["successors"])
    model.sparse_gradients = args.grads == "sparse"
    optimizer = (SparseAdamW if model.sparse_gradients else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    paths, B, L = common.ZipfPaths(graph, seed=1), args.batch or shape["batch"], args.length or shape["length"]
    rows = []
    for objective in args.objective:
        model.config.update(OBJECTIVES[objective])
        if args.wait_quiet:
            common.wait_for_quiet()
        times, load, loss = timed_steps(model, optimizer, paths, B, L, args)
        step, fwd, bwd, opt = (statistics.median(t[i] for t in times) for i in range(4))
        rows.append(dict(shape=shape_name, objective=objective, grads=args.grads, tokens_per_s=B * L / step,
                         params=sum(p.numel() for p in model.parameters()), forward_s=fwd, backward_s=bwd,
                         optimizer_s=opt, peak_rss_gb=common.peak_rss_gb(), other_cpu_load=load, loss=loss))
    return rows


def saved_bytes(model, batch) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of one forward."""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch, labels=batch, return_logits=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def checkpointing_rows(args) -> list[dict]:
    shape = common.SHAPES[args.shape]
    model, graph = common.make_model(shape["vocab"], shape["successors"])
    model.train().sparse_gradients = True
    batch = common.ZipfPaths(graph, seed=1).batch(args.batch or shape["batch"], args.length or shape["length"])
    rows = []
    for name in ("off", "on"):
        if name == "on":
            model.gradient_checkpointing_enable()
        kept, times = saved_bytes(model, batch), []
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            model(batch, labels=batch, return_logits=False).loss.backward()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        rows.append(dict(checkpointing=name, kept_mb=kept / 2**20, step_ms=statistics.median(times[1:]) * 1e3))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def shape_rows(args, argv) -> list[dict]:
    """Each shape's rows from a subprocess of its own (its peak memory is its own), given this command line."""
    rows = []
    for shape in ["small", "paper"] if args.shape == "all" else [args.shape]:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", "--shape", shape],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{shape}: the child failed\n{proc.stderr[-3000:]}")
        rows += json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["paper", "small", "all"], default="all")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--length", type=int)
    parser.add_argument("--objective", choices=list(OBJECTIVES) + ["all"], default="all")
    parser.add_argument("--grads", choices=["sparse", "dense"], default="sparse",
                        help="sparse: model.sparse_gradients and SparseAdamW; dense: torch.optim.AdamW")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing off and on")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = common.add_results_dir(parser, wait_quiet=True).parse_args(argv)
    torch.set_num_threads(args.threads)
    args.objective = list(OBJECTIVES) if args.objective == "all" else [args.objective]
    if args.child:
        print("RESULT " + json.dumps(run_shape(args, args.shape)), flush=True)
        return
    print(f"# machine: {common.machine()}")
    if args.checkpointing:
        args.shape = "paper" if args.shape == "all" else args.shape
        figures = dict(checkpointing=checkpointing_rows(args))
    else:
        figures = dict(rows=shape_rows(args, sys.argv[1:] if argv is None else argv))
    common.write_record("train_throughput", args, figures, argv=argv)


if __name__ == "__main__":
    main()
