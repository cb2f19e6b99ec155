"""`ShardedBriLLM`: the model's own `run_signals` (rows fetched from their owners) and `score` (on the owner of a
position's source). Owned rows' gradients stay there; the replicated ones are summed in one all-reduce with a flag
each of whether a process had one (lazy AdamW steps a row iff the global batch touched it)."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..backend import exact_precision
from ..losses import shift_labels
from ..modeling_brillm import BriLLMForCausalLM, initial_positions
from ..ops import EdgeGradLink
from ..optimization import parameter_groups
from ..validation import check_labels
from . import checkpoint
from .table import LocalTable, Transport, replicated_parameters


@dataclass
class ShardedOutput:
    loss: torch.Tensor  # the token-weighted mean over the global batch (its gradient: this process's share)
    num_targets: int  # scored positions in the global batch
    owned_targets: int = 0  # scored here, as the owner of their sources


class ShardedBriLLM(nn.Module):
    """A `BriLLMForCausalLM` whose row-indexed parameters are cut to this process's sources (`LocalTable`)."""

    def __init__(self, model, owners: torch.Tensor | None = None):
        super().__init__()
        self.transport, self.model = Transport(), model
        self.table = LocalTable(model, owners, self.rank, self.world_size)
        self.model.sparse_gradients = True  # node_bias's gradient: the rows of the sequences' first tokens
        self._link, self._unreduced = None, False  # _unreduced: a backward ran since the last reduce_gradients

    @classmethod
    def from_config(cls, config, graph=None, owners=None, seed: int = 0, device=None) -> "ShardedBriLLM":
        """A fresh model that never builds the whole table: blocks seeded per source, alike on any process count."""
        with torch.device("meta"):
            model = BriLLMForCausalLM(config)
        m, device, r, d = model.base_model, torch.device(device or "cpu"), config.initializer_range, config.node_size
        gen = torch.Generator().manual_seed(seed)
        m.node_bias = nn.Parameter(torch.empty(config.vocab_size, 1, d).uniform_(-r, r, generator=gen).to(device))
        m.positions = nn.Parameter(initial_positions(config, device))
        if m.start_signals is not None:  # 1/d, the release's uniform start, as BriLLMForCausalLM initialises it
            m.start_signals = nn.Parameter(torch.full((config.num_start_signals, d), 1.0 / d, device=device))
        for name in checkpoint.EXTENSIONS:  # zero: the release's
            if getattr(m, name) is not None:
                setattr(m, name, nn.Parameter(torch.zeros(getattr(m, name).shape, device=device)))
        for module in model.modules():  # the graph's and the count prior's tables: filled by set_graph
            for name, buf in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device),
                                       persistent=name not in module._non_persistent_buffers_set)
        if graph is not None:
            model.set_graph(graph)
        return cls(model, owners=owners)._initialise_rows(seed)

    @torch.no_grad()
    def _initialise_rows(self, seed: int) -> "ShardedBriLLM":
        """Uniform(±initializer_range): row 0 from the generator of (seed, V), each source's block from (seed, u)."""
        cfg, params = self.config, [getattr(self.model.base_model, n) for n in self.table.names]
        r, local = cfg.initializer_range, self.table.local_indptr.tolist()
        owned = [(u, local[u] + 1, local[u + 1] + 1) for u in self.table.owned_sources().tolist()]
        for key, a, e in [(cfg.vocab_size, 0, 1), *owned]:  # (generator key, first row, end): row 0, then the blocks
            if e > a:  # a source without successors has no rows
                g = torch.Generator().manual_seed(seed * 1_000_003 + key)
                for p in params:
                    p[a:e].copy_(torch.empty(e - a, *p.shape[1:]).uniform_(-r, r, generator=g))
        return self

    config = property(lambda self: self.model.config)
    rank = property(lambda self: self.transport.rank)
    world_size = property(lambda self: self.transport.world)
    owners = property(lambda self: self.table.owners, doc="The owner (V,) of every source node.")
    bytes_sent = property(lambda self: self.transport.bytes_sent, doc="Bytes sent to other processes so far.")

    parameter_groups = parameter_groups  # as one process makes them: local row 0 is the shared edge, as it expects

    @exact_precision
    def forward(self, input_ids, attention_mask=None, labels=None, loss_type: str | None = None,
                signal_ids=None, dropout_rows=None, dropout_seed: int | None = None) -> ShardedOutput:
        """The global batch's loss from this process's sequences (keywords: `BriLLMForCausalLM.forward`'s;
        `dropout_rows`: the rows' indices in the global batch). Every process calls it as often as the others."""
        m, loss_type = self.model.base_model, loss_type or self.config.loss_type
        if labels is None:
            raise ValueError("ShardedBriLLM computes the training loss only: pass labels (for logits or generation, "
                             "use export_model() on rank 0).")
        if loss_type not in ("exact", "sampled"):
            raise ValueError(f"loss_type must be 'exact' or 'sampled', got {loss_type!r}.")
        if loss_type == "sampled" and m.non_edge_bias is not None:  # BriLLMConfig.check's refusal
            raise ValueError("non_edge_bias needs loss_type='exact' (the sampled loss's negatives do not cover the "
                             "non-successors).")
        check_labels(labels, input_ids)
        self._link = EdgeGradLink() if torch.is_grad_enabled() else None
        self._unreduced = self._unreduced or torch.is_grad_enabled()
        anchors = []
        run = m.run_signals(input_ids, attention_mask, None, signal_ids=signal_ids, dropout_rows=dropout_rows,
                            edge_fetch=lambda rows: self.table.fetch(m, self.transport, rows, self._link, anchors),
                            dropout_seed=dropout_seed)
        targets = shift_labels(labels, attention_mask, run.column, self.config.vocab_size)
        b_idx, j_idx = (run.valid & (targets != -100)).nonzero(as_tuple=True)
        sources = run.tokens[b_idx, j_idx]
        meta = torch.stack([sources, targets[b_idx, j_idx], run.index[b_idx, j_idx] + 1], 1)
        # each position's signal to the owner of its source, which scores it with the model's own code
        order, send, recv = self.transport.route(self.owners[sources])
        meta = self.transport.exchange(meta[order], send, recv, differentiable=False)
        x = self.transport.exchange(run.signals[b_idx, j_idx].to(m.edge_dtype)[order], send, recv, differentiable=True)
        local_sum = sum((t.sum() * 0 for t in anchors), x.sum() * 0)  # keeps every exchange in the graph
        if meta.shape[0]:
            src, tgt, next_index = meta.unbind(1)
            local_sum = local_sum + m.score(x, src, next_index, tgt, loss_type=loss_type, link=self._link, csr=(
                self.table.local_indptr, self.table.local_indices), row_offset=self.table.local_offset)[1].sum()
        totals = self.transport.all_reduce(torch.stack([local_sum.detach().double(), local_sum.new_tensor(
            b_idx.numel(), dtype=torch.float64)]))
        # value: the global mean; gradient: this process's share (the shares sum to the global gradient)
        loss = (local_sum + (totals[0] - local_sum.detach().double()).to(local_sum.dtype)) / max(float(totals[1]), 1.0)
        return ShardedOutput(loss=loss, num_targets=int(totals[1]), owned_targets=int(meta.shape[0]))

    def reduce_gradients(self):
        """Sum the replicated gradients over the processes: once per optimizer step, after backward."""
        m, names = self.model.base_model, self.table.names
        pairs = [_shared_row(getattr(m, name)) for name in names] + [
            (_sparse_rows if name == "node_bias" else _dense)(p) for name, p in replicated_parameters(m, names)]
        flat = self.transport.all_reduce(torch.cat([part.float().reshape(-1) for part, _ in pairs]))
        for (_, done), summed in zip(pairs, flat.split([part.numel() for part, _ in pairs])):
            done(summed)
        self._unreduced = False

    def clip_grad_norm_(self, max_norm: float) -> float:
        """`clip_grad_norm_` as one process: owned rows' squares, and rank 0's replicated ones (equal everywhere)."""
        if self._unreduced:
            raise RuntimeError("ShardedBriLLM.clip_grad_norm_: call reduce_gradients() first (after backward): the "
                               "replicated gradients are still this process's share, not the global sum.")
        m, names = self.model.base_model, self.table.names
        owned, replicated = torch.zeros(2, dtype=torch.float64, device=m.node_bias.device)
        for name in names:
            if getattr(m, name).grad is not None:
                rows, squares = _row_squares(getattr(m, name).grad)
                replicated += squares[rows == 0].sum()
                owned += squares[rows != 0].sum()
        for _, p in replicated_parameters(m, names):
            replicated += _row_squares(p.grad)[1].sum() if p.grad is not None else 0.0
        norm = float(self.transport.all_reduce((owned + replicated if self.rank == 0 else owned).reshape(1))[0].sqrt())
        if (coef := min(max_norm / (norm + 1e-6), 1.0)) < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    (p.grad._values() if p.grad.is_sparse else p.grad).mul_(coef)
        return norm

    save_shard = checkpoint.save_shard  # every process: its part of a checkpoint (optimizer state included)
    load_shard = checkpoint.load_shard  # a checkpoint saved on any process count
    saved_assignment = staticmethod(checkpoint.saved_assignment)
    load_full_state_dict = checkpoint.load_full_state_dict  # this process's part of a whole model's file
    full_state_dict = checkpoint.full_state_dict  # the whole model's state dict on rank 0 (call on every process)

    def export_model(self):
        """A plain `BriLLMForCausalLM` of the gathered parameters on rank 0, None elsewhere (call on every process)."""
        if (sd := self.full_state_dict()) is None:
            return None
        with torch.device("meta"):
            model = BriLLMForCausalLM(type(self.config).from_dict(self.config.to_dict()))
        model.base_model.load_state_dict(sd, assign=True)
        model.generation_config = self.model.generation_config
        return model


