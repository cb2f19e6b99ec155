"""The owner's local edge table and the row transport, over the model's *row-indexed parameters* (first dimension
the edge row: `weights` (P, d, d), `biases` (P, 1, d), or a variant's `BriLLMModel.edge_row_parameters`). Of each,
a process keeps row 0 (the shared edge) and its sources' rows: local row = global row + `local_offset[source]`."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import gather_edges

ROW_PARAMETERS = ("weights", "biases")


def global_rows_of(sources: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """The global edge rows (> 0) of the blocks of `sources`, in the given order."""
    starts, sizes = indptr[sources] + 1, indptr[sources + 1] - indptr[sources]
    total = int(sizes.sum())
    first = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
    return first + torch.arange(total)


class _Rows(torch.autograd.Function):
    """`table[rows]` with a sparse COO gradient over the rows (as nn.Embedding(sparse=True)), any row shape."""

    @staticmethod
    def forward(ctx, table, rows):
        ctx.shape = table.shape
        ctx.save_for_backward(rows)
        return table.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        return torch.sparse_coo_tensor(ctx.saved_tensors[0].unsqueeze(0), grad, ctx.shape, check_invariants=False), None


class LocalTable(nn.Module):
    """Which rows this process holds and how global rows map to them (buffers: `.to(device)` moves them)."""

    def __init__(self, owners: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor | None, rank: int,
                 base_model, device):
        super().__init__()
        self.names = tuple(getattr(base_model, "edge_row_parameters", ROW_PARAMETERS))
        self.rank, owned = rank, owners == rank
        local_indptr = torch.zeros_like(indptr)
        local_indptr[1:] = torch.cumsum(torch.where(owned, indptr.diff(), 0), 0)
        self.register_buffer("owners", owners.to(device), persistent=False)
        self.register_buffer("local_offset", (local_indptr[:-1] - indptr[:-1]).to(device), persistent=False)
        self.register_buffer("local_indptr", local_indptr.to(device), persistent=False)
        self.register_buffer("global_indptr", indptr.to(device), persistent=False)
        self.local_rows = global_rows_of(owned.nonzero().flatten(), indptr)  # (R,) global rows, ascending
        self.register_buffer("local_indices", None if indices is None else indices[self.local_rows - 1].to(device),
                             persistent=False)

    def owned_sources(self) -> torch.Tensor:
        return (self.owners == self.rank).nonzero().flatten().cpu()

    def source_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Source node of global edge rows (> 0)."""
        if self.local_indices is None:  # dense: row = 1 + u·V + v
            return (rows - 1) // (self.global_indptr.numel() - 1)
        return torch.searchsorted(self.global_indptr, rows - 1, right=True) - 1

    def to_local(self, rows: torch.Tensor) -> torch.Tensor:
        """Local row of global rows of owned sources (row 0 stays 0)."""
        src = self.source_of_rows(rows.clamp_min(1))
        return torch.where(rows > 0, rows + self.local_offset[src], torch.zeros_like(rows))

    def cut(self, base_model):
        """Replace each row-indexed parameter of `base_model` by its local rows (empty from the meta device)."""
        keep = torch.cat([torch.zeros(1, dtype=torch.long), self.local_rows])
        for name in self.names:
            p, device = getattr(base_model, name).detach(), self.owners.device
            rows = (torch.empty(len(keep), *p.shape[1:], device=device) if p.device.type == "meta"
                    else p.index_select(0, keep.to(p.device)).to(device))
            setattr(base_model, name, nn.Parameter(rows))

    def fetch(self, base_model, transport, rows: torch.Tensor, link, anchors: list) -> list[torch.Tensor]:
        """`edge_fetch`: one (B, L, *row shape) tensor per row-indexed parameter of the (B, L) global `rows`, from their
        owners (ids there, rows back, gradients back again); `anchors` collects what arrived, for the loss's graph."""
        params = [getattr(base_model, name) for name in self.names]
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        dest = torch.where(uniq > 0, self.owners[self.source_of_rows(uniq.clamp_min(1))],
                           torch.full_like(uniq, self.rank))  # row 0 is replicated: served locally
        order, send, recv = transport.route(dest)
        wanted = self.to_local(transport.exchange(uniq[order], send, recv, differentiable=False))
        if self.names == ROW_PARAMETERS:  # the model's own table: the rows' gradient joins the candidate gradient
            served = gather_edges(*params, wanted, True, link)
        else:
            served = [_Rows.apply(p, wanted) for p in params]
        widths = [math.prod(p.shape[1:]) for p in params]
        payload = torch.cat([t.reshape(wanted.numel(), n) for t, n in zip(served, widths)], 1)
        got = transport.exchange(payload, recv, send, differentiable=True)
        anchors.append(got)
        steps = got.index_select(0, torch.argsort(order)).index_select(0, inverse)  # back to `rows` order
        return [t.reshape(*rows.shape, *p.shape[1:]) for t, p in zip(steps.split(widths, 1), params)]
