"""Training throughput: tokens/s of forward + backward + optimizer step and peak memory; how the cost scales
(--sweep); the activation memory gradient checkpointing saves (--checkpointing).

    python benchmarks/train_throughput.py                      # both shapes, all objectives, + reference
    python benchmarks/train_throughput.py --shape small --grads dense --no-reference   # dense grads + torch AdamW
    python benchmarks/train_throughput.py --sweep successors            # around the small shape, one knob at a time
    python benchmarks/train_throughput.py --checkpointing --shape paper --batch 8 --length 256

Shapes (common.py's synthetic graphs and Zipf paths): paper (V 4000, d 32, 227 successors, 0.959B parameters) and
small (V 1000, 100 successors, 106M), batch 32 x 32 (--batch, --length). Objectives: exact (the full softmax), freq /
uniform (K=400 negatives by frequency / uniformly). Each shape runs in a subprocess of its own, so its peak memory (the
resident high-water mark) is its own; tokens/s is B x L over the median step. --reference (small shape): also
reference_impl.py's per-candidate loop on the same batch. --sweep batch|length|successors|vocab|all: the small shape
with one knob changed (SparseAdamW): tokens/s, step time and the edge rows a step touches (the successors of a batch's
distinct sources, plus row 0). --checkpointing: the bytes autograd keeps for the backward (distinct storages,
parameters excluded) and the forward + backward time, model.gradient_checkpointing_enable() off and on.
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
SWEEPS = {"batch": [8, 16, 32, 64, 128], "length": [16, 32, 64, 128], "successors": [25, 50, 100, 200, 400],
          "vocab": [500, 1000, 2000, 4000]}


def set_objective(model, name):
    for key, value in OBJECTIVES[name].items():
        setattr(model.config, key, value)


def timed_steps(model, optimizer, paths, B, L, args):
    """(step seconds, (forward, backward, optimizer) seconds, distinct sources) of each timed step; the load others put
    on the CPUs meanwhile; the last loss."""
    times, monitor = [], common.CpuMonitor()
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
    """The per-candidate reference, last, so that the peak memory above is ours alone; its first step sees our
    parameters, so its loss equals ours (but for uniform negatives, which are random)."""
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
        row.update(reference_tokens_per_s=B * L / min(seconds), ratio=row["tokens_per_s"] * min(seconds) / (B * L),
                   reference_loss_matches=None if row["objective"] == "uniform"
                   else abs(losses[0] - ours) <= 1e-4 * max(1.0, abs(ours)))


def run_shape(args, shape_name) -> list[dict]:
    from modeling_brillm.optimization import SparseAdamW

    shape = common.SHAPES[shape_name]
    model, graph = common.make_model(shape["vocab"], shape["successors"])
    model.sparse_gradients = args.grads == "sparse"
    optimizer = (SparseAdamW if model.sparse_gradients else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    paths, B, L = common.ZipfPaths(graph, seed=1), args.batch or shape["batch"], args.length or shape["length"]
    rows = []
    for objective in args.objective:
        set_objective(model, objective)
        if args.wait_quiet:
            common.wait_for_quiet()
        times, load, loss = timed_steps(model, optimizer, paths, B, L, args)
        fwd, bwd, opt = (statistics.median(p[i] for _, p, _ in times) for i in range(3))
        rows.append(dict(shape=shape_name, objective=objective, grads=args.grads,
                         params=sum(p.numel() for p in model.parameters()),
                         tokens_per_s=B * L / statistics.median(t for t, _, _ in times), forward_s=fwd, backward_s=bwd,
                         optimizer_s=opt, peak_rss_gb=common.peak_rss_gb(), other_cpu_load=load, loss=loss))
    if args.reference and shape_name == "small":
        reference_rows(args, model, paths, rows, B, L)
    return rows


def sweep_rows(args) -> list[dict]:
    from modeling_brillm.optimization import SparseAdamW

    rows = []
    for name in SWEEPS if args.sweep == "all" else [args.sweep]:
        for value in SWEEPS[name]:
            cfg = dict(common.SHAPES["small"], **{name: value})
            model, graph = common.make_model(cfg["vocab"], cfg["successors"])
            model.sparse_gradients = True
            if args.wait_quiet:
                common.wait_for_quiet()
            times, load, _ = timed_steps(model, SparseAdamW(model.parameters(), lr=1e-3),
                                         common.ZipfPaths(graph, seed=1), cfg["batch"], cfg["length"], args)
            step_s = statistics.median(t for t, _, _ in times)
            rows.append(dict(cfg, sweep=name, params=sum(p.numel() for p in model.parameters()), step_ms=1e3 * step_s,
                             tokens_per_s=cfg["batch"] * cfg["length"] / step_s, other_cpu_load=load,
                             touched_rows=statistics.mean(n for _, _, n in times) * cfg["successors"] + 1))
            print(json.dumps(rows[-1]), flush=True)
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


def shape_rows(args) -> list[dict]:
    """Each shape's rows from a subprocess of its own (its peak memory is its own)."""
    rows = []
    for shape in ["small", "paper"] if args.shape == "all" else [args.shape]:
        flags = ["--child", "--shape", shape, "--grads", args.grads, "--steps", str(args.steps), "--warmup",
                 str(args.warmup), "--lr", str(args.lr), "--reference-steps", str(args.reference_steps), "--threads",
                 str(args.threads), "--objective", args.objective[0] if len(args.objective) == 1 else "all"]
        flags += [f"--{k}={getattr(args, k)}" for k in ("batch", "length") if getattr(args, k)]
        flags += ["--no-reference"] * (not args.reference) + ["--no-wait-quiet"] * (not args.wait_quiet)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *flags], capture_output=True, text=True)
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
    parser.add_argument("--sweep", choices=list(SWEEPS) + ["all"], help="scale one knob around the small shape")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing off and on")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument("--reference-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-wait-quiet", dest="wait_quiet", action="store_false",
                        help="do not wait (up to 5 min) for other processes to leave the CPUs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = common.add_results_dir(parser).parse_args(argv)
    torch.set_num_threads(args.threads)
    args.objective = list(OBJECTIVES) if args.objective == "all" else [args.objective]
    if args.child:
        print("RESULT " + json.dumps(run_shape(args, args.shape)), flush=True)
        return
    print(f"# machine: {common.machine()}")
    if args.sweep:
        figures = dict(sweep=sweep_rows(args))
    elif args.checkpointing:
        args.shape = "paper" if args.shape == "all" else args.shape
        figures = dict(checkpointing=checkpointing_rows(args))
    else:
        figures = dict(rows=shape_rows(args))
    common.write_record("train_throughput", args, figures, argv=argv)


if __name__ == "__main__":
    main()