def _sparse(p, rows, values, **kw) -> torch.Tensor:  # rows valid by construction
    return torch.sparse_coo_tensor(rows.view(1, -1), values, p.shape, check_invariants=False, **kw)


def _shared_row(p):
    """Row 0 (the shared edge): its entries' sum (no `coalesce()`: it sorts every touched row) and whether touched."""
    g = p.grad
    if g is not None and not g.is_sparse:
        raise RuntimeError("ShardedBriLLM expects sparse gradients for its edge table.")
    pos = (g._indices()[0] == 0).nonzero().flatten() if g is not None else torch.zeros(0, dtype=torch.long)
    total = g._values().index_select(0, pos).sum(0) if pos.numel() else torch.zeros(p.shape[1:], device=p.device)

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

    return torch.cat([total.reshape(-1).float(), torch.tensor([float(pos.numel() > 0)], device=p.device)]), done


def _sparse_rows(p):  # a replicated parameter with a row-sparse gradient (node_bias)
    V, k = p.shape[0], math.prod(p.shape[1:])
    dense = torch.zeros(V, k + 1, device=p.device)
    if p.grad is not None:
        g = p.grad.coalesce()
        dense[:, :k].index_add_(0, g._indices()[0], g._values().reshape(-1, k))
        dense[g._indices()[0], k] = 1.0

    def done(summed):
        summed = summed.view(V, k + 1)
        rows = (summed[:, k] > 0).nonzero().flatten()
        p.grad = (_sparse(p, rows, summed[rows, :k].reshape(-1, *p.shape[1:]).contiguous(), is_coalesced=True)
                  if rows.numel() else None)

    return dense, done


def _dense(p):  # the sum wherever any process had a gradient
    grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
    flag = torch.tensor([float(p.grad is not None)], device=p.device)
    return torch.cat([grad.float(), flag]), lambda summed: setattr(
        p, "grad", summed[:-1].view_as(p).to(p.dtype).clone() if float(summed[-1]) > 0 else None)


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
    dup_rows = uniq[counts > 1]  # the norm of a duplicated row is that of its entries' sum
    merged = values.new_zeros(dup_rows.numel(), values.shape[1])
    merged.index_add_(0, torch.searchsorted(dup_rows, rows[dup]), values[dup])
    return torch.cat([rows[~dup], dup_rows]), torch.cat([squares[~dup], _squares(merged)])


def _squares(values: torch.Tensor) -> torch.Tensor:  # float64 squared L2 norm of every row of (n, k) values
    return torch.linalg.vector_norm(values.float(), dim=1).double().square()
