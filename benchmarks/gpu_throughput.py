"""GPU throughput: the torch path and the Triton kernels side by side in one run.

    python benchmarks/gpu_throughput.py                                  # on a GPU: the whole table
    python benchmarks/gpu_throughput.py --shape paper --batches 1024x64 --objective exact --optimizer sparse_adamw
    python benchmarks/gpu_throughput.py --device cpu --shape tiny        # smoke test without a GPU

Training, per shape ("paper" = V 4000, 227 successors, d 32, 0.96B parameters; "small" = V 1000, 100 successors;
"tiny" = V 64, 8 successors, d 8), batch x length, objective (exact; sampled: K=400 frequency negatives), optimizer
(sparse_adamw; sparse_adamw_bf16: bfloat16 moments; adamw: dense gradients, fused AdamW) and backend (torch, triton),
on the same model and benchmarks/common.py's Zipf paths: tokens/s over the median step (forward, backward, optimizer,
zero_grad, the device synchronised around it); launches in one step (CUDA kernels; on a CPU the aten ops dispatched
from Python, autograd or a custom function); busy (kernel time over step time); peak GB; the bandwidth floor (bytes
a step must move over the copy bandwidth measured here: with R the touched edge rows and P all rows, each (d² + d)·4
bytes, sparse_adamw moves 10·R rows, bf16 moments 8·R, adamw 3·R + 8·P) and the fraction of it reached. Decoding:
greedy and sampled generate() at each --decode-batches size, tokens/s per backend, and the per-token time over the
first and last tenth of one --long-tokens generation (position_overflow="extend"). On a CPU the Triton column runs in
Triton's interpreter: its times are no speed figures (rows flagged "interpreted").
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time

import torch


def _device_arg(argv) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return pre.parse_known_args(argv)[0].device


# On a CPU the Triton column runs in Triton's interpreter, which must be chosen before triton is first imported
# (transformers imports torch._dynamo, which imports triton, so before `common` below).
if not _device_arg(sys.argv[1:]).startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ZipfPaths, add_results_dir, machine, make_model, peak_rss_gb, write_record  # noqa: E402

SHAPES = {
    # name: vocab, successors per node, node size
    "paper": dict(vocab=4000, successors=227, node_size=32),
    "small": dict(vocab=1000, successors=100, node_size=32),
    "tiny": dict(vocab=64, successors=8, node_size=8),
}
OPTIMIZERS = ("sparse_adamw", "sparse_adamw_bf16", "adamw")
OBJECTIVES = ("exact", "sampled")


def parse_batches(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]
    except ValueError:
        raise SystemExit(f"--batches takes BxL items separated by commas, e.g. 32x32,1024x64; got {text!r}") from None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), the floor's yardstick."""
    n = (256 << 20) if device.type == "cuda" else (16 << 20)  # 1 GB of float32 on a GPU, 64 MB on a CPU
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / min(times)


def floor_bytes(model, batch: torch.Tensor, optimizer: str) -> int:
    """Bytes a training step must move at least (module docstring)."""
    d = model.config.node_size
    row = (d * d + d) * 4
    indptr, _ = model.csr()
    degree = indptr.diff().cpu()
    sources = torch.unique(batch[:, :-1].cpu())
    R = int(degree[sources].sum()) + (1 if model.config.graph == "sparse" else 0)
    P = model.base_model.weights.shape[0]
    rows = {"sparse_adamw": 10 * R, "sparse_adamw_bf16": 8 * R}.get(optimizer, 3 * R + 8 * P)
    return row * rows


