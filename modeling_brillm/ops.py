"""BriLLM's hot operations, each one function: the Triton kernel where it runs, else the torch reference beside it.

This is the only module that decides between the two backends (`backend.use_triton`: Triton for CUDA tensors by
default, `BRILLM_BACKEND` / `kernel_backend` to choose) and the only one that imports the kernel modules. The model,
sharding and the optimizer call these functions; the references (energy.py, recurrence.py, row_adamw.py) and the
kernels (triton_energy.py, triton_recurrence.py, triton_optim.py) never import each other or this module.

    op                       torch reference                     Triton kernel
    make_plan + candidate_energies, scatter_logits, exact_log_partition, target_energies
                             energy (CandidatePlan)              triton_energy (KernelPlan)
    successor_logits(_static) energy.successor_logits(_static)   triton_energy.successor_logits
    signal_scan              recurrence.signal_scan              triton_recurrence.signal_scan
    decode_step              recurrence.decode_step              triton_energy.decode_step
    adamw_rows               row_adamw.adamw_rows                triton_optim.sparse_adamw_rows

Each entry is imported here by name (`ref_*` the references, `kernel_*` the kernels): `from .module import name`
is the form transformers follows to ship a saved model's code files, and a test replaces `ops.kernel_*` to
simulate a kernel that fails.

Kernel self-check. The first time the Triton path meets a CUDA device in a process, every kernel runs once on a
small random problem beside its torch reference (`run_self_check`, milliseconds). A kernel that fails to compile
or launch, or disagrees beyond 1e-5 relative to the reference's largest value, is switched off on that device with
one warning, and the torch path runs in its place. `python -m modeling_brillm.selfcheck` prints the same check.
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
from .energy import successor_logits_static as ref_successor_logits_static
from .energy import target_energies as ref_target_energies
from .graph import edge_keys, edge_rows_from_keys, graph_from_edges
from .plans import CandidatePlan, EdgeGradLink, KernelPlan, graph_max_degree, make_kernel_plan, make_torch_plan
from .recurrence import decode_step as ref_decode_step
from .recurrence import dropout_mask, edge_update, mix_in
from .recurrence import signal_scan as ref_signal_scan
from .row_adamw import adamw_rows as ref_adamw_rows
from .triton_energy import SUPPORTED_DTYPES, KernelEnergies
from .triton_energy import decode_step as kernel_decode_step
from .triton_energy import log_partition as kernel_log_partition
from .triton_energy import scatter_logits as kernel_scatter_logits
from .triton_energy import successor_logits as kernel_successor_logits
from .triton_energy import target_energies as kernel_target_energies
from .triton_energy import unsupported_reason as energy_kernel_unsupported
from .triton_optim import sparse_adamw_rows as kernel_adamw_rows
from .triton_recurrence import signal_scan as kernel_signal_scan
from .triton_recurrence import unsupported_reason as scan_kernel_unsupported

# ------------------------------------------------------------------------------------- which kernels run
KERNELS = ("candidate_energies", "successor_logits", "signal_scan", "decode_step", "adamw_rows")
CHECK_DEVICE_TYPES = {"cuda"}  # devices whose first kernel call runs the self-check (Triton's interpreter: opt-in)
TOLERANCE = 1e-5  # largest error allowed, relative to the reference's largest value (the kernels' own tests')

_checked: set = set()  # devices whose self-check has run
_disabled: dict = {}  # device -> {kernel name: why it is off}


def _device_key(device: torch.device) -> str:
    """A device's name with its index, so `cuda` and `cuda:0` share one check."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being recorded on `device` (no check may run then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kernel_enabled(name: str, tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel `name` runs for `tensor`: the backend picks Triton for its device and the kernel
    has not been switched off there. Runs the device's self-check on its first call (not inside a CUDA graph
    capture; `BRILLM_SELF_CHECK=0` skips it)."""
    if not use_triton(tensor):
        return False
    key = _device_key(tensor.device)
    if (key not in _checked and tensor.device.type in CHECK_DEVICE_TYPES and not _capturing(tensor.device)
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


# ------------------------------------------------------------------------------------- candidate energies
def make_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, vocab_size: int, *,
              max_degree: int | None = None) -> CandidatePlan | KernelPlan:
    """Plan for positions whose current nodes are `sources` (N,); `indices=None` means a dense graph.

    A `KernelPlan` (built on the device, no host read) when the kernels run these tensors, else the torch path's
    `CandidatePlan`.
    """
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
    `scatter_logits` (on the kernel path the logits' gradient reaches it through this call's backward).
    """
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


