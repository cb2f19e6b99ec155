"""The GPU kernels beside the torch path: the candidate energies of a training step, and the decode step.

    python benchmarks/gpu_kernels.py                       # on a CUDA machine: both parts, paper shape
    python benchmarks/gpu_kernels.py --part energies --batches 32x32 1024x64
    python benchmarks/gpu_kernels.py --part decode --decode-batches 1 32 256 --long 20000
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke    # CPU: tiny shape, checks the script runs

Energies: make_plan + candidate_energies + target_energies + exact_log_partition, forward and backward (sparse row
gradients), for each backend in one process: median ms, CUDA launches, host synchronisations, the relative difference
of loss and gradients, and the fraction of the bandwidth floor (touched edge rows read forward, read and written
backward). Decode: greedy energy_generate tokens/s with decode_mode off / eager / auto (captured), then the per-token
time of a `--long` generation at batch 1 in windows of 1,000 tokens.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, ZipfPaths, add_results_dir, make_model, write_record  # noqa: E402

from modeling_brillm.backend import kernel_backend  # noqa: E402
from modeling_brillm.ops import (  # noqa: E402  (the dispatcher: kernel_backend picks the path)
    candidate_energies,
    exact_log_partition,
    make_plan,
    target_energies,
)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GB buffer."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(256 * 2**20, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    sync(device)
    return 2 * a.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3)


def energies_pass(model, tokens, x, pe, backend):
    """One forward + backward of the exact loss's candidate part; returns (loss, grads)."""
    V = model.config.vocab_size
    indptr, indices = model.csr()
    sources, targets = tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)
    w, b = model.base_model.weights, model.base_model.biases
    xs = x.detach().requires_grad_()
    with kernel_backend(backend):
        plan = make_plan(sources, indptr, indices, V)
        src, tgt = sources[plan.order], targets[plan.order]
        energies, shared = candidate_energies(xs[plan.order], pe[plan.order], w, b, plan, True)
        rows = model.edge_rows(src, tgt)
        true = target_energies(energies, shared, plan, tgt, rows, indptr[src] + 1)
        loss = (exact_log_partition(energies, shared, plan, V) - true).mean()
        loss.backward()
    grads = (w.grad, b.grad, xs.grad)
    w.grad = b.grad = None
    return loss.detach(), grads


def timed(fn, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def count_launches(fn, device) -> int:
    if device.type != "cuda":
        return -1
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def count_syncs(fn, device) -> int:
    if device.type != "cuda":
        return -1
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def rel(a, b) -> float:
    a = a.to_dense() if a.is_sparse else a
    b = b.to_dense() if b.is_sparse else b
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def run_energies(args, device, bandwidth):
    shape = SHAPES[args.shape]
    model, graph = make_model(shape["vocab"], shape["successors"])
    model.to(device)
    paths = ZipfPaths(graph, seed=1)
    d = model.config.node_size
    print(f"\ncandidate energies, {args.shape} shape (V {shape['vocab']}, {shape['successors']} successors, d {d}), "
          "exact loss, sparse row gradients")
    print(f"{'batch':>9} {'backend':>8} {'ms fwd+bwd':>11} {'launches':>9} {'syncs':>6} {'floor ms':>9} "
          f"{'of floor':>9} {'loss rel':>9} {'grad rel':>9}")
    rows = []
    for spec in args.batches:
        B, L = (int(v) for v in spec.split("x"))
        tokens = paths.batch(B, L).to(device)
        N = B * (L - 1)
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.rand(N, d, generator=g) * 0.5).to(device)
        pe = model.base_model.position_encoding(torch.arange(1, L, device=device).repeat(B)).float()
        touched = int(graph.indptr.diff()[tokens[:, :-1].reshape(-1).unique().cpu()].sum())
        floor_s = 3 * touched * (d * d + d) * 4 / bandwidth  # read fwd, read bwd, write bwd (copy bw counts r+w)
        results = {}
        for backend in ("torch", "triton"):
            try:
                run = functools.partial(energies_pass, model, tokens, x, pe, backend)
                run()  # warm-up (compiles the kernels)
                sec = timed(run, device, args.repeats)
                results[backend] = (sec, count_launches(run, device), count_syncs(run, device), run())
            except Exception as error:  # keep measuring the rest
                print(f"{spec:>9} {backend:>8} failed: {type(error).__name__}: {error}")
        for backend, (sec, launches, syncs, (loss, grads)) in results.items():
            lr = gr = float("nan")
            if backend == "triton" and "torch" in results:
                ref_loss, ref_grads = results["torch"][3]
                lr = rel(loss, ref_loss)
                gr = max(rel(a, b) for a, b in zip(grads, ref_grads))
            print(f"{spec:>9} {backend:>8} {sec * 1e3:11.2f} {launches:9d} {syncs:6d} {floor_s * 1e3:9.2f} "
                  f"{floor_s / sec:9.1%} {lr:9.1e} {gr:9.1e}")
            rows.append(dict(batch=spec, backend=backend, ms=sec * 1e3, launches=launches, syncs=syncs,
                             floor_ms=floor_s * 1e3, of_floor=floor_s / sec, loss_rel=lr, grad_rel=gr))
        if len(results) == 2:
            print(f"{spec:>9} speed-up triton / torch: {results['torch'][0] / results['triton'][0]:.1f}x")
    del model
    return rows


