"""BriLLM's hot operations, each one function: the Triton kernel where it runs, else the torch path beside it.

This is the only module that decides between the two (`backend.use_triton`: Triton for CUDA tensors by default,
`BRILLM_BACKEND` / `kernel_backend` to choose) and the only one that imports the kernel modules; the model calls
these functions. naive.py defines what each computes; tests hold both paths to it.

    op                       torch path                            Triton kernel
    make_plan, candidate_energies, scatter_logits, exact_log_partition, target_energies
                             energy.py (CandidatePlan)             triton_energy.py (KernelPlan)
    successor_logits         energy.successor_logits               triton_energy.successor_logits
    signal_scan              recurrence.signal_scan                triton_recurrence.signal_scan
    decode_step              recurrence.decode_step                triton_energy.decode_step

Kernel self-check. With the package installed (`modeling_brillm.selfcheck` registers the checks in `CHECKS`), the
first time the Triton path meets a CUDA device in a process every kernel runs once on a small random problem
beside its torch path. A kernel that fails to compile or launch, or disagrees beyond `TOLERANCE` relative to the
torch path's largest value, is switched off on that device with one warning, and the torch path runs in its place.
"""

import os
import warnings
from dataclasses import dataclass

import torch

from .backend import use_triton
from .energy import candidate_energies as ref_candidate_energies
from .energy import exact_log_partition as ref_exact_log_partition
from .energy import gather_edges, non_edge_log_mass, release_workspaces
from .energy import scatter_logits as ref_scatter_logits
from .energy import successor_logits as ref_successor_logits
from .energy import target_energies as ref_target_energies
from .csr import edge_keys, edge_rows_from_keys
from .plans import CandidatePlan, EdgeGradLink, KernelPlan, graph_max_degree, make_kernel_plan, make_torch_plan
from .recurrence import decode_step as ref_decode_step
from .recurrence import signal_scan as ref_signal_scan
from .triton_energy import SUPPORTED_DTYPES, KernelEnergies
from .triton_energy import decode_step as kernel_decode_step
from .triton_energy import log_partition as kernel_log_partition
from .triton_energy import scatter_logits as kernel_scatter_logits
from .triton_energy import successor_logits as kernel_successor_logits
from .triton_energy import target_energies as kernel_target_energies
from .triton_energy import unsupported_reason as energy_kernel_unsupported
from .triton_recurrence import signal_scan as kernel_signal_scan
from .triton_recurrence import unsupported_reason as scan_kernel_unsupported

# ------------------------------------------------------------------------------------- which kernels run
KERNELS = ("candidate_energies", "successor_logits", "signal_scan", "decode_step", "adamw_rows")
# kernel name -> (what is compared, outputs(kernel: bool, device) of one small problem): selfcheck.py fills it
CHECKS: dict = {}
CHECK_DEVICE_TYPES = {"cuda"}  # devices whose first kernel call runs the self-check (Triton's interpreter: opt-in)
TOLERANCE = 1e-5  # largest error allowed, relative to the torch path's largest value (the kernels' own tests')

_checked: set = set()  # devices whose self-check has run
_disabled: dict = {}  # device -> {kernel name: why it is off}


def _device_key(device: torch.device) -> str:
    """A device's name with its index, so `cuda` and `cuda:0` share one check."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def kernel_enabled(name: str, tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel `name` runs for `tensor`: the backend picks Triton for its device and the kernel
    has not been switched off there. Runs the device's self-check on its first call (not while a CUDA graph is
    recorded; `BRILLM_SELF_CHECK=0` skips it)."""
    if not use_triton(tensor):
        return False
    key = _device_key(tensor.device)
    capturing = tensor.is_cuda and torch.cuda.is_current_stream_capturing()
    if (key not in _checked and tensor.device.type in CHECK_DEVICE_TYPES and not capturing
            and os.environ.get("BRILLM_SELF_CHECK", "1") != "0"):
        run_self_check(tensor.device)
    return name not in _disabled.get(key, {})


