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


def _flag(p, value: bool) -> torch.Tensor:
    return torch.tensor([float(value)], device=p.device)


def _sparse(p, rows, values, **kw) -> torch.Tensor:  # rows valid by construction
    return torch.sparse_coo_tensor(rows.view(1, -1), values, p.shape, check_invariants=False, **kw)


def _shared_row(p, parts: list, finish: list):
    """Row 0 of a row-indexed parameter (the shared edge): the sum of its entries (no `coalesce()`, which would sort
    every touched row's values) and whether this process touched it."""
    g = p.grad
    if g is not None and not g.is_sparse:
        raise RuntimeError("ShardedBriLLM expects sparse gradients for its edge table.")
    pos = (g._indices()[0] == 0).nonzero().flatten() if g is not None else None
    hit = pos is not None and bool(pos.numel())
    total = g._values().index_select(0, pos).sum(0) if hit else torch.zeros(p.shape[1:], device=p.device)
    parts.append(torch.cat([total.reshape(-1).float(), _flag(p, hit)]))
    finish.append(lambda summed: _put_shared_row(p, summed[:-1], pos if hit else None, float(summed[-1]) > 0))


def _put_shared_row(p, summed: torch.Tensor, pos: torch.Tensor | None, touched_anywhere: bool):
    g = p.grad
    if pos is not None:  # the first row-0 entry holds the global sum, the others (duplicates) become zero
        values = g._values()
        values[pos[0]].copy_(summed.view_as(values[0]))
        if pos.numel() > 1:
            values.index_fill_(0, pos[1:], 0.0)
    elif touched_anywhere:  # row 0 first keeps sorted rows sorted (SparseAdamW's fast path)
        rows, values = [torch.zeros(1, dtype=torch.long, device=p.device)], [summed.view(1, *p.shape[1:])]
        if g is not None:
            rows.append(g._indices()[0])
            values.append(g._values())
        p.grad = _sparse(p, torch.cat(rows), torch.cat(values), is_coalesced=g is None or g.is_coalesced())
    elif g is None:  # every table counts every step, as one process's does: an empty gradient
        p.grad = _sparse(p, torch.zeros(0, dtype=torch.long, device=p.device),
                         torch.zeros(0, *p.shape[1:], device=p.device))


def _sparse_rows(p, parts: list, finish: list):
    """A replicated parameter with row-sparse gradients: its rows' sums and which rows any process touched."""
    V, k = p.shape[0], math.prod(p.shape[1:])
    dense = torch.zeros(V, k + 1, device=p.device)
    if p.grad is not None:
        g = p.grad.coalesce()
        idx = g._indices()[0]
        dense[:, :k].index_add_(0, idx, g._values().reshape(-1, k))
        dense[idx, k] = 1.0
    parts.append(dense)

    def done(summed):
        summed = summed.view(V, k + 1)
        rows = (summed[:, k] > 0).nonzero().flatten()
        p.grad = (_sparse(p, rows, summed[rows, :k].reshape(-1, *p.shape[1:]).contiguous(), is_coalesced=True)
                  if rows.numel() else None)

    finish.append(done)


def _dense(p, parts: list, finish: list):
    """A replicated parameter whose one-process gradient is dense: its sum wherever any process had one."""
    has = p.grad is not None
    parts.append(torch.cat([(p.grad.reshape(-1) if has else torch.zeros(p.numel(), device=p.device)).float(),
                            _flag(p, has)]))
    finish.append(lambda summed: setattr(p, "grad", summed[:-1].view_as(p).to(p.dtype).clone()
                                         if float(summed[-1]) > 0 else None))


def clip_grad_norm_(base_model, row_names, transport, parameters, max_norm: float) -> float:
    """Clip every gradient by the global L2 norm as `torch.nn.utils.clip_grad_norm_` does in one process; returns
    that norm (before clipping), the same on every process. Each owner adds its own rows' squared norms, rank 0
    the replicated parameters' (identical everywhere after the reduction); one all-reduce of that scalar."""
    owned = torch.zeros((), dtype=torch.float64, device=base_model.node_bias.device)
    replicated = torch.zeros_like(owned)
    for name in row_names:
        grad = getattr(base_model, name).grad
        if grad is not None:
            rows, squares = _row_squares(grad)
            replicated += squares[rows == 0].sum()
            owned += squares[rows != 0].sum()
    for _, p in replicated_parameters(base_model, row_names):
        if p.grad is not None:
            replicated += _row_squares(p.grad)[1].sum()
    total = owned + replicated if transport.rank == 0 else owned
    norm = float(transport.all_reduce(total.reshape(1))[0].sqrt())
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
    rows = grad._indices()[0]
    values = grad._values().detach().reshape(rows.numel(), -1)
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
