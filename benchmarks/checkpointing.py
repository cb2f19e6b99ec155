"""Gradient checkpointing: activation memory a training step keeps for its backward, and the step's time.

    python benchmarks/checkpointing.py                 # the paper's shape (V 4000, 227 successors, d 32), 32 x 32
    python benchmarks/checkpointing.py --shape small --batch 64 --length 128

With `model.gradient_checkpointing_enable()` the recurrence keeps no per-column tensors (gathered edge matrices,
edge outputs, mix states) for the backward and recomputes them there; the candidate energies keep theirs. The
kept bytes are counted exactly with `torch.autograd.graph.saved_tensors_hooks` (distinct storages, parameters
excluded); the time is the median of a few forward + backward passes, both settings side by side in one run.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, ZipfPaths, add_results_dir, machine, make_model, write_record


def saved_bytes(model, batch) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch, labels=batch, return_logits=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step_time(model, batch, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model(batch, labels=batch, return_logits=False).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="paper")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = add_results_dir(parser).parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    B, L = args.batch or shape["batch"], args.length or shape["length"]
    model, graph = make_model(shape["vocab"], shape["successors"])
    model.train().sparse_gradients = True
    batch = ZipfPaths(graph, seed=1).batch(B, L)
    print(f"{machine()}; shape {args.shape} (V {shape['vocab']}, {shape['successors']} successors, d 32), "
          f"batch {B} x {L}, exact loss, sparse gradients, {args.threads} threads")
    rows = {}
    for name in ("off", "on"):
        if name == "on":
            model.gradient_checkpointing_enable()
        rows[name] = saved_bytes(model, batch), step_time(model, batch, args.repeats)
    print(f"{'checkpointing':>13} {'kept for backward':>18} {'step (fwd+bwd)':>15}")
    for name, (kept, sec) in rows.items():
        print(f"{name:>13} {kept / 2**20:>15.1f} MB {sec * 1e3:>12.0f} ms")
    (off_b, off_s), (on_b, on_s) = rows["off"], rows["on"]
    print(f"saves {(off_b - on_b) / 2**20:.1f} MB ({1 - on_b / off_b:.0%} of the kept activations) "
          f"at {on_s / off_s:.2f}x the step time")
    write_record("checkpointing", args, dict(batch=B, length=L, rows=[
        dict(checkpointing=name, kept_mb=kept / 2**20, step_ms=sec * 1e3) for name, (kept, sec) in rows.items()]))


if __name__ == "__main__":
    main()
