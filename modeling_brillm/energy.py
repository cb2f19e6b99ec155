"""Energies of every candidate edge: the costly part of BriLLM, computed block by block.

For a signal x at a position whose current node is u, every real successor v of u gets the energy
E_v = ‖GeLU(x·W[u→v] + b[u→v] + PE)‖₂, and every other node gets one shared energy from edge row 0.
Positions are grouped by source node so each source's block of edge matrices (contiguous, CSR order) is
read once per call; the backward writes gradients for the touched rows only (dense or sparse COO).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CandidatePlan:
    """Which rows each position reads, in the order the energies come out (no autograd, built once per call)."""

    order: torch.Tensor  # (N,) positions sorted by source node (stable)
    group_sizes: list[int]  # positions per distinct source, in sorted order
    block_starts: list[int]  # first edge row of each group's block
    block_sizes: list[int]  # real successors of each group's source
    degree: torch.Tensor  # (N,) real successors of each sorted position
    entry_position: torch.Tensor  # (M,) sorted position of every packed energy
    entry_target: torch.Tensor  # (M,) target node of every packed energy
    entry_start: torch.Tensor  # (N,) offset of each sorted position's first packed energy
    has_shared: bool  # sparse graph: non-successors get the shared energy

    @property
    def num_entries(self) -> int:
        return self.entry_target.numel()


def make_plan(sources: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, vocab_size: int) -> CandidatePlan:
    """Plan for positions whose current nodes are `sources` (N,). `indices=None` means a dense graph."""
    order = torch.argsort(sources, stable=True)
    sorted_src = sources[order]
    group_src, group_sizes = torch.unique_consecutive(sorted_src, return_counts=True)
    starts, ends = indptr[group_src], indptr[group_src + 1]
    degree = (indptr[sorted_src + 1] - indptr[sorted_src])
    entry_start = torch.cumsum(degree, 0) - degree
    total = int(degree.sum())
    entry_position = torch.repeat_interleave(torch.arange(sources.numel(), device=sources.device), degree)
    within = torch.arange(total, device=sources.device) - entry_start[entry_position]
    if indices is None:
        entry_target = within
    else:
        entry_target = indices[indptr[sorted_src][entry_position] + within]
    return CandidatePlan(
        order=order,
        group_sizes=group_sizes.tolist(),
        block_starts=(starts + 1).tolist(),
        block_sizes=(ends - starts).tolist(),
        degree=degree,
        entry_position=entry_position,
        entry_target=entry_target,
        entry_start=entry_start,
        has_shared=indices is not None,
    )


def _energy(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = F.gelu(h)
    return y, torch.linalg.vector_norm(y, dim=-1)


def _energy_backward(h: torch.Tensor, grad_e: torch.Tensor) -> torch.Tensor:
    """d(‖GeLU(h)‖)/dh times grad_e, for h (..., d) and grad_e (...)."""
    y, e = _energy(h)
    grad_y = (grad_e / e.clamp_min(torch.finfo(e.dtype).tiny)).unsqueeze(-1) * y
    return torch.ops.aten.gelu_backward(grad_y, h)


class _CandidateEnergies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pe, weights, biases, plan: CandidatePlan, sparse_grad: bool):
        # x, pe: (N, d) in sorted order. Returns packed real-successor energies (M,) and shared energies (N,).
        xs, pes = x.split(plan.group_sizes), pe.split(plan.group_sizes)
        pre, out = [], []
        for xg, pg, r0, n in zip(xs, pes, plan.block_starts, plan.block_sizes):
            if n == 0:
                pre.append(None)
                continue
            # (n, m, d): every successor edge applied to every position of this source at once
            h = torch.bmm(xg.expand(n, -1, -1), weights[r0:r0 + n])
            h += biases[r0:r0 + n].unsqueeze(1)
            h += pg
            pre.append(h)
            out.append(_energy(h)[1].t().reshape(-1))
        energies = torch.cat(out) if out else x.new_zeros(0)
        if plan.has_shared:
            h_shared = torch.addmm(biases[0] + pe, x, weights[0]) if x.numel() else pe.clone()
            shared = _energy(h_shared)[1]
        else:
            h_shared, shared = None, x.new_zeros(x.shape[0])
        ctx.plan, ctx.pre, ctx.h_shared, ctx.sparse_grad = plan, pre, h_shared, sparse_grad
        ctx.weight_shape, ctx.bias_shape = weights.shape, biases.shape
        ctx.save_for_backward(x, weights)
        return energies, shared

    @staticmethod
    def backward(ctx, grad_energies, grad_shared):
        x, weights = ctx.saved_tensors
        plan, d = ctx.plan, x.shape[1]
        grad_x = torch.zeros_like(x)
        if grad_energies is None:
            grad_energies = x.new_zeros(plan.num_entries)
        touched = sum(n for n in plan.block_sizes) + (1 if plan.has_shared else 0)
        if ctx.sparse_grad:
            # values of the touched rows, in ascending row order: shared row 0 first, then blocks by source
            grad_w = weights.new_empty(touched, d, d)
            grad_b = weights.new_empty(touched, d)
            rows = []
        else:
            grad_w = weights.new_zeros(ctx.weight_shape)
            grad_b = weights.new_zeros(ctx.bias_shape)
        offset = 1 if (plan.has_shared and ctx.sparse_grad) else 0
        if plan.has_shared:
            gs = grad_shared if grad_shared is not None else x.new_zeros(x.shape[0])
            gh = _energy_backward(ctx.h_shared, gs)
            torch.mm(x.t(), gh, out=grad_w[0])
            torch.sum(gh, 0, out=grad_b[0])
            grad_x.addmm_(gh, weights[0].t())
            if ctx.sparse_grad:
                rows.append(torch.zeros(1, dtype=torch.long, device=x.device))
        xs, gxs = x.split(plan.group_sizes), grad_x.split(plan.group_sizes)
        start = 0
        for xg, gxg, h, r0, n, m in zip(xs, gxs, ctx.pre, plan.block_starts, plan.block_sizes, plan.group_sizes):
            if n == 0:
                continue
            ge = grad_energies[start:start + m * n].view(m, n).t()
            start += m * n
            gh = _energy_backward(h, ge)  # (n, m, d)
            dst = slice(offset, offset + n) if ctx.sparse_grad else slice(r0, r0 + n)
            torch.bmm(xg.t().expand(n, -1, -1), gh, out=grad_w[dst])
            torch.sum(gh, 1, out=grad_b[dst])
            gxg += torch.bmm(gh, weights[r0:r0 + n].transpose(1, 2)).sum(0)
            if ctx.sparse_grad:
                rows.append(torch.arange(r0, r0 + n, device=x.device))
                offset += n
        ctx.pre = ctx.h_shared = None
        if ctx.sparse_grad:
            index = torch.cat(rows).unsqueeze(0) if rows else torch.zeros(1, 0, dtype=torch.long, device=x.device)
            grad_w = torch.sparse_coo_tensor(index, grad_w, ctx.weight_shape, is_coalesced=True)
            grad_b = torch.sparse_coo_tensor(index, grad_b, ctx.bias_shape, is_coalesced=True)
        return grad_x, None, grad_w, grad_b, None, None


def candidate_energies(x, pe, weights, biases, plan: CandidatePlan, sparse_grad: bool = False):
    """Energies of every real successor (packed, see `CandidatePlan`) and the shared energy of every position.

    `x` and `pe` are (N, d) in the plan's sorted order. With `sparse_grad`, the gradients of `weights` and
    `biases` are sparse COO tensors over the touched rows (coalesced), as `nn.Embedding(sparse=True)` gives.
    """
    return _CandidateEnergies.apply(x, pe, weights, biases, plan, sparse_grad)


def scatter_logits(energies, shared, plan: CandidatePlan, vocab_size: int) -> torch.Tensor:
    """Full (N, V) logits in sorted order: the shared energy everywhere, real successors' energies on top."""
    n = shared.shape[0]
    logits = shared.unsqueeze(1).expand(n, vocab_size).contiguous()
    return logits.index_put((plan.entry_position, plan.entry_target), energies)