def disabled_kernels(device) -> dict:
    """{kernel name: reason} of the kernels switched off on `device`."""
    return dict(_disabled.get(_device_key(torch.device(device)), {}))


def reset_self_check():
    """Forget every device's check and switch every kernel back on (the next kernel call checks again)."""
    _checked.clear()
    _disabled.clear()


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


def run_self_check(device, names=None, warn: bool = True) -> list[CheckResult]:
    """Check every registered kernel in `names` on `device` against its torch path; switch off (and warn about,
    once) each one that fails. The result of every check, in order."""
    device = torch.device(device)
    key = _device_key(device)
    _checked.add(key)
    off = _disabled.setdefault(key, {})
    results = []
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for name in (KERNELS if names is None else names):
            if name not in CHECKS:
                continue
            result = check_kernel(name, device)
            results.append(result)
            if not result.ok and name not in off:
                off[name] = result.failure or f"error {result.error:.2e}"
                if warn:
                    why = result.failure or f"its results differ from the torch path by {result.error:.2e} (relative)"
                    warnings.warn(
                        f"BriLLM's Triton kernel {name} is switched off on {device}: {why}. The torch path runs in "
                        "its place (the same math, slower). Please report this with the output of `python -m "
                        "modeling_brillm.selfcheck` and your GPU, torch and triton versions; BRILLM_BACKEND=torch "
                        "runs the torch path everywhere.", RuntimeWarning, stacklevel=3)
    return results


# ------------------------------------------------------------------------------------- candidate energies
def make_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, vocab_size: int, *,
              max_degree: int | None = None) -> CandidatePlan | KernelPlan:
    """Plan for positions whose current nodes are `sources` (N,); `indices=None` means a dense graph. A `KernelPlan`
    (built on the device, no host read) when the kernels run these tensors, else the torch path's `CandidatePlan`."""
    if kernel_enabled("candidate_energies", sources):
        return make_kernel_plan(sources, indptr, indices, vocab_size, max_degree)
    return make_torch_plan(sources, indptr, indices, vocab_size)


def _runs_kernels(plan, weights=None, x=None) -> bool:
    """Whether `plan` runs the Triton kernels; a kernel plan meeting tensors they do not read falls back for good."""
    if not isinstance(plan, KernelPlan) or plan.fallback is not None:
        return False
    if weights is not None and energy_kernel_unsupported(weights, x) is not None:
        plan.fallback = make_torch_plan(plan.sources, plan.indptr, plan.indices, plan.vocab_size)
        return False
    return True


def _torch_plan(plan) -> CandidatePlan:
    """The plan the torch path runs: itself, or the fallback a kernel plan switched to."""
    return plan.fallback if isinstance(plan, KernelPlan) else plan


def candidate_energies(x, pe, weights, biases, plan, sparse_grad: bool = False, link: EdgeGradLink | None = None,
                       non_edge_bias=None):
    """Energies of every real successor and the shared energy of every position (`energy.candidate_energies`).

    With a `KernelPlan` the first result is the (N, T, 2) tile partials instead of the packed energies: pass it on
    to the functions below unchanged. `non_edge_bias`: the model's (V,) offsets, the same tensor later given to
    `scatter_logits` (on the kernel path the logits' gradient reaches it through this call's backward)."""
    if _runs_kernels(plan, weights, x):
        return KernelEnergies.apply(x, pe, weights, biases, plan, sparse_grad, link, non_edge_bias)
    return ref_candidate_energies(x, pe, weights, biases, _torch_plan(plan), sparse_grad, link)


