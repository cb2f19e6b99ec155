"""Gradients of the sharded trainer: owned rows' stay on their owner; what every process holds whole is summed in one
all-reduce, each part with a flag of whether this process had a gradient (lazy AdamW steps a row iff the global
batch touched it); and the global gradient norm."""

from __future__ import annotations

import math

import torch

SPARSE_REPLICATED = ("node_bias",)  # replicated parameters whose gradient is sparse in rows


def replicated_parameters(base_model, row_names) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter each process holds whole: all but the row-indexed ones."""
    return [(n, p) for n, p in base_model.named_parameters() if n not in row_names]


def reduce_gradients(base_model, row_names, transport):
    """Sum the replicated gradients over the processes (once per optimizer step, after backward)."""
    parts, finish = [], []
    for name in row_names:
        _shared_row(getattr(base_model, name), parts, finish)
    for name, p in replicated_parameters(base_model, row_names):
        (_sparse_rows if name in SPARSE_REPLICATED else _dense)(p, parts, finish)
    flat = transport.all_reduce(torch.cat([t.float().reshape(-1) for t in parts]))
    for done, summed in zip(finish, flat.split([t.numel() for t in parts])):
        done(summed)


def _sparse(p, rows, values, **kw) -> torch.Tensor:  # rows valid by construction
    return torch.sparse_coo_tensor(rows.view(1, -1), values, p.shape, check_invariants=False, **kw)


def _shared_row(p, parts: list, finish: list):
    """Row 0 of a row-indexed parameter (the shared edge): the sum of its entries (no `coalesce()`, which would sort
    every touched row's values) and whether this process touched it."""
    g = p.grad
    if g is not None and not g.is_sparse:
        raise RuntimeError("ShardedBriLLM expects sparse gradients for its edge table.")
    pos = (g._indices()[0] == 0).nonzero().flatten() if g is not None else torch.zeros(0, dtype=torch.long)
    total = g._values().index_select(0, pos).sum(0) if pos.numel() else torch.zeros(p.shape[1:], device=p.device)
    parts.append(torch.cat([total.reshape(-1).float(), torch.tensor([float(pos.numel() > 0)], device=p.device)]))

    def done(summed):
        row, g = summed[:-1].view(1, *p.shape[1:]), p.grad
        if pos.numel():  # the first row-0 entry holds the global sum, the others (duplicates) become zero
            g._values()[pos[0]].copy_(row[0])
            g._values().index_fill_(0, pos[1:], 0.0)
        elif float(summed[-1]) > 0:  # touched elsewhere: row 0 first keeps sorted rows sorted (SparseAdamW's fast path)
            zero = torch.zeros(1, dtype=torch.long, device=p.device)
            p.grad = _sparse(p, zero, row) if g is None else _sparse(
                p, torch.cat([zero, g._indices()[0]]), torch.cat([row, g._values()]), is_coalesced=g.is_coalesced())
        elif g is None:  # every table counts every step, as one process's does: an empty gradient
            p.grad = _sparse(p, torch.zeros(0, dtype=torch.long, device=p.device), row[:0])

    finish.append(done)


def _sparse_rows(p, parts: list, finish: list):
    """A replicated parameter with row-sparse gradients: its rows' sums and which rows any process touched."""
    V, k = p.shape[0], math.prod(p.shape[1:])
    dense = torch.zeros(V, k + 1, device=p.device)
    if p.grad is not None:
        g = p.grad.coalesce()
        dense[:, :k].index_add_(0, g._indices()[0], g._values().reshape(-1, k))
        dense[g._indices()[0], k] = 1.0
    parts.append(dense)

    def done(summed):
        summed = summed.view(V, k + 1)
        rows = (summed[:, k] > 0).nonzero().flatten()
        p.grad = (_sparse(p, rows, summed[rows, :k].reshape(-1, *p.shape[1:]).contiguous(), is_coalesced=True)
                  if rows.numel() else None)

    finish.append(done)


def _dense(p, parts: list, finish: list):
    """A replicated parameter whose one-process gradient is dense: its sum wherever any process had one."""
    grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
    parts.append(torch.cat([grad.float(), torch.tensor([float(p.grad is not None)], device=p.device)]))
    finish.append(lambda summed: setattr(p, "grad", summed[:-1].view_as(p).to(p.dtype).clone()
                                         if float(summed[-1]) > 0 else None))


def clip_grad_norm_(base_model, row_names, transport, parameters, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` of one process: each owner's rows' squared norms, rank 0's replicated ones
    (the same everywhere once reduced), one all-reduce; returns the norm before clipping, the same everywhere."""
    owned = torch.zeros((), dtype=torch.float64, device=base_model.node_bias.device)
    replicated = torch.zeros_like(owned)
    for name in row_names:
        if getattr(base_model, name).grad is not None:
            rows, squares = _row_squares(getattr(base_model, name).grad)
            replicated += squares[rows == 0].sum()
            owned += squares[rows != 0].sum()
    for _, p in replicated_parameters(base_model, row_names):
        replicated += _row_squares(p.grad)[1].sum() if p.grad is not None else 0.0
    norm = float(transport.all_reduce((owned + replicated if transport.rank == 0 else owned).reshape(1))[0].sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        for p in parameters:
            if p.grad is not None:
                (p.grad._values() if p.grad.is_sparse else p.grad).mul_(coef)
    return norm


def _row_squares(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, squared L2 norm of each row, float64) of a gradient; a sparse one's duplicate rows summed first."""
    if not grad.is_sparse:
        flat = grad.detach().reshape(grad.shape[0], -1) if grad.dim() else grad.detach().reshape(1, 1)
        return torch.arange(flat.shape[0], device=grad.device), _squares(flat)
    rows, values = grad._indices()[0], grad._values().detach().reshape(grad._nnz(), -1)
    squares = _squares(values)
    if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
        return rows, squares
    uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
    dup = counts[inverse] > 1
    if not bool(dup.any()):
        return rows, squares
    dup_rows = uniq[counts > 1]  # the norm of a duplicated row is that of its entries' sum
    merged = values.new_zeros(dup_rows.numel(), values.shape[1])
    merged.index_add_(0, torch.searchsorted(dup_rows, rows[dup]), values[dup])
    return torch.cat([rows[~dup], dup_rows]), torch.cat([squares[~dup], _squares(merged)])


def _squares(values: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of every row of (n, k) values, in float64."""
    if values.numel() == 0:
        return values.new_zeros(values.shape[0], dtype=torch.float64)
    return torch.linalg.vector_norm(values.float(), dim=1).double().square()