def _successor_kernel(x, weights) -> bool:
    """Whether the one-token logits kernel runs for these tensors."""
    return kernel_enabled("successor_logits", x) and energy_kernel_unsupported(weights, x) is None


def successor_logits(x, pe, weights, biases, sources, indptr, indices, vocab_size: int,
                     non_edge_bias=None) -> torch.Tensor:
    """(N, V) energies of every node as the successor of each position, in the given order; inference only
    (`energy.successor_logits`; the kernel: one launch)."""
    if _successor_kernel(x, weights):
        max_degree = vocab_size if indices is None else graph_max_degree(indptr)
        b2 = biases.reshape(weights.shape[0], -1)
        with torch.no_grad():
            return kernel_successor_logits(x, pe, weights, b2, sources, indptr, indices, vocab_size,
                                           max_degree, non_edge_bias)
    return ref_successor_logits(x, pe, weights, biases, sources, indptr, indices, vocab_size, non_edge_bias)


def successor_logits_static(x, pe, weights, biases, sources, indptr, indices, vocab_size: int, max_degree: int,
                            non_edge_bias=None) -> torch.Tensor:
    """`successor_logits` with no host read and shapes fixed by (N, max_degree) (`energy.successor_logits_static`)."""
    if _successor_kernel(x, weights):
        b2 = biases.reshape(weights.shape[0], -1)
        with torch.no_grad():
            return kernel_successor_logits(x, pe, weights, b2, sources, indptr, indices, vocab_size,
                                           max_degree, non_edge_bias)
    return ref_successor_logits_static(x, pe, weights, biases, sources, indptr, indices, vocab_size, max_degree,
                                       non_edge_bias)


# ------------------------------------------------------------------------------------- recurrence
def signal_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe,
                sparse_grad: bool = False, link: EdgeGradLink | None = None, dropout: float = 0.0, edge_base=None,
                node_add=None, dropout_seed: int | None = None, dropout_rows=None, dropout_start=None):
    """The recurrence over all columns: returns (signals (B, L, d), signal, mix_sum, mix_norm, mix_max).

    Arguments as `recurrence.signal_scan` (the torch reference, one column at a time), but `dropout` (training only)
    is a probability: one mask is built here for both paths, `recurrence.dropout_mask` of (`dropout_seed`, each
    row's index in the global batch `dropout_rows` (B,), the position of each signal, the dimension), so a row
    drops the same entries in any batch on any process. The signal entering column j is hashed at position
    `dropout_start` (B,) + j, the first column's position (default 0: a sequence's start). Defaults: rows 0..B−1,
    a seed drawn from torch's generator (a fresh mask every call, as `F.dropout`'s). `signals[:, j]` is what
    token j's candidates see (dropped out with the mask), `signal` the final undropped signal. The Triton scan
    (one launch each way) runs when the backend picks it, for d ≤ 128 and, when gradients are needed, float32
    tables. A sharded caller passes its fetched rows as the table: weights (B·L, d, d), biases (B·L, 1, d),
    rows = arange(B·L).view(B, L).
    `node_add` (B, L, d), optional: the vector of the node each column enters (config.node_embedding).
    """
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (weights, biases, mix_weight, pe, signal, mix_sum, mix_norm, mix_max, edge_base))
    keep = None
    if dropout:
        keep = scan_dropout_mask(dropout, dropout_seed, dropout_rows, dropout_start, rows.shape, signal.shape[-1],
                                 signal.device)
    if kernel_enabled("signal_scan", weights) and scan_kernel_unsupported(weights, needs_grad) is None:
        stacked, mix_sum, mix_norm, mix_max = kernel_signal_scan(
            signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe, sparse_grad, link,
            edge_base, None if keep is None else keep[:, :-1], node_add)
        final = stacked[:, -1] if stacked.shape[1] else signal.float()
        return (stacked if keep is None else stacked * keep[:, 1:]), final, mix_sum, mix_norm, mix_max
    return ref_signal_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe,
                           sparse_grad, link, keep, edge_base, node_add)


