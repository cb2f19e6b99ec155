"""`python -m modeling_brillm.selfcheck`: check BriLLM's Triton kernels on this machine against their torch paths
(the check the model runs the first time it meets a GPU, switching a failing kernel off; their speed is
`benchmarks/gpu_throughput.py`'s). Paste the output into a bug report (docs/gpu.md). Without a GPU, Triton's
interpreter runs it:

    TRITON_INTERPRET=1 BRILLM_BACKEND=triton python -m modeling_brillm.selfcheck
"""

import argparse
import importlib.metadata
import platform
import warnings
from dataclasses import dataclass

import torch

from . import ops, optimization
from .backend import HAVE_TRITON, current_backend, interpreting, kernel_backend
from .energy import successor_logits as ref_successor_logits
from .graph import graph_from_edges
from .plans import make_kernel_plan, make_torch_plan
from .recurrence import signal_scan as ref_signal_scan
from .state import Columns, Mix
from .tables import EdgeTable, GraphView, StepAt

TOLERANCE = 1e-5  # largest error allowed, relative to the torch path's largest value (the kernels' own tests')


def _versions(device) -> list[str]:
    """The lines a bug report needs: python, torch, triton, the GPU, the backend chosen."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}",
             f"triton {importlib.metadata.version('triton')}" + (" (interpreter)" if interpreting() else "")
             if HAVE_TRITON else "triton not installed (pip install triton, or brillm[gpu])"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"GPU {props.name}, compute capability {props.major}.{props.minor}, CUDA {torch.version.cuda}")
    return lines + [f"BRILLM_BACKEND={current_backend()}"]


def _pick_device(requested: str | None):
    """The device to check, or None with the reason there is none."""
    if requested:
        return torch.device(requested), None
    if torch.cuda.is_available():
        return torch.device("cuda"), None
    if HAVE_TRITON and interpreting() and current_backend() == "triton":
        return torch.device("cpu"), None
    return None, ("No CUDA GPU found: BriLLM runs its torch path on this machine, so there are no kernels to check. "
                  "To check the kernels' arithmetic on the CPU anyway (slow), run\n"
                  "    TRITON_INTERPRET=1 BRILLM_BACKEND=triton python -m modeling_brillm.selfcheck")


# ------------------------------------------------------------------------------------- the checks
def _random(device, seed: int):
    """A seeded generator, and `randn(*shape, scale=1.0)` drawing from it onto `device`."""
    g = torch.Generator().manual_seed(seed)
    return g, lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device)


def _problem(device, V=9, d=8, seed=0):
    """`_random`'s pair, a random sparse graph (a node without successors, one with all) and float32 edge tables."""
    g, randn = _random(device, seed)
    mask = torch.rand(V, V, generator=g) < 0.5
    mask[V - 1], mask[0] = False, True
    graph = graph_from_edges(*mask.nonzero(as_tuple=True), V)
    weights, biases = randn(graph.num_edges + 1, d, d, scale=0.5), randn(graph.num_edges + 1, 1, d, scale=0.5)
    indptr, indices = graph.indptr.to(device), graph.indices.to(device)
    return g, randn, GraphView(indptr, indices, ops.edge_keys(indptr, indices, V), V), weights, biases


def _energies_outputs(kernel: bool, device):
    """Loss (log Z − target + logits), logits and every gradient of one exact-loss step on either path."""
    g, randn, graph, weights, biases = _problem(device)
    V, d = graph.vocab_size, weights.shape[-1]
    sources, targets = (torch.randint(0, V, (12,), generator=g).to(device) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (randn(12, d), randn(12, d), weights, biases, randn(V))]
    x, pe, weights, biases, bias = leaves  # PE: where x·edge_base goes
    plan = (make_kernel_plan if kernel else make_torch_plan)(sources, graph.indptr, graph.indices, V)
    src, tgt = sources[plan.order], targets[plan.order]
    energies, shared = ops.candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan, True, None, bias)
    rows = ops.edge_rows_from_keys(graph.keys, src, tgt, V)
    true = ops.target_energies(energies, shared, plan, tgt, rows, graph.indptr[src] + 1, bias)
    logits = ops.scatter_logits(energies, shared, plan, V, bias)
    loss = (ops.exact_log_partition(energies, shared, plan, V, bias) - true).mean()
    (loss + (logits * torch.linspace(-1, 1, V, device=device)).mean()).backward()
    return [loss, logits] + [t.grad for t in leaves]