def run_decode(args, device):
    shape = SHAPES[args.shape]
    model, graph = make_model(shape["vocab"], shape["successors"], position_overflow="extend")
    model.to(device).eval()
    paths = ZipfPaths(graph, seed=2)
    print(f"\ndecode, {args.shape} shape, greedy energy_generate, {args.steps} new tokens after a 16-token prompt")
    print(f"{'batch':>6} {'mode':>6} {'tokens/s':>11} {'ms/token':>9} {'same tokens':>12}")
    rows, long = [], None
    for B in args.decode_batches:
        prompt = paths.batch(B, 16).to(device)
        ref = None
        for mode in ("off", "eager", "auto"):
            model.decode_mode = mode
            try:
                run = functools.partial(model.energy_generate, prompt, max_new_tokens=args.steps, eos_token_id=[],
                                        num_alternatives=0, exclude_self_loops=False)
                out = run()  # warm-up: compiles, captures
                sec = timed(run, device, args.repeats)
                same = "" if ref is None else str(torch.equal(out.sequences, ref))
                ref = out.sequences if ref is None else ref
                print(f"{B:6d} {mode:>6} {B * args.steps / sec:11,.0f} {sec / args.steps * 1e3:9.3f} {same:>12}")
                rows.append(dict(batch=B, mode=mode, tokens_per_s=B * args.steps / sec,
                                 ms_per_token=sec / args.steps * 1e3, same_tokens=same or None))
            except Exception as error:
                print(f"{B:6d} {mode:>6} failed: {type(error).__name__}: {error}")
        model.decode_mode = "auto"
    if args.long:
        prompt = paths.batch(1, 16).to(device)
        model.decode_mode = "auto"
        out = model(prompt, use_cache=True, logits_to_keep=1)
        token, past = out.logits[:, -1].argmax(-1), out.state
        window, marks = 1000, []
        with torch.inference_mode():
            sync(device)
            t0 = time.perf_counter()
            for i in range(args.long):
                out = model(token[:, None], cache=past, use_cache=True, logits_to_keep=1,
                            generation_step=True)
                past, token = out.state, out.logits[:, -1].argmax(-1)
                if (i + 1) % window == 0:
                    sync(device)
                    marks.append(time.perf_counter())
        times = [(b - a) / window * 1e3 for a, b in zip([t0] + marks, marks)]
        print(f"\nbatch 1, {args.long} tokens (generation_step loop, captured): ms/token per {window}-token window: "
              f"first {times[0]:.3f}, median {statistics.median(times):.3f}, last {times[-1]:.3f}, "
              f"max {max(times):.3f}")
        long = dict(tokens=args.long, window=window, ms_per_token=times)
    return dict(rows=rows, long_generation=long)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["energies", "decode", "both"], default="both")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="paper")
    parser.add_argument("--batches", nargs="+", default=["32x32", "256x64", "1024x64"])
    parser.add_argument("--decode-batches", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=256, help="decoded tokens per energy_generate call")
    parser.add_argument("--long", type=int, default=20000, help="tokens of the long generation (0 = skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (Triton interpreter)")
    args = add_results_dir(parser).parse_args()
    if args.smoke:
        SHAPES["tiny"] = dict(vocab=40, successors=6, batch=2, length=8)
        args.shape, args.batches, args.decode_batches = "tiny", ["2x8"], [2]
        args.steps, args.long, args.repeats = 4, 0, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the exactness comparison is fp32 against fp32
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    bandwidth = copy_bandwidth(device)
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    if device.type != "cuda" and not args.smoke:
        print("no GPU: run with --smoke to check the script under Triton's interpreter")
        return
    if device.type != "cuda":
        bandwidth = 1e10  # a nominal figure, so the floor column is defined
    figures = dict(device=name, bandwidth=bandwidth)
    if args.part in ("energies", "both"):
        figures["energies"] = run_energies(args, device, bandwidth)
    if args.part in ("decode", "both"):
        figures["decode"] = run_decode(args, device)
    write_record("gpu_kernels", args, figures)


if __name__ == "__main__":
    main()
