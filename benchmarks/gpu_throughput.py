"""GPU throughput, the torch path and the Triton kernels side by side: training steps and decoding; or
(--default_batch SECONDS) pretrain.py's default step on the device (each figure: docs/gpu.md).

    python benchmarks/gpu_throughput.py                                  # on a GPU: the whole table
    python benchmarks/gpu_throughput.py --shape paper --batches 32x32,1024x64 --objective exact --optimizer sparse_adamw
    python benchmarks/gpu_throughput.py --shape paper --parts decode --decode_modes off,eager,auto
    python benchmarks/gpu_throughput.py --default_batch 60               # pretrain.py's default step, 60 s
    python benchmarks/gpu_throughput.py --device cpu --shape tiny        # without a GPU: the kernels interpreted
"""

import argparse
import gc
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# On a CPU the Triton column runs in Triton's interpreter, chosen before triton is first imported (transformers imports
# torch._dynamo, which imports triton: before `common`).
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
if not _pre.parse_known_args()[0].device.startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SHAPES = {"paper": dict(vocab=4000, successors=227, node_size=32),
          "small": dict(vocab=1000, successors=100, node_size=32), "tiny": dict(vocab=64, successors=8, node_size=8)}
OPTIMIZERS, OBJECTIVES = ("sparse_adamw", "sparse_adamw_bf16", "adamw"), ("exact", "sampled")
_NO_KERNEL = set("view slice select as_strided unsqueeze squeeze expand t transpose permute reshape _reshape_alias "
                 "unbind split split_with_sizes chunk narrow detach alias lift_fresh empty empty_like empty_strided "
                 "resize_ to _to_copy_noop numpy_T _unsafe_view contiguous result_type is_nonzero item "
                 "_local_scalar_dense size stride dim set_".split())  # aten ops that launch no kernel


def parse_batches(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]
    except ValueError:
        raise SystemExit(f"--batches takes BxL items separated by commas, e.g. 32x32,1024x64; got {text!r}") from None