def profile_step(step, device) -> tuple[int, float]:
    """(launches, summed kernel seconds) of one call of `step` under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) * 1e-6
    # aten ops called from Python, autograd or a custom autograd function (not from inside another aten op) that
    # compute something (views and allocations launch no kernel)
    ops = [e for e in events if e.name.startswith("aten::") and e.name[6:] not in _NO_KERNEL
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(ops), float("nan")


_NO_KERNEL = {"view", "slice", "select", "as_strided", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
              "reshape", "_reshape_alias", "unbind", "split", "split_with_sizes", "chunk", "narrow", "detach", "alias",
              "lift_fresh", "empty", "empty_like", "empty_strided", "resize_", "to", "_to_copy_noop", "numpy_T",
              "_unsafe_view", "contiguous", "result_type", "is_nonzero", "item", "_local_scalar_dense", "size",
              "stride", "dim", "set_"}


def set_objective(model, objective):
    model.config.loss_type = "exact" if objective == "exact" else "sampled"
    if objective == "sampled":
        model.config.num_negatives = min(400, model.config.vocab_size // 2)
        model.config.negative_sampling = "frequency"


def train_row(args, model, batches, device, B, L, objective, optimizer_name, backend, bandwidth):
    from modeling_brillm.backend import kernel_backend
    from modeling_brillm.optimization import SparseAdamW

    set_objective(model, objective)
    sparse = optimizer_name.startswith("sparse_adamw")
    model.sparse_gradients = sparse
    params = list(model.parameters())
    if sparse:
        moments = "bfloat16" if optimizer_name.endswith("bf16") else "float32"
        optimizer = SparseAdamW(params, lr=1e-3, moment_dtype=moments)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    it = iter(range(1 << 30))

    def step():
        batch = batches[next(it) % len(batches)]
        loss = model(input_ids=batch, labels=batch, return_logits=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    times = []
    with kernel_backend(backend):
        for k in range(args.warmup + args.steps):
            sync(device)
            t0 = time.perf_counter()
            loss = step()
            sync(device)
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
        launches, kernel_s = profile_step(step, device) if args.profile else (None, float("nan"))
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else peak_rss_gb()
    floor_s = floor_bytes(model, batches[0], optimizer_name) / bandwidth
    row = dict(kind="train", B=B, L=L, objective=objective, optimizer=optimizer_name, backend=backend,
               tokens_per_s=B * L / step_s, step_ms=step_s * 1e3, launches=launches,
               busy=kernel_s / step_s, peak_gb=peak, floor_ms=floor_s * 1e3, of_floor=floor_s / step_s,
               loss=float(loss.detach()), interpreted=backend == "triton" and device.type != "cuda")
    optimizer = None  # free the moments before the next row
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


class _Clock:
    """A logits processor that only records when generate() asks for each new token."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def decode_rows(args, model, paths, device, backend):
    from transformers import LogitsProcessorList

    from modeling_brillm.backend import kernel_backend

    rows = []
    model.eval()
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with kernel_backend(backend), torch.inference_mode():
        for B, sampled in ((B, sampled) for B in args.decode_batches for sampled in (False, True)):
            prompt, N, how = paths.batch(B, 8).to(device), args.decode_tokens, dict(common, do_sample=sampled)
            model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **how)  # warm-up (compiles kernels)
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=N, min_new_tokens=N, **how)
            sync(device)
            seconds = time.perf_counter() - t0
            assert out.shape == (B, 8 + N)
            rows.append(dict(kind="decode", B=B, sampled=sampled, new_tokens=N, backend=backend,
                             tokens_per_s=B * N / seconds, interpreted=backend == "triton" and device.type != "cuda"))
        if args.long_tokens:
            overflow = model.config.position_overflow
            model.config.position_overflow = "extend"
            clock = _Clock()
            N = args.long_tokens
            prompt = paths.batch(1, 8).to(device)
            try:
                model.generate(prompt, max_new_tokens=N, min_new_tokens=N,
                               logits_processor=LogitsProcessorList([clock]), **common)
            finally:
                model.config.position_overflow = overflow
            gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
            tenth = max(1, len(gaps) // 10)
            first, last = statistics.mean(gaps[:tenth]), statistics.mean(gaps[-tenth:])
            rows.append(dict(kind="long", B=1, new_tokens=N, backend=backend, first_ms=first * 1e3,
                             last_ms=last * 1e3, last_over_first=last / first,
                             interpreted=backend == "triton" and device.type != "cuda"))
    model.train()
    return rows


def run_shape(args, name, device, bandwidth):
    shape = SHAPES[name]
    torch.manual_seed(0)
    model, graph = make_model(shape["vocab"], shape["successors"], node_size=shape["node_size"],
                              non_edge_bias=args.non_edge_bias)
    model.generation_config.pad_token_id = 0
    model.to(device)
    paths = ZipfPaths(graph, seed=1)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for B, L in args.batches:
        batches = [paths.batch(B, L).to(device) for _ in range(min(4, args.warmup + args.steps))]
        for optimizer_name, objective, backend in itertools.product(args.optimizer, args.objective, args.backends):
            rows.append(dict(train_row(args, model, batches, device, B, L, objective, optimizer_name, backend,
                                       bandwidth), shape=name, params=params))
            print(json.dumps(rows[-1]), flush=True)
        del batches
    for backend in args.backends if args.decode_batches or args.long_tokens else []:
        for row in decode_rows(args, model, paths, device, backend):
            rows.append(dict(row, shape=name, params=params))
            print(json.dumps(rows[-1]), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def fmt(value, spec, missing="-"):
    if value is None or (isinstance(value, float) and value != value):
        return missing
    return format(value, spec)


def print_tables(rows, device_name):
    train = [r for r in rows if r["kind"] == "train"]
    if train:
        print(f"\n## Training ({device_name})")
        print("| shape | B x L | objective | optimizer | backend | tokens/s | step ms | x torch | launches | busy | "
              "peak GB | floor ms | of floor |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in train:
            ref = next((t for t in train if t["backend"] == "torch" and all(
                t[k] == r[k] for k in ("shape", "B", "L", "objective", "optimizer"))), None)
            speedup = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            flag = " (interpreted: not a speed figure)" if r["interpreted"] else ""
            print(f"| {r['shape']} | {r['B']}x{r['L']} | {r['objective']} | {r['optimizer']} | {r['backend']}{flag} | "
                  f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.2f} | {fmt(speedup, '.2f')} | "
                  f"{fmt(r['launches'], ',')} | "
                  f"{fmt(r['busy'], '.0%')} | {r['peak_gb']:.2f} | {r['floor_ms']:.3f} | {r['of_floor']:.1%} |")
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        print(f"\n## Decoding, generate() ({device_name})")
        print("| shape | batch | decoding | backend | new tokens/row | tokens/s |")
        print("|---|---|---|---|---|---|")
        for r in decode:
            flag = " (interpreted)" if r["interpreted"] else ""
            print(f"| {r['shape']} | {r['B']} | {'sampled' if r['sampled'] else 'greedy'} | {r['backend']}{flag} | "
                  f"{r['new_tokens']} | {r['tokens_per_s']:,.0f} |")
    long = [r for r in rows if r["kind"] == "long"]
    if long:
        print("\n## One long generation, batch 1: per-token time over the first and the last tenth")
        print("| shape | backend | tokens | first ms/token | last ms/token | last / first |")
        print("|---|---|---|---|---|---|")
        for r in long:
            flag = " (interpreted)" if r["interpreted"] else ""
            print(f"| {r['shape']} | {r['backend']}{flag} | {r['new_tokens']:,} | {r['first_ms']:.3f} | "
                  f"{r['last_ms']:.3f} | {r['last_over_first']:.2f} |")


def main(argv=None):
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if on_gpu else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES) + ["all"], default=None,
                        help="default: paper and small on a GPU, tiny on a CPU")
    parser.add_argument("--batches", default=None, help="BxL list (default 32x32,256x64,1024x64; 2x8 on a CPU)")
    parser.add_argument("--objective", choices=list(OBJECTIVES) + ["all"], default="all")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS) + ["all"], default="all")
    parser.add_argument("--backends", default="torch,triton", help="comma list of torch, triton")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5 on a GPU, 1 on a CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2 on a GPU, 1 on a CPU)")
    parser.add_argument("--decode-batches", default=None, help="comma list (default 1,32,256; 1 on a CPU; '' = none)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="new tokens per row (default 256; 4 on a CPU)")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help="tokens of the long generation (default 20000 on a GPU, 16 on a CPU; 0 = none)")
    parser.add_argument("--non-edge-bias", action="store_true",
                        help="the model the demo preset trains (a learned energy per non-successor; exact loss only)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", default=True)
    args = add_results_dir(parser).parse_args(argv)
    device = torch.device(args.device)
    shapes = settle(args, device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as the exactness checks use it
        torch.backends.cudnn.allow_tf32 = False
        device_name = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    else:
        device_name = machine()
    bandwidth = copy_bandwidth(device)
    print(f"# {device_name}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
    rows = [row for name in shapes for row in run_shape(args, name, device, bandwidth)]
    print_tables(rows, device_name)
    write_record("gpu_throughput", args, dict(device=device_name, bandwidth=bandwidth, rows=rows), argv=argv)
    return rows


def settle(args, gpu: bool) -> list[str]:
    """The command line's defaults for the device (a GPU: the whole table; a CPU: a smoke test); the shapes."""
    args.backends = [b for b in args.backends.split(",") if b]
    if any(b not in ("torch", "triton") for b in args.backends):
        raise SystemExit(f"--backends takes torch and/or triton, got {args.backends}")
    from modeling_brillm.backend import HAVE_TRITON, interpreting

    if "triton" in args.backends and not gpu and not interpreting():
        raise SystemExit("the triton column on a CPU needs Triton's interpreter: run with TRITON_INTERPRET=1 (this "
                         "script sets it when the command line says --device cpu), or --backends torch")

    if "triton" in args.backends and not HAVE_TRITON:
        print("# triton is not installed: the triton column is skipped (pip install triton)")
        args.backends = [b for b in args.backends if b != "triton"]
    shapes = args.shape or ("all" if gpu else "tiny")
    shapes = ["paper", "small"] if shapes == "all" else [shapes]
    args.batches = parse_batches(args.batches or ("32x32,256x64,1024x64" if gpu else "2x8"))
    args.objective = list(OBJECTIVES) if args.objective == "all" else [args.objective]
    if args.non_edge_bias and "sampled" in args.objective:  # the model refuses the sampled loss with the bias
        print("# --non-edge-bias: the sampled objective is skipped (the bias needs the exact loss)")
        args.objective = [o for o in args.objective if o != "sampled"]
    args.optimizer = list(OPTIMIZERS) if args.optimizer == "all" else [args.optimizer]
    args.steps = args.steps if args.steps is not None else (5 if gpu else 1)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    decode = args.decode_batches if args.decode_batches is not None else ("1,32,256" if gpu else "1")
    args.decode_batches = [int(b) for b in decode.split(",") if b]
    args.decode_tokens = args.decode_tokens or (256 if gpu else 4)
    args.long_tokens = args.long_tokens if args.long_tokens is not None else (20000 if gpu else 16)
    return shapes


if __name__ == "__main__":
    main()