def _successor_outputs(kernel: bool, device):
    """One-token logits of 5 positions with a non-edge bias, on either path."""
    g, randn, graph, weights, biases = _problem(device, seed=1)
    V, d = graph.vocab_size, weights.shape[-1]
    sources = torch.randint(0, V, (5,), generator=g).to(device)
    x, pe = randn(5, d), randn(5, d)
    edges = EdgeTable(weights, biases, non_edge_bias=randn(V))
    with torch.no_grad():
        run = ops.kernel_successor_logits if kernel else ref_successor_logits
        return [run(x, pe, edges, sources, graph, graph.max_degree)]


def _one_scan(kernel: bool, device, options: bool):
    """Signals, mix and gradients of a (3, 6) scan; `options`: the shared matrix, dropout and the nodes' vectors."""
    g, randn, _, weights, biases = _problem(device, seed=2)
    P, d, B, L = weights.shape[0], weights.shape[-1], 3, 6
    rows = torch.randint(0, P, (B, L), generator=g).to(device)
    has_edge = (torch.rand(B, L, generator=g) < 0.8).to(device)
    signal, norm = torch.randn(B, d, generator=g), torch.rand(B, generator=g) + 1
    mix = [signal, signal * norm.unsqueeze(1), norm, torch.randn(B, generator=g)]  # signal = sum / norm
    leaves = [t.to(device).requires_grad_() for t in (*mix, torch.randn(B, L, generator=g))]
    leaves += [weights.clone().requires_grad_(), biases.clone().requires_grad_()]
    pe = randn(B, L, d)  # fixed sinusoids in the model: no gradient (the kernel returns none)
    base = node_add = keep = None
    if options:
        base = randn(d, d, scale=0.5).requires_grad_()
        node_add = randn(B, L, d, scale=0.5).requires_grad_()
        leaves += [base, node_add]
        keep = ((torch.rand(B, L + 1, d, generator=g) > 0.25).float() / 0.75).to(device)  # dropout p = 0.25
    columns = Columns(rows, has_edge, pe, leaves[4], node_add, keep)
    edges = EdgeTable(leaves[5], leaves[6], base)
    signals, mix = (ops.kernel_signal_scan if kernel else ref_signal_scan)(Mix(*leaves[:4]), columns, edges)
    outputs = [signals, *mix.tensors()]
    sum(o.mul(torch.linspace(-1, 1, o.numel(), device=device).view(o.shape)).sum() for o in outputs).backward()
    return outputs + [t.grad for t in leaves]


def _one_decode(kernel: bool, device, options: bool):
    """Logits and mix of a decode step of 4 rows (edge, non-edge, no successor); `options` as in `_one_scan`."""
    g, randn, graph, weights, biases = _problem(device, seed=3)
    V, d, B = graph.vocab_size, weights.shape[-1], 4
    tokens = torch.randint(0, V, (B,), generator=g).to(device)
    last = torch.tensor([0, V - 1, 2, 3], device=device)
    mix = Mix(randn(B, d), torch.rand(B, d, generator=g).to(device), (torch.rand(B, generator=g) + 1).to(device),
              randn(B))
    pe_now, pe_next, weight = randn(B, d), randn(B, d), randn(B)
    base = randn(d, d, scale=0.5) if options else None
    node_add = randn(B, d, scale=0.5) if options else None
    edges = EdgeTable(weights, biases, base, randn(V))
    with torch.no_grad(), kernel_backend("triton" if kernel else "torch"):
        logits, mix = ops.decode_step(tokens, mix, StepAt(last, pe_now, pe_next, weight, node_add), edges, graph,
                                      graph.max_degree)
    return [logits, *mix.tensors()]


def _adamw_outputs(kernel: bool, device):
    """Parameter and moments after one update of 7 rows (duplicates, row 0 at half the learning rate)."""
    g, randn = _random(device, 4)
    param, exp_avg = randn(12, 16), randn(12, 16, scale=0.1)
    exp_avg_sq = (torch.rand(12, 16, generator=g) * 0.01).to(device)
    rows, values = torch.tensor([5, 0, 3, 5, 11, 0, 2], device=device), randn(7, 16)
    run = optimization.kernel_adamw_rows if kernel else optimization.ref_adamw_rows
    run(param, exp_avg, exp_avg_sq, rows, values, torch.tensor(3.0), (1e-2, 0.9, 0.999, 1e-8, 0.1), first_row_scale=0.5)
    return [param, exp_avg, exp_avg_sq]


