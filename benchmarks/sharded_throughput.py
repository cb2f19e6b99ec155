"""Source-sharded training against DDP and one process, side by side on the same synthetic batches.

    python benchmarks/sharded_throughput.py                       # both shapes
    python benchmarks/sharded_throughput.py --shape text --steps 8

Modes, each in fresh processes (so peak memory is its own): single-sparse (1 process, 2 threads, SparseAdamW),
single-dense (fused torch AdamW), single-sparse-1t (1 thread), ddp (2 gloo processes of 1 thread, DDP + dense AdamW:
pretrain.py's default path), sharded (2 processes, ShardedBriLLM + SparseAdamW: --edge_sharding source). The global
batch is the same in every mode. tokens/s: global batch x length over the median step; CPU s/step: each process's own
CPU time; bytes sent per step and process: the sharded transport's count, for DDP the ring all-reduce of the dense
gradient, 2 (W-1)/W x 4 B x parameters (arithmetic); peak memory: each process's resident high-water mark. Shapes:
"paper" (V 4000, 227 successors, batch 32 x 32; DDP needs ~19 GB a process and is skipped unless --ddp-paper) and
"text" (V 2000, 48 successors, like a real 2000-token BPE corpus's graph, batch 64 x 64).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ZipfPaths, add_results_dir, machine, make_model, peak_rss_gb, wait_for_quiet, write_record  # noqa: E402

SHAPES = {
    "paper": dict(vocab=4000, successors=227, batch=32, length=32),
    "text": dict(vocab=2000, successors=48, batch=64, length=64),
}


def _batches(graph, shape, steps):
    paths = ZipfPaths(graph, seed=1)
    return [paths.batch(shape["batch"], shape["length"]) for _ in range(steps)]


def _rank_main(rank, world, mode, shape_name, steps, warmup, init_file, out_dir):
    torch.set_num_threads(1 if world > 1 or mode.endswith("-1t") else 2)
    from modeling_brillm.optimization import SparseAdamW

    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    model, graph = make_model(shape["vocab"], shape["successors"])
    batches = _batches(graph, shape, warmup + steps)
    rows = torch.arange(shape["batch"]).tensor_split(world)[rank]
    P = sum(p.numel() for p in model.parameters())
    sharded = None
    if mode == "sharded":
        from modeling_brillm.sharding import ShardedBriLLM

        sharded = ShardedBriLLM(model)
        optimizer = SparseAdamW(sharded.parameter_groups(), lr=1e-3)
        step_fn = sharded
    elif mode.startswith("single-sparse"):
        model.sparse_gradients = True
        optimizer = SparseAdamW(model.parameters(), lr=1e-3)
        step_fn = model
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step_fn = model
        if mode == "ddp":
            step_fn = torch.nn.parallel.DistributedDataParallel(model)
    times, sent, cpu = [], [], []
    for i, tokens in enumerate(batches):
        ids = tokens[rows]
        if world > 1:
            torch.distributed.barrier()
        before = sharded.bytes_sent if sharded is not None else 0
        t0, c0 = time.perf_counter(), time.process_time()
        if sharded is not None:
            out = sharded(ids, labels=ids)
            out.loss.backward()
            sharded.reduce_gradients()
        else:
            out = step_fn(input_ids=ids, labels=ids, return_logits=False)
            out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            sent.append(sharded.bytes_sent - before if sharded is not None
                        else (2 * (world - 1) / world * 4 * P if world > 1 else 0))
    result = {"rank": rank, "median_s": statistics.median(times), "cpu_s": statistics.median(cpu),
              "bytes_per_step": statistics.median(sent),
              "peak_gb": peak_rss_gb(), "params": P,
              "local_rows": int(sharded.model.base_model.weights.shape[0]) if sharded is not None
                            else int(model.base_model.weights.shape[0])}
    with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        torch.distributed.destroy_process_group()


def run_mode(mode, shape_name, steps, warmup):
    world = 2 if mode in ("ddp", "sharded") else 1
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--shape", shape_name,
               "--steps", str(steps), "--warmup", str(warmup), "--out", tmp]
        env = dict(os.environ, OMP_NUM_THREADS="1" if world > 1 or mode.endswith("-1t") else "2")
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"mode": mode, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        ranks = [json.load(open(os.path.join(tmp, f"{mode}-{r}.json"))) for r in range(world)]
    shape = SHAPES[shape_name]
    step = max(r["median_s"] for r in ranks)
    return {"mode": mode, "processes": world, "tokens_per_s": shape["batch"] * shape["length"] / step,
            "step_s": step, "cpu_s": [round(r.get("cpu_s", float("nan")), 3) for r in ranks],
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
            "peak_gb": [round(r["peak_gb"], 2) for r in ranks], "local_rows": [r["local_rows"] for r in ranks],
            "wall_s": time.perf_counter() - started}


def worker(args):
    world = 2 if args.worker in ("ddp", "sharded") else 1
    if world == 1:
        _rank_main(0, 1, args.worker, args.shape, args.steps, args.warmup, None, args.out)
        return
    import torch.multiprocessing as mp

    init_file = os.path.join(args.out, "init")
    mp.start_processes(_rank_main, args=(world, args.worker, args.shape, args.steps, args.warmup, init_file, args.out),
                       nprocs=world, join=True, start_method="spawn")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), nargs="+", default=["text", "paper"])
    p.add_argument("--modes", nargs="+", default=["single-sparse", "single-dense", "ddp", "sharded"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ddp-paper", action="store_true", help="Also run DDP at the paper shape (~38 GB of RAM).")
    p.add_argument("--no-wait-quiet", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = add_results_dir(p).parse_args()
    if args.worker:
        args.shape = args.shape[0] if isinstance(args.shape, list) else args.shape
        return worker(args)
    print(machine())
    figures = {}
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        print(f"\nshape {shape_name}: V={shape['vocab']}, {shape['successors']} successors, d=32, "
              f"batch {shape['batch']} x {shape['length']}")
        print(f"{'mode':<16} {'procs':>5} {'tokens/s':>10} {'step s':>8} {'CPU s/step per proc':>20} "
              f"{'MB sent/step/proc':>18} {'peak GB per process':>22} {'edge rows per process':>24} {'other load':>10}")
        results = []
        for mode in args.modes:
            if mode == "ddp" and shape_name == "paper" and not args.ddp_paper:
                print(f"{mode:<14} skipped: 2 x ~19 GB does not fit this machine (--ddp-paper to try)")
                continue
            load = float("nan") if args.no_wait_quiet else wait_for_quiet()
            r = run_mode(mode, shape_name, args.steps, args.warmup)
            if "error" in r:
                print(f"{mode:<14} failed: {r['error']}")
                continue
            results.append(dict(r, other_cpu_load=load))
            print(f"{mode:<16} {r['processes']:>5} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
                  f"{str(r['cpu_s']):>20} {r['bytes_per_step'] / 1e6:>18,.1f} {str(r['peak_gb']):>22} "
                  f"{str(r['local_rows']):>24} "
                  f"{load:>10.2f}", flush=True)
        by = {r["mode"]: r for r in results}
        if "sharded" in by:
            single = max((r["tokens_per_s"] for m, r in by.items() if m.startswith("single")), default=None)
            if single:
                print(f"sharded / best single process: {by['sharded']['tokens_per_s'] / single:.2f}x")
            if "ddp" in by:
                print(f"sharded / DDP: {by['sharded']['tokens_per_s'] / by['ddp']['tokens_per_s']:.2f}x")
        figures[shape_name] = dict(shape, modes=results)
    write_record("sharded_throughput", args, figures)


if __name__ == "__main__":
    main()
