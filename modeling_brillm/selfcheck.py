"""`python -m modeling_brillm.selfcheck`: check BriLLM's Triton kernels on this machine, and time them.

Prints the versions that matter, then every kernel's check against its torch reference (the same check the model
runs the first time it meets a GPU: a failing kernel is switched off there and the torch path runs instead), then
a short speed comparison of the torch path and the kernels. Paste the output into a bug report.

Without a GPU the model runs the torch path and there is nothing to time; the correctness part can still run the
kernels on CPU tensors in Triton's interpreter:

    TRITON_INTERPRET=1 BRILLM_BACKEND=triton python -m modeling_brillm.selfcheck
"""

import argparse
import importlib.metadata
import platform
import statistics
import time

import torch

from . import ops
from .backend import HAVE_TRITON, current_backend, interpreting, kernel_backend
from .graph import graph_from_edges


def _versions(device) -> list[str]:
    """The lines a bug report needs: python, torch, triton, the GPU, the backend chosen."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    if HAVE_TRITON:
        lines.append(f"triton {importlib.metadata.version('triton')}" + (" (interpreter)" if interpreting() else ""))
    else:
        lines.append("triton not installed (pip install triton, or brillm[gpu])")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"GPU {props.name}, compute capability {props.major}.{props.minor}, CUDA {torch.version.cuda}")
    lines.append(f"BRILLM_BACKEND={current_backend()}")
    return lines


def _pick_device(requested: str | None):
    """The device to check, or None with the reason there is none."""
    if requested:
        return torch.device(requested), None
    if torch.cuda.is_available():
        return torch.device("cuda"), None
    if HAVE_TRITON and interpreting() and current_backend() == "triton":
        return torch.device("cpu"), None
    return None, ("No CUDA GPU found: BriLLM runs its torch path on this machine, so there are no kernels to time. "
                  "To check the kernels' arithmetic on the CPU anyway (slow), run\n"
                  "    TRITON_INTERPRET=1 BRILLM_BACKEND=triton python -m modeling_brillm.selfcheck")


def report_checks(device) -> bool:
    """Run and print every kernel's check on `device`; True when all pass."""
    ops.reset_self_check()
    results = ops.run_self_check(device, warn=False)
    for result in results:
        what = ops.CHECKS[result.name][0]
        if result.failure:
            status = f"FAILED to run: {result.failure}"
        else:
            status = ("ok" if result.ok else "WRONG") + f", max relative error {result.error:.1e}"
        print(f"  {result.name:<20} {what:<52} {status}")
    return all(r.ok for r in results)


# ------------------------------------------------------------------------------------- speed
def _timed(fn, device, repeats: int = 10) -> float:
    """Median milliseconds of `fn()` after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _graph(V: int, degree: int, d: int, device, seed: int = 0):
    """A random sparse graph with `degree` successors per node and its edge tables on `device`."""
    g = torch.Generator().manual_seed(seed)
    src = torch.arange(V).repeat_interleave(degree)
    tgt = torch.stack([torch.randperm(V, generator=g)[:degree] for _ in range(V)]).view(-1)
    graph = graph_from_edges(src, tgt, V)
    P = graph.num_edges + 1
    weights = (torch.randn(P, d, d, generator=g) * 0.2).to(device)
    biases = (torch.randn(P, 1, d, generator=g) * 0.2).to(device)
    return g, graph.indptr.to(device), graph.indices.to(device), weights, biases


def _loss_step(V=2048, degree=32, d=32, N=2048, device="cuda"):
    """One exact-loss forward and backward of the candidate energies (a training step's costly part)."""
    g, indptr, indices, weights, biases = _graph(V, degree, d, device)
    sources = torch.randint(0, V, (N,), generator=g).to(device)
    targets = indices[indptr[sources]]  # each position's first real successor
    x, pe = (torch.randn(N, d, generator=g).to(device) for _ in range(2))
    weights.requires_grad_()
    ops.graph_max_degree(indptr)

    def step():
        """One timed call."""
        plan = ops.make_plan(sources, indptr, indices, V)
        src, tgt = sources[plan.order], targets[plan.order]
        energies, shared = ops.candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan, True)
        rows = indptr[src] + 1
        true = ops.target_energies(energies, shared, plan, tgt, rows, rows)
        (ops.exact_log_partition(energies, shared, plan, V) - true).mean().backward()
        weights.grad = None

    return step