def exact_log_partition(energies, shared, plan: CandidatePlan, vocab_size: int) -> torch.Tensor:
    """log Σ_v exp(E_v) over all V nodes per position, with the V − degree non-successors sharing one energy.

    Cost follows the real successors (M packed energies), not N·V.
    """
    n = shared.shape[0]
    num_shared = (vocab_size - plan.degree).to(shared.dtype)
    has_shared = num_shared > 0
    peak = torch.where(has_shared, shared, torch.full_like(shared, float("-inf")))
    if plan.num_entries:
        peak = peak.scatter_reduce(0, plan.entry_position, energies, "amax", include_self=True)
    peak = peak.detach()
    total = torch.where(has_shared, num_shared * torch.exp(shared - peak), torch.zeros_like(shared))
    if plan.num_entries:
        total = total.index_add(0, plan.entry_position, torch.exp(energies - peak[plan.entry_position]))
    return peak + torch.log(total)


def target_energies(energies, shared, plan: CandidatePlan, targets: torch.Tensor, target_rows, block_first_row):
    """Energy each sorted position gives its target node: the real edge's, or the shared one.

    `target_rows` (N,) are the edge rows of source→target (0 = shared); `block_first_row` (N,) the first row of
    each position's block.
    """
    real = target_rows > 0
    entry = plan.entry_start + (target_rows - block_first_row).clamp_min(0)
    picked = energies[entry.clamp_max(max(plan.num_entries - 1, 0))] if plan.num_entries else shared
    return torch.where(real, picked, shared)


__all__ = ["CandidatePlan", "make_plan", "candidate_energies", "scatter_logits", "exact_log_partition", "target_energies"]
