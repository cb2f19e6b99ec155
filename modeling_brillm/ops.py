"""BriLLM's hot operations, each one function: the Triton kernel where it runs (`backend.use_triton`), else the torch
path. With the package installed, a CUDA device's first kernel call runs every kernel once beside its torch path
(selfcheck.py); one that fails is switched off there with one warning."""

import os

import torch

from .backend import use_triton
from .csr import edge_keys, edge_rows_from_keys  # noqa: F401  (the ops' API)
from .energy import candidate_energies as ref_candidate_energies
from .energy import exact_log_partition as ref_exact_log_partition
from .energy import gather_edges, non_edge_log_mass, release_workspaces  # noqa: F401  (the ops' API)
from .energy import scatter_logits as ref_scatter_logits
from .energy import successor_logits as ref_successor_logits
from .energy import target_energies as ref_target_energies
from .plans import CandidatePlan, EdgeGradLink, KernelPlan, graph_max_degree, make_kernel_plan, make_torch_plan  # noqa: F401  (the ops' API)
from .recurrence import edge_update, plus_edge_base, without_onednn
from .recurrence import signal_scan as ref_signal_scan
from .state import Columns
from .triton_energy import KernelEnergies
from .triton_energy import log_partition as kernel_log_partition
from .triton_energy import scatter_logits as kernel_scatter_logits
from .triton_energy import successor_logits as kernel_successor_logits
from .triton_energy import target_energies as kernel_target_energies
from .triton_energy import unsupported_reason as energy_kernel_unsupported
from .triton_recurrence import signal_scan as kernel_signal_scan
from .triton_recurrence import unsupported_reason as scan_kernel_unsupported

CHECK_DEVICE_TYPES = {"cuda"}  # devices whose first kernel call runs the self-check (Triton's interpreter: opt-in)
SELF_CHECK = None  # run_self_check(device): the package's (selfcheck.py registers it; a saved model's code has none)
_checked: set = set()  # devices whose self-check has run
_disabled: dict = {}  # device -> {kernel name: why it is off}


def device_key(device: torch.device) -> str:
    """A device's name with its index, so `cuda` and `cuda:0` share one check."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def kernel_enabled(name: str, tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel `name` runs for `tensor` (picked there, not switched off); a first call self-checks."""
    if not use_triton(tensor):
        return False
    key = device_key(tensor.device)
    if (SELF_CHECK is not None and key not in _checked and tensor.device.type in CHECK_DEVICE_TYPES
            and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())
            and os.environ.get("BRILLM_SELF_CHECK", "1") != "0"):
        SELF_CHECK(tensor.device)
    return name not in _disabled.get(key, {})


def disabled_kernels(device) -> dict:
    """{kernel name: reason} of the kernels switched off on `device`."""
    return dict(_disabled.get(device_key(torch.device(device)), {}))


def reset_self_check():
    """Forget every device's check and switch every kernel back on (the next kernel call checks again)."""
    _checked.clear()
    _disabled.clear()


def make_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None,
              vocab_size: int) -> CandidatePlan | KernelPlan:
    """A `KernelPlan` (no host read) where the kernels run these tensors, else the torch path's `CandidatePlan`."""
    if kernel_enabled("candidate_energies", sources):
        return make_kernel_plan(sources, indptr, indices, vocab_size)
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
    """`energy.candidate_energies`; on a `KernelPlan` the first result is the (N, T, 2) tile partials (pass it on
    unchanged), and `non_edge_bias` the tensor given to `scatter_logits` later (its gradient comes back here)."""
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
        bias = non_edge_bias is not None and plan.has_shared  # the non-successors' weight in log, else log(V − degree)
        log_mass = non_edge_log_mass(non_edge_bias, plan).float() if bias else None
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


def successor_logits(x, pe, edges, sources, graph, width: int | None) -> torch.Tensor:
    """(N, V) float32 energies of every node as each position's successor; inference only (energy.successor_logits)."""
    if kernel_enabled("successor_logits", x) and energy_kernel_unsupported(edges.weights, x) is None:
        return kernel_successor_logits(x, pe, edges, sources, graph, graph.max_degree if width is None else width)
    return ref_successor_logits(x, pe, edges, sources, graph, width)


def signal_scan(mix, columns, edges, link: EdgeGradLink | None = None):
    """`recurrence.signal_scan`, by the Triton scan for d ≤ 128 (with gradients: float32 tables only)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
        edges.weights, edges.biases, edges.edge_base, columns.weight, columns.pe, columns.node_add, *mix.tensors()))
    if kernel_enabled("signal_scan", edges.weights) and scan_kernel_unsupported(edges.weights, grad) is None:
        return kernel_signal_scan(mix, columns, edges, link)
    return ref_signal_scan(mix, columns, edges, link)


def decode_step(tokens, mix, at, edges, graph, width: int | None):
    """One token per row (inference): ((B, V) float32 logits of the successors of `tokens` (B,), the mix after them)."""
    with without_onednn(tokens):
        rows = edge_rows_from_keys(graph.keys, at.last, tokens, graph.vocab_size)
        if kernel_enabled("signal_scan", edges.weights) and scan_kernel_unsupported(edges.weights, False) is None:
            node_add = None if at.node_add is None else at.node_add[:, None]
            columns = Columns(rows[:, None], torch.ones_like(rows[:, None], dtype=torch.bool),
                              at.pe_now[:, None], at.weight[:, None], node_add)
            mix = kernel_signal_scan(mix, columns, edges)[1]
        else:
            b, x = edges.biases.reshape(edges.weights.shape[0], -1), mix.signal
            mix = edge_update(mix, x, edges.weights[rows], b[rows], plus_edge_base(at.pe_now, x, edges.edge_base),
                              at.weight, at.node_add)
        pe = plus_edge_base(at.pe_next, mix.signal, edges.edge_base)
        return successor_logits(mix.signal, pe, edges, tokens, graph, width), mix