CHECKS = {  # kernel name -> (what is compared, the outputs of one small problem on either path)
    "candidate_energies": ("energies forward/backward, log Z, target, logits", _energies_outputs),
    "successor_logits": ("one-token logits", _successor_outputs),
    "signal_scan": ("recurrence scan forward/backward",
                    lambda kernel, device: _one_scan(kernel, device, False) + _one_scan(kernel, device, True)),
    "decode_step": ("decode step logits and state",
                    lambda kernel, device: _one_decode(kernel, device, False) + _one_decode(kernel, device, True)),
    "adamw_rows": ("SparseAdamW fused row update", _adamw_outputs),
}
KERNELS = tuple(CHECKS)


@dataclass
class CheckResult:
    """One kernel's self-check: whether it passed, its largest relative error, and the error it raised."""

    name: str
    ok: bool
    error: float | None = None  # largest |kernel − torch| / largest |torch| over every output compared
    failure: str | None = None  # the exception, when the kernel failed to compile or launch


def _rel_error(pairs) -> float:
    """Largest |a − b| / max |b| over the pairs (kernel, torch); inf when shapes or gradients differ."""
    worst = 0.0
    for a, b in pairs:
        if a is None or b is None:  # no gradient on either path is agreement; on one only, not
            if (a is None) != (b is None):
                return float("inf")
            continue
        a, b = (t.to_dense().detach().double() if t.is_sparse else t.detach().double() for t in (a, b))
        if a.shape != b.shape:
            return float("inf")
        if b.numel():
            err, scale = float((a - b).abs().max()), float(b.abs().max())
            worst = max(worst, err / max(scale, 1e-30) if err else 0.0)
    return worst


def check_kernel(name: str, device) -> CheckResult:
    """Run kernel `name` and its torch path on one small random problem on `device`; compare."""
    outputs = CHECKS[name][1]
    with torch.random.fork_rng(devices=[]):
        expected = outputs(False, device)
    try:
        with torch.random.fork_rng(devices=[]):
            got = outputs(True, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # a kernel that cannot compile or launch here: the torch path takes over
        detail = str(error).strip().splitlines()
        return CheckResult(name, False, failure=f"{type(error).__name__}: {detail[-1] if detail else ''}")
    err = _rel_error(zip(got, expected))
    return CheckResult(name, err <= TOLERANCE, error=err)


def run_self_check(device, warn: bool = True) -> list[CheckResult]:
    """Check every kernel on `device`; switch off (and warn about, once) each one that fails."""
    device = torch.device(device)
    key = ops.device_key(device)
    ops._checked.add(key)
    off = ops._disabled.setdefault(key, {})
    results = []
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for name in KERNELS:
            result = check_kernel(name, device)
            results.append(result)
            if result.ok or name in off:
                continue
            off[name] = result.failure or f"error {result.error:.2e}"
            if warn:
                why = result.failure or f"its results differ from the torch path by {result.error:.2e} (relative)"
                warnings.warn(
                    f"BriLLM's Triton kernel {name} is switched off on {device}: {why}. The torch path runs in "
                    "its place (the same math, slower). Please report this with the output of `python -m "
                    "modeling_brillm.selfcheck` and your GPU, torch and triton versions; BRILLM_BACKEND=torch "
                    "runs the torch path everywhere.", RuntimeWarning, stacklevel=3)
    return results


ops.SELF_CHECK = run_self_check


def report_checks(device) -> bool:
    """Run and print every kernel's check on `device`; True when all pass."""
    ops.reset_self_check()
    results = run_self_check(device, warn=False)
    for result in results:
        status = (f"FAILED to run: {result.failure}" if result.failure else
                  ("ok" if result.ok else "WRONG") + f", max relative error {result.error:.1e}")
        print(f"  {result.name:<20} {CHECKS[result.name][0]:<52} {status}")
    return all(r.ok for r in results)


def main(argv=None) -> int:
    """Print the report; exit status 1 when a kernel failed its check."""
    parser = argparse.ArgumentParser(prog="python -m modeling_brillm.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--device", help="device to check (default: cuda when present)")
    args = parser.parse_args(argv)
    device, why_not = _pick_device(args.device)
    print("\n  ".join(["BriLLM kernel self-check", *_versions(device or torch.device("cpu"))]))
    if device is None or not HAVE_TRITON:
        print(why_not or "triton is missing: the torch path runs everywhere.")
        return 0
    print(f"Correctness on {device} (each kernel against its torch reference, tolerance {TOLERANCE:g}):")
    passed = report_checks(device)
    if not passed:
        print("A kernel failed: BriLLM switches it off and runs the torch path in its place. Please report this "
              "output with your GPU, torch and triton versions (BRILLM_BACKEND=torch avoids the kernels altogether).")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