def scatter_logits(energies, shared, plan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """Full (N, V) logits in sorted order: the shared energy (+ `non_edge_bias[v]`), real successors' on top."""
    if _runs_kernels(plan):
        return kernel_scatter_logits(energies, shared, plan, non_edge_bias)
    return ref_scatter_logits(energies, shared, _torch_plan(plan), vocab_size, non_edge_bias)


def exact_log_partition(energies, shared, plan, vocab_size: int, non_edge_bias=None) -> torch.Tensor:
    """log Σ_v exp(E_v) over all V nodes per sorted position (`energy.exact_log_partition`)."""
    if _runs_kernels(plan):
        log_mass = None
        if non_edge_bias is not None and plan.has_shared:  # the non-successors' weight, log(V − degree) without it
            log_mass = non_edge_log_mass(non_edge_bias, plan).to(torch.float32)
        return kernel_log_partition(energies, shared, plan, vocab_size, log_mass)
    return ref_exact_log_partition(energies, shared, _torch_plan(plan), vocab_size, non_edge_bias)


def target_energies(energies, shared, plan, targets, target_rows, block_first_row, non_edge_bias=None):
    """Energy each sorted position gives its target (`energy.target_energies`)."""
    if _runs_kernels(plan):
        if non_edge_bias is not None:  # a non-edge target's energy; autograd takes the bias's gradient from here
            shared = shared + non_edge_bias.to(shared.dtype)[targets]
        return kernel_target_energies(energies, shared, plan, target_rows, block_first_row)
    return ref_target_energies(energies, shared, _torch_plan(plan), targets, target_rows, block_first_row,
                               non_edge_bias)


def _step_kernels(name: str, x, weights) -> bool:
    """Whether the one-token kernel `name` runs for these tensors."""
    return kernel_enabled(name, x) and weights.dtype in SUPPORTED_DTYPES and \
        energy_kernel_unsupported(weights, x) is None


def successor_logits(x, pe, edges, sources, graph, width: int | None) -> torch.Tensor:
    """(N, V) float32 energies of every node as the successor of each position; inference only
    (`energy.successor_logits`; the kernel: one launch over a static grid)."""
    if _step_kernels("successor_logits", x, edges.weights):
        return kernel_successor_logits(x, pe, edges, sources, graph, graph.max_degree if width is None else width)
    return ref_successor_logits(x, pe, edges, sources, graph, width)


# ------------------------------------------------------------------------------------- recurrence
def signal_scan(mix, columns, edges, link: EdgeGradLink | None = None):
    """The recurrence over all columns: (signals (B, L, d), the `state.Mix` after the last column); see
    `recurrence.signal_scan`. The Triton scan (one launch each way) runs for d ≤ 128 and, when gradients are needed,
    float32 tables."""
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (edges.weights, edges.biases, edges.edge_base, columns.weight, columns.pe, columns.node_add,
                  *mix.tensors()))
    if kernel_enabled("signal_scan", edges.weights) and scan_kernel_unsupported(edges.weights, grad) is None:
        return kernel_signal_scan(mix, columns, edges, link)
    return ref_signal_scan(mix, columns, edges, link)


def decode_step(tokens, mix, at, edges, graph, width: int | None):
    """One token per row (`recurrence.decode_step`): ((B, V) float32 logits, the new mix). The kernel (two launches)
    finds the edge by a search in the source's block; with a fixed `width` nothing reads the device."""
    if _step_kernels("decode_step", tokens, edges.weights):
        return kernel_decode_step(tokens, mix, at, edges, graph, graph.max_degree if width is None else width)
    return ref_decode_step(tokens, mix, at, edges, graph, width)


__all__ = [
    "CHECKS", "CandidatePlan", "CheckResult", "EdgeGradLink", "KERNELS", "KernelPlan", "TOLERANCE",
    "candidate_energies", "check_kernel", "decode_step", "disabled_kernels", "edge_keys", "edge_rows_from_keys",
    "exact_log_partition", "gather_edges", "graph_max_degree", "kernel_enabled", "make_plan", "non_edge_log_mass",
    "release_workspaces", "reset_self_check", "run_self_check", "scatter_logits", "signal_scan", "successor_logits",
    "target_energies",
]