def timed(fn, device, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        common.sync(device)
        t0 = time.perf_counter()
        fn()
        common.sync(device)
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device) -> float:
    """Bytes per second of a large copy (read + write counted): the floor's yardstick."""
    src = torch.ones((256 << 20) if device.type == "cuda" else (16 << 20), device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / min(timed(lambda: dst.copy_(src), device, 6))


def profile_step(step, device) -> tuple[int, float]:
    """(launches, summed kernel seconds) of one call of `step` under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")) as prof:
        step()
        common.sync(device)
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) * 1e-6
    # aten ops called from Python, autograd or a custom function (not inside another aten op) that compute something
    return len([e for e in prof.events() if e.name.startswith("aten::") and e.name[6:] not in _NO_KERNEL
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]), float("nan")


def train_row(args, model, batches, device, objective, optimizer_name, backend) -> dict:
    from modeling_brillm.backend import kernel_backend
    from modeling_brillm.optimization import SparseAdamW

    model.config.loss_type = objective
    model.config.num_negatives, model.config.negative_sampling = min(400, model.config.vocab_size // 2), "frequency"
    model.sparse_gradients = optimizer_name.startswith("sparse_adamw")
    optimizer = SparseAdamW(model.parameters(), lr=1e-3, moment_dtype="bfloat16" if "bf16" in optimizer_name else
                            "float32") if model.sparse_gradients else torch.optim.AdamW(model.parameters(), fused=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    it, last = itertools.count(), {}

    def step():
        batch = batches[next(it) % len(batches)]
        last["loss"] = model(input_ids=batch, labels=batch, return_logits=False).loss
        last["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with kernel_backend(backend):
        step_s = statistics.median(timed(step, device, args.warmup + args.steps)[args.warmup:])
        launches, kernel_s = profile_step(step, device) if args.profile else (None, float("nan"))
    floor_s = floor_bytes(model, batches[0], optimizer_name) / args.bandwidth
    B, L = batches[0].shape
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else common.peak_rss_gb()
    return dict(kind="train", B=B, L=L, objective=objective, optimizer=optimizer_name, backend=backend,
                tokens_per_s=B * L / step_s, step_ms=step_s * 1e3, launches=launches, busy=kernel_s / step_s,
                peak_gb=peak, floor_ms=floor_s * 1e3, of_floor=floor_s / step_s, loss=float(last["loss"].detach()))


def floor_bytes(model, batch: torch.Tensor, optimizer: str) -> int:
    """Bytes a step must move (docs/gpu.md): R edge rows touched, P in all, each (d² + d)·4 bytes."""
    d, (indptr, _) = model.config.node_size, model.csr()
    R = int(indptr.diff().cpu()[torch.unique(batch[:, :-1].cpu())].sum()) + (model.config.graph == "sparse")
    P = model.base_model.weights.shape[0]
    return (d * d + d) * 4 * {"sparse_adamw": 10 * R, "sparse_adamw_bf16": 8 * R}.get(optimizer, 3 * R + 8 * P)


def decode_rows(args, model, paths, device, backend) -> list[dict]:
    from modeling_brillm.backend import kernel_backend

    rows, N = [], args.decode_tokens
    with kernel_backend(backend), torch.inference_mode():
        for B, sampled in itertools.product(args.decode_batches, (False, True)):
            prompt, first = paths.batch(B, 8).to(device), None
            options = dict(do_sample=sampled, pad_token_id=0, eos_token_id=None)
            for mode in args.decode_modes:
                model.decode_mode = mode
                model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **options)  # warm-up: compiles, captures
                common.sync(device)
                t0 = time.perf_counter()
                out = model.generate(prompt, max_new_tokens=N, min_new_tokens=N, **options)
                common.sync(device)
                seconds, first = time.perf_counter() - t0, out if first is None else first
                same = None if sampled else torch.equal(out, first)  # greedy: every mode the same tokens
                rows.append(dict(kind="decode", B=B, sampled=sampled, mode=mode, new_tokens=N, backend=backend,
                                 tokens_per_s=B * N / seconds, same_tokens=same))
        model.decode_mode = "auto"
    return rows


def run_shape(args, name, device) -> list[dict]:
    shape = SHAPES[name]
    model, graph = common.make_model(shape["vocab"], shape["successors"], node_size=shape["node_size"])
    model.generation_config.pad_token_id = 0
    model.to(device)
    paths, rows = common.ZipfPaths(graph, seed=1), []
    for B, L in args.batches if "train" in args.parts else []:
        batches = [paths.batch(B, L).to(device) for _ in range(min(4, args.warmup + args.steps))]
        for optimizer, objective, backend in itertools.product(args.optimizer, args.objective, args.backends):
            rows.append(train_row(args, model, batches, device, objective, optimizer, backend))
            gc.collect()  # the optimizer's moments, before the next row
            torch.cuda.empty_cache()  # (nothing where CUDA never started)
    model.eval()
    for backend in args.backends if "decode" in args.parts else []:
        rows += decode_rows(args, model, paths, device, backend)
    rows = [dict(row, shape=name, interpreted=row["backend"] == "triton" and device.type != "cuda") for row in rows]
    for row in rows:
        print(json.dumps(row), flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def throughput_rows(results_dir: Path) -> tuple[str | None, list]:
    """(the record, its Triton training rows at the paper's shape, exact loss) of the newest record with training
    rows in `results_dir`, else in benchmarks/results. A run's record has `rows`; a transcribed one a `train` table."""
    for record in [p for folder in (results_dir, common.RESULTS_DIR)
                   for p in sorted(Path(folder).glob("gpu_throughput-*.json"), reverse=True)]:
        figures = json.loads(record.read_text())["figures"]
        rows = [dict(batch=f"{r['B']}x{r['L']}", tokens_per_s=r["tokens_per_s"], peak_gb=r["peak_gb"],
                     optimizer=r["optimizer"]) for r in figures.get("rows", []) if r["kind"] == "train"
                and r["shape"] == "paper" and r["backend"] == "triton" and r["objective"] == "exact"]
        rows = rows or [dict(batch=r["batch"].replace(" × ", "x"), tokens_per_s=r["triton_tokens_per_s"],
                             peak_gb=r["peak_gb"]) for r in figures.get("train", [])]
        if rows:
            return str(record.resolve()).replace(os.path.join(common.ROOT, ""), ""), rows
    return None, []


def default_batch(args, device) -> dict:
    """pretrain.py's default step: its batch, tokens/s and peak memory beside the estimate it printed."""
    from modeling_brillm.training import pretraining as pretrain

    shape = SHAPES[args.shapes[0]]
    with tempfile.TemporaryDirectory() as tmp:
        corpus, out = Path(tmp) / "corpus.txt", Path(tmp) / "run"
        paths = common.ZipfPaths(common.synthetic_graph(shape["vocab"], shape["successors"]), seed=1)
        corpus.write_text("".join("".join(chr(0x4E00 + t) for t in row) + "\n"  # node k: the character U+4E00 + k
                                  for row in paths.batch(max(1, args.corpus_tokens // 256), 256).tolist()))
        if pretrain.main(["--train_file", str(corpus), "--tokenizer_kind", "char", "--vocab_size",
                          str(shape["vocab"] + 4), "--min_bigram_count", "1", "--contiguous_blocks", "--block_size",
                          "32", "--node_size", str(shape["node_size"]), "--validation_split_percentage", "0",
                          "--num_generations", "0", "--max_train_time", str(args.default_batch), "--output_dir",
                          str(out)]) != 0:
            raise SystemExit("pretrain.py failed")
        summary = json.loads((out / pretrain.SUMMARY_NAME).read_text())
        batch = {s["name"]: s for s in json.loads((out / "recipe.json").read_text())["settings"]}[
            "per_device_train_batch_size"]
    estimate = re.search(r"needs ~([\d.]+ [KMGT]?B)|using \d+ \(~([\d.]+ [KMGT]?B)\)", batch["why"] or "")
    record, rows = throughput_rows(Path(args.results_dir))
    figures = dict(batch=batch["value"], block_size=32, rule=batch["rule"], startup_line=batch["why"],
                   estimate=next(filter(None, estimate.groups())) if estimate else None,
                   peak_gb=torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
                   throughput_record=record, throughput_rows=rows,
                   **{k: summary[k] for k in ("vocab_size", "num_edges", "num_parameters", "steps", "train_seconds")},
                   tokens_per_s=summary["tokens_per_second"])
    print(f"default batch {figures['batch']} x 32 [{figures['rule']}]: {figures['tokens_per_s']:,.0f} tokens/s over "
          f"{figures['train_seconds']} s; peak {figures['peak_gb'] or 0:.1f} GB, estimate {figures['estimate']}; "
          f"beside {record}: {[r['tokens_per_s'] for r in rows]}")
    return figures


def settle(args, gpu: bool):
    """The command line's defaults for the device: on a GPU the whole table, on a CPU a smoke test."""
    from modeling_brillm.backend import HAVE_TRITON, interpreting

    args.backends = [b for b in args.backends.split(",") if b]
    if not set(args.backends) <= {"torch", "triton"}:
        raise SystemExit(f"--backends takes torch and/or triton, got {args.backends}")
    if "triton" in args.backends and not gpu and not interpreting():
        raise SystemExit("the triton column on a CPU needs Triton's interpreter: run with TRITON_INTERPRET=1 (this "
                         "script sets it when the command line says --device cpu), or --backends torch")
    if "triton" in args.backends and not HAVE_TRITON:
        print("# triton is not installed: the triton column is skipped (pip install triton)")
        args.backends.remove("triton")
    args.shapes = [args.shape] if args.shape in SHAPES else ["paper", "small"] if gpu or args.shape else ["tiny"]
    args.batches = parse_batches(args.batches or ("32x32,256x64,1024x64" if gpu else "2x8"))
    args.objective = list(OBJECTIVES) if args.objective == "all" else [args.objective]
    args.optimizer = list(OPTIMIZERS) if args.optimizer == "all" else [args.optimizer]
    args.steps = args.steps if args.steps is not None else 5 if gpu else 1
    args.warmup = args.warmup if args.warmup is not None else 2 if gpu else 1
    args.decode_batches = [int(b) for b in (args.decode_batches if args.decode_batches is not None
                                            else "1,32,256" if gpu else "1").split(",") if b]
    args.decode_modes = args.decode_modes.split(",")
    args.decode_tokens = args.decode_tokens or (256 if gpu else 4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[_pre])
    parser.add_argument("--shape", choices=list(SHAPES) + ["all"], help="default: paper and small (a CPU: tiny)")
    parser.add_argument("--parts", nargs="+", choices=["train", "decode"], default=["train", "decode"])
    parser.add_argument("--batches", help="BxL list (default 32x32,256x64,1024x64; a CPU: 2x8)")
    parser.add_argument("--objective", choices=list(OBJECTIVES) + ["all"], default="all")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS) + ["all"], default="all")
    parser.add_argument("--backends", default="torch,triton", help="comma list of torch, triton")
    parser.add_argument("--steps", type=int, help="timed steps (default 5; a CPU: 1)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 2; a CPU: 1)")
    parser.add_argument("--decode-batches", help="comma list (default 1,32,256; a CPU: 1; '': none)")
    parser.add_argument("--decode_modes", default="auto", help="comma list of model.decode_mode: off, eager, auto")
    parser.add_argument("--decode-tokens", type=int, help="new tokens per row (default 256; a CPU: 4)")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--default_batch", type=float, metavar="SECONDS", help="pretrain.py's default step instead")
    parser.add_argument("--corpus_tokens", type=int, default=8_000_000, help="--default_batch's corpus")
    args = common.add_results_dir(parser).parse_args(argv)
    device = torch.device(args.device)
    settle(args, device.type == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32, as the exactness checks
    name = common.machine() if device.type != "cuda" else f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    if args.default_batch:
        figures = dict(device=name, default_batch=default_batch(args, device))
    else:
        args.bandwidth = copy_bandwidth(device)
        print(f"# {name}; copy bandwidth {args.bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
        rows = [row for shape in args.shapes for row in run_shape(args, shape, device)]
        figures = dict(device=name, bandwidth=args.bandwidth, rows=rows)
    common.write_record("gpu_throughput", args, figures, argv=argv)
    return figures


if __name__ == "__main__":
    main()