def _scan_step(B=32, L=64, d=32, device="cuda"):
    """The recurrence forward and backward over a (B, L) batch."""
    g = torch.Generator().manual_seed(1)
    P = 4096
    weights = (torch.randn(P, d, d, generator=g) * 0.2).to(device).requires_grad_()
    biases = torch.zeros(P, 1, d, device=device, requires_grad=True)
    rows = torch.randint(0, P, (B, L), generator=g).to(device)
    has_edge = torch.ones(B, L, dtype=torch.bool, device=device)
    pe, mix_weight = torch.randn(B, L, d, device=device), torch.randn(B, L, device=device)
    zeros = torch.zeros(B, d, device=device)

    def step():
        """One timed call."""
        out = ops.signal_scan(zeros + 1 / d, zeros, zeros[:, 0], zeros[:, 0] - float("inf"), mix_weight, weights,
                              biases, rows, has_edge, pe)
        out[0].square().sum().backward()
        weights.grad = biases.grad = None

    return step


def _decode(B=32, V=2048, degree=32, d=32, device="cuda"):
    """One sync-free decode step of B rows."""
    g, indptr, indices, weights, biases = _graph(V, degree, d, device, seed=2)
    keys = ops.edge_keys(indptr, indices, V)
    tokens = torch.randint(0, V, (B,), generator=g).to(device)
    signal = torch.full((B, d), 1 / d, device=device)
    state = (signal, signal.clone(), torch.ones(B, device=device), torch.zeros(B, device=device))
    length = torch.full((B,), 5, device=device)
    positions = torch.ones(1, 512, 1, device=device)
    pe = torch.randn(B, d, device=device)
    max_degree = ops.graph_max_degree(indptr)

    def step():
        """One timed call."""
        with torch.no_grad():
            ops.decode_step(tokens, *state, length, tokens, weights, biases, positions, pe, pe, indptr, indices, keys,
                            V, max_degree)

    return step


def _adamw(rows=50_000, width=1024, device="cuda"):
    """SparseAdamW's update of `rows` touched rows of `width` floats (a row: one 32 x 32 edge matrix)."""
    P = 2 * rows
    param, m, v = (torch.zeros(P, width, device=device) for _ in range(3))
    touched = torch.randperm(P, device=device)[:rows]
    values = torch.randn(rows, width, device=device)
    step = torch.tensor(3.0)

    def run():
        """One timed call."""
        ops.adamw_rows(param, m, v, touched, values, step, (1e-3, 0.9, 0.999, 1e-8, 0.0))

    return run


SPEED = {
    "exact loss step (V=2048, 32 successors, d=32, N=2048)": _loss_step,
    "recurrence forward+backward (32 x 64, d=32)": _scan_step,
    "decode step (32 rows, V=2048, d=32)": _decode,
    "SparseAdamW rows (50k rows x 1024)": _adamw,
}


def report_speed(device):
    """Print the torch path's and the kernels' median time of each workload on `device`."""
    print(f"  {'workload':<56} {'torch ms':>10} {'triton ms':>10} {'speed-up':>9}")
    for name, make in SPEED.items():
        timings = []
        for backend in ("torch", "triton"):
            with kernel_backend(backend):
                try:
                    timings.append(_timed(make(device=device), device))
                except Exception as error:  # report and go on: the point is a readable report
                    timings.append(float("nan"))
                    print(f"  {name}: {backend} failed ({type(error).__name__}: {error})")
        print(f"  {name:<56} {timings[0]:>10.3f} {timings[1]:>10.3f} {timings[0] / timings[1]:>8.1f}x")


def main(argv=None) -> int:
    """Print the report; exit status 1 when a kernel failed its check."""
    parser = argparse.ArgumentParser(prog="python -m modeling_brillm.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--device", help="device to check (default: cuda when present)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed comparison")
    args = parser.parse_args(argv)
    device, why_not = _pick_device(args.device)
    print("BriLLM kernel self-check")
    for line in _versions(device or torch.device("cpu")):
        print("  " + line)
    if device is None:
        print(why_not)
        return 0
    if not HAVE_TRITON:
        print("triton is missing: the torch path runs everywhere.")
        return 0
    print(f"Correctness on {device} (each kernel against its torch reference, tolerance {ops.TOLERANCE:g}):")
    passed = report_checks(device)
    if device.type == "cuda" and not args.no_speed:
        print(f"Speed on {device}:")
        report_speed(device)
    if not passed:
        print("A kernel failed: BriLLM switches it off and runs the torch path in its place. Please report this "
              "output with your GPU, torch and triton versions (BRILLM_BACKEND=torch avoids the kernels altogether).")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