def draw_dropout_seed() -> int:
    """A mask seed from torch's generator: what a call that names none uses (reproducible under manual_seed)."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, ()))


def check_dropout_rows(rows, batch: int, device) -> torch.Tensor | None:
    """`dropout_rows` as (B,) long on `device` (None stays None): each row's index in the global batch."""
    if rows is None:
        return None
    rows = torch.as_tensor(rows, device=device)
    if rows.is_floating_point() or rows.dtype == torch.bool or tuple(rows.shape) != (batch,):
        raise ValueError(f"dropout_rows must be integer row indices of shape (batch,) = ({batch},), got "
                         f"{tuple(rows.shape)} {rows.dtype}: pass each row's index in the global batch.")
    return rows.long()


def scan_dropout_mask(p: float, seed: int | None, rows, start, shape, d: int, device) -> torch.Tensor:
    """The (B, L + 1, d) mask of a scan over `shape` = (B, L) columns: entry j on the signal entering column j (j = L:
    leaving the last one), hashed at position start + j; None takes `signal_scan`'s defaults."""
    B, L = shape
    seed = draw_dropout_seed() if seed is None else seed
    rows = torch.arange(B, device=device) if rows is None else rows.to(device)
    start = torch.zeros(B, dtype=torch.long, device=device) if start is None else start.to(device)
    return dropout_mask(p, seed, rows, start.unsqueeze(1) + torch.arange(L + 1, device=device), d)


def decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights, biases, positions, pe_now,
                pe_next, indptr, indices, edge_keys, vocab_size: int, max_degree: int, non_edge_bias=None,
                edge_base=None, node_add=None):
    """One token per row with no host read (what a CUDA graph records): returns ((B, V) float32 logits, (signal,
    mix_sum, mix_norm, mix_max, length + 1, tokens)). Arguments as `recurrence.decode_step`; the kernel (two
    launches) finds the edge by a search in the source's block and does not read `edge_keys`."""
    if kernel_enabled("decode_step", tokens) and weights.dtype in SUPPORTED_DTYPES:
        P = weights.shape[0]
        return kernel_decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights,
                                  biases.reshape(P, -1), positions.reshape(-1), pe_now, pe_next, indptr,
                                  indices, vocab_size, max_degree, non_edge_bias, edge_base, node_add)
    return ref_decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights, biases,
                           positions, pe_now, pe_next, indptr, indices, edge_keys, vocab_size, max_degree,
                           non_edge_bias, edge_base, node_add)


# ------------------------------------------------------------------------------------- optimizer
def adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, *, unique: bool = False,
               first_row_scale: float = 1.0):
    """SparseAdamW's lazy AdamW on the listed rows of `param` ((n_rows, W) views of it and its moments), in place:
    one fused pass (triton_optim.sparse_adamw_rows) or the torch reference (row_adamw.adamw_rows)."""
    if kernel_enabled("adamw_rows", param):
        kernel_adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, unique=unique,
                          first_row_scale=first_row_scale)
    else:
        ref_adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, unique=unique,
                       first_row_scale=first_row_scale)


# ------------------------------------------------------------------------------------- self-check
@dataclass
class CheckResult:
    """One kernel's self-check: whether it passed, its largest relative error, and the error it raised."""

    name: str
    ok: bool
    error: float | None = None  # largest |kernel − torch| / largest |torch| over every output compared
    failure: str | None = None  # the exception, when the kernel failed to compile or launch


def _rel_error(pairs) -> float:
    """Largest |a − b| / max |b| over the pairs (kernel, reference); inf when shapes or gradients differ."""
    worst = 0.0
    for a, b in pairs:
        if a is None or b is None:  # no gradient on either path is agreement; on one only, not
            if (a is None) != (b is None):
                return float("inf")
            continue
        a = (a.to_dense() if a.is_sparse else a).detach().double()
        b = (b.to_dense() if b.is_sparse else b).detach().double()
        if a.shape != b.shape:
            return float("inf")
        scale = float(b.abs().max()) if b.numel() else 0.0
        err = float((a - b).abs().max()) if b.numel() else 0.0
        worst = max(worst, err / max(scale, 1e-30) if err else 0.0)
    return worst


def _problem(device, V=9, d=8, seed=0):
    """A random sparse graph (one node with no successor, one with every node) and fp32 edge tables."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(V, V, generator=g) < 0.5
    mask[V - 1], mask[0] = False, True
    src, tgt = mask.nonzero(as_tuple=True)
    graph = graph_from_edges(src, tgt, V)
    P = graph.num_edges + 1
    weights = (torch.randn(P, d, d, generator=g) * 0.5).to(device)
    biases = (torch.randn(P, 1, d, generator=g) * 0.5).to(device)
    return g, graph.indptr.to(device), graph.indices.to(device), weights, biases


def _energies_outputs(kernel: bool, device):
    """Loss (log Z − target + logits), logits and every gradient of one exact-loss step on either path."""
    g, indptr, indices, weights, biases = _problem(device)
    V, d = indptr.numel() - 1, weights.shape[-1]
    sources = torch.randint(0, V, (12,), generator=g).to(device)
    targets = torch.randint(0, V, (12,), generator=g).to(device)
    x, pe = (torch.randn(12, d, generator=g).to(device) for _ in range(2))
    bias = torch.randn(V, generator=g).to(device)
    leaves = [t.clone().requires_grad_() for t in (x, pe, weights, biases, bias)]  # PE: where x·edge_base goes
    x, pe, weights, biases, bias = leaves
    plan = (make_kernel_plan if kernel else make_torch_plan)(sources, indptr, indices, V)
    src, tgt = sources[plan.order], targets[plan.order]
    energies, shared = candidate_energies(x[plan.order], pe[plan.order], weights, biases, plan, True, None, bias)
    rows = edge_rows_from_keys(edge_keys(indptr, indices, V), src, tgt, V)
    true = target_energies(energies, shared, plan, tgt, rows, indptr[src] + 1, bias)
    log_z = exact_log_partition(energies, shared, plan, V, bias)
    logits = scatter_logits(energies, shared, plan, V, bias)
    loss = (log_z - true).mean() + (logits * torch.linspace(-1, 1, V, device=device)).mean()
    loss.backward()
    return [loss, logits] + [t.grad for t in leaves]


def _successor_outputs(kernel: bool, device):
    """One-token logits of 5 positions with `non_edge_bias`, on either path."""
    g, indptr, indices, weights, biases = _problem(device, seed=1)
    V, d = indptr.numel() - 1, weights.shape[-1]
    sources = torch.randint(0, V, (5,), generator=g).to(device)
    x, pe = (torch.randn(5, d, generator=g).to(device) for _ in range(2))
    bias = torch.randn(V, generator=g).to(device)
    args = (x, pe, weights, biases, sources, indptr, indices, V, graph_max_degree(indptr), bias)
    with torch.no_grad():
        if kernel:
            return [kernel_successor_logits(x, pe, weights, biases.reshape(weights.shape[0], -1), *args[4:])]
        return [ref_successor_logits_static(*args)]


def _scan_outputs(kernel: bool, device):
    """A plain scan, and one with the matrix every edge shares (config.edge_backoff), signal dropout and the nodes'
    own vectors (config.node_embedding)."""
    return _one_scan(kernel, device, False) + _one_scan(kernel, device, True)


def _one_scan(kernel: bool, device, options: bool):
    """Signals, final state and every gradient of a (3, 6) scan with a padded column and a first token."""
    g, indptr, indices, weights, biases = _problem(device, seed=2)
    P, d = weights.shape[0], weights.shape[-1]
    B, L = 3, 6
    rows = torch.randint(0, P, (B, L), generator=g).to(device)
    has_edge = (torch.rand(B, L, generator=g) < 0.8).to(device)
    signal, mix_norm = torch.randn(B, d, generator=g), torch.rand(B, generator=g) + 1
    state = [signal, signal * mix_norm.unsqueeze(1), mix_norm, torch.randn(B, generator=g)]  # signal = sum / norm
    mix_weight, pe = torch.randn(B, L, generator=g), torch.randn(B, L, d, generator=g)
    pe = pe.to(device)  # fixed sinusoids in the model: no gradient (the kernel returns none)
    leaves = [t.to(device).requires_grad_() for t in (*state, mix_weight)] + [
        weights.clone().requires_grad_(), biases.clone().requires_grad_()]
    edge_base = keep = node_add = None
    if options:
        edge_base = (torch.randn(d, d, generator=g) * 0.5).to(device).requires_grad_()
        node_add = (torch.randn(B, L, d, generator=g) * 0.5).to(device).requires_grad_()
        leaves += [edge_base, node_add]
        keep = ((torch.rand(B, L + 1, d, generator=g) > 0.25).float() / 0.75).to(device)  # dropout p = 0.25
    signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases = leaves[:7]
    args = (signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe)
    if kernel:
        stacked, *rest = kernel_signal_scan(*args, edge_base=edge_base, keep=None if keep is None else keep[:, :-1],
                                            node_add=node_add)
        outputs = [stacked if keep is None else stacked * keep[:, 1:], stacked[:, -1], *rest]
    else:
        outputs = list(ref_signal_scan(*args, keep=keep, edge_base=edge_base, node_add=node_add))
    loss = sum((o * torch.linspace(-1, 1, o.numel(), device=device).view(o.shape)).sum() for o in outputs)
    loss.backward()
    return outputs + [t.grad for t in leaves]


def _decode_outputs(kernel: bool, device):
    """A decode step without and with the matrix every edge shares (config.edge_backoff) and the nodes' own
    vectors (config.node_embedding)."""
    return _one_decode(kernel, device, False) + _one_decode(kernel, device, True)


def _one_decode(kernel: bool, device, shared_matrix: bool):
    """Logits and state of one decode step of 4 rows: a real edge, a non-edge, a node without successors."""
    g, indptr, indices, weights, biases = _problem(device, seed=3)
    V, d = indptr.numel() - 1, weights.shape[-1]
    B = 4
    tokens = torch.randint(0, V, (B,), generator=g).to(device)
    last = torch.tensor([0, V - 1, 2, 3], device=device)
    state = [torch.randn(B, d, generator=g), torch.rand(B, d, generator=g), torch.rand(B, generator=g) + 1,
             torch.randn(B, generator=g)]
    signal, mix_sum, mix_norm, mix_max = (t.to(device) for t in state)
    length = torch.tensor([1, 3, 7, 12], device=device)  # 12: past the position weights (the last one is used)
    positions = torch.randn(1, 10, 1, generator=g).to(device)
    pe_now, pe_next = (torch.randn(B, d, generator=g).to(device) for _ in range(2))
    bias = torch.randn(V, generator=g).to(device)
    edge_base = (torch.randn(d, d, generator=g) * 0.5).to(device) if shared_matrix else None
    node_add = (torch.randn(V, d, generator=g) * 0.5).to(device)[tokens] if shared_matrix else None
    args = (tokens, signal, mix_sum, mix_norm, mix_max, length, last, weights, biases)
    with torch.no_grad():
        if kernel:
            logits, new = kernel_decode_step(*args[:7], weights, biases.reshape(weights.shape[0], -1),
                                             positions.reshape(-1), pe_now, pe_next, indptr, indices, V,
                                             graph_max_degree(indptr), bias, edge_base, node_add)
        else:
            logits, new = ref_decode_step(*args, positions, pe_now, pe_next, indptr, indices,
                                          edge_keys(indptr, indices, V), V, graph_max_degree(indptr), bias,
                                          edge_base, node_add)
    return [logits, *(t.float() for t in new)]


def _adamw_outputs(kernel: bool, device):
    """Parameter and moments after one update of 7 rows (duplicates, row 0 at half the learning rate)."""
    g = torch.Generator().manual_seed(4)
    param, exp_avg = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g) * 0.1
    exp_avg_sq = torch.rand(12, 16, generator=g) * 0.01
    param, exp_avg, exp_avg_sq = (t.to(device) for t in (param, exp_avg, exp_avg_sq))
    rows = torch.tensor([5, 0, 3, 5, 11, 0, 2], device=device)
    values = torch.randn(7, 16, generator=g).to(device)
    step, hyper = torch.tensor(3.0), (1e-2, 0.9, 0.999, 1e-8, 0.1)
    run = kernel_adamw_rows if kernel else ref_adamw_rows
    run(param, exp_avg, exp_avg_sq, rows, values, step, hyper, first_row_scale=0.5)
    return [param, exp_avg, exp_avg_sq]


CHECKS = {  # kernel name -> (what is compared, the outputs of one small problem on either path)
    "candidate_energies": ("energies forward/backward, log Z, target, logits", _energies_outputs),
    "successor_logits": ("one-token logits", _successor_outputs),
    "signal_scan": ("recurrence scan forward/backward", _scan_outputs),
    "decode_step": ("decode step logits and state", _decode_outputs),
    "adamw_rows": ("SparseAdamW fused row update", _adamw_outputs),
}


def check_kernel(name: str, device) -> CheckResult:
    """Run kernel `name` and its torch reference on one small random problem on `device`; compare."""
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


def _warn(result: CheckResult, device):
    """The one warning for a kernel switched off: what failed, what runs instead, how to report it."""
    why = result.failure or f"its results differ from the torch path by {result.error:.2e} (relative)"
    warnings.warn(
        f"BriLLM's Triton kernel {result.name} is switched off on {device}: {why}. The torch path runs in its place "
        "(the same math, slower). Please report this with the output of `python -m modeling_brillm.selfcheck` and "
        "your GPU, torch and triton versions; BRILLM_BACKEND=torch runs the torch path everywhere.",
        RuntimeWarning, stacklevel=3)


def run_self_check(device, names=KERNELS, warn: bool = True) -> list[CheckResult]:
    """Check every kernel in `names` on `device` against its torch reference; switch off (and warn about, once)
    each one that fails. The result of every check, in order."""
    device = torch.device(device)
    key = _device_key(device)
    _checked.add(key)
    off = _disabled.setdefault(key, {})
    results = []
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for name in names:
            result = check_kernel(name, device)
            results.append(result)
            if not result.ok and name not in off:
                off[name] = result.failure or f"error {result.error:.2e}"
                if warn:
                    _warn(result, device)
    return results


__all__ = [
    "CandidatePlan",
    "CheckResult",
    "EdgeGradLink",
    "KERNELS",
    "KernelPlan",
    "adamw_rows",
    "candidate_energies",
    "check_kernel",
    "decode_step",
    "disabled_kernels",
    "edge_keys",
    "edge_rows_from_keys",
    "edge_update",
    "exact_log_partition",
    "gather_edges",
    "graph_max_degree",
    "kernel_enabled",
    "make_plan",
    "mix_in",
    "non_edge_log_mass",
    "release_workspaces",
    "reset_self_check",
    "run_self_check",
    "scatter_logits",
    "signal_scan",
    "successor_logits",
    "successor_logits_static",
    "target_energies",
]
