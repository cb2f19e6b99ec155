"""`ShardedBriLLM`: the model's own code through two hooks, `BriLLMModel.run_signals(..., edge_fetch=...)` (the rows
fetched from their owners) and `BriLLMModel.score(...)` (on the owner of each position's source, its local blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backend import exact_precision
from ..losses import shift_labels
from ..modeling_brillm import BriLLMForCausalLM, initial_positions
from ..ops import EdgeGradLink
from ..optimization import parameter_groups
from ..validation import check_labels
from . import checkpoint, gradients
from .owners import balance_sources, check_assignment, graph_csr, source_costs
from .table import LocalTable
from .transport import Transport


@dataclass
class ShardedOutput:
    loss: torch.Tensor  # the token-weighted mean over the global batch (its gradient: this process's share)
    num_targets: int  # scored positions in the global batch
    local_targets: int  # of them, in this process's sequences
    owned_targets: int = 0  # scored here, as the owner of their sources


class ShardedBriLLM(nn.Module):
    """A `BriLLMForCausalLM` whose edge table is split by source node over the processes: its row-indexed
    parameters cut to the local table (`LocalTable`), every other one replicated."""

    def __init__(self, model, owners: torch.Tensor | None = None, group=None, source_counts=None):
        super().__init__()
        self.transport, self.model = Transport(group), model
        indptr, indices = graph_csr(model)
        if owners is None:
            owners = balance_sources(source_costs(model, source_counts), self.world_size, indptr.diff())
        owners = torch.as_tensor(owners, dtype=torch.long).cpu()
        check_assignment(owners, indptr.diff(), self.world_size)
        self.table = LocalTable(owners, indptr, indices, self.rank, model.base_model, model.base_model.node_bias.device)
        self.table.cut(model.base_model)  # `run_signals` reads only the local table's dtype
        self.model.sparse_gradients = True  # node_bias's gradient: the rows of the sequences' first tokens
        self._link, self._unreduced = None, False  # _unreduced: a backward ran since the last reduce_gradients

    @classmethod
    def from_config(cls, config, graph=None, owners=None, group=None, seed: int = 0, source_counts=None,
                    device=None) -> "ShardedBriLLM":
        """A fresh sharded model that never builds the whole edge table: each source's block drawn from a generator
        seeded by (seed, source), the same for any process count (not `BriLLMForCausalLM(config)`'s)."""
        with torch.device("meta"):
            model = BriLLMForCausalLM(config)
        m, device, r, d = model.base_model, torch.device(device or "cpu"), config.initializer_range, config.node_size
        gen = torch.Generator().manual_seed(seed)
        m.node_bias = nn.Parameter(torch.empty(config.vocab_size, 1, d).uniform_(-r, r, generator=gen).to(device))
        m.positions = nn.Parameter(initial_positions(config, device))
        if m.start_signals is not None:  # 1/d, the release's uniform start, as BriLLMForCausalLM initialises it
            m.start_signals = nn.Parameter(torch.full((config.num_start_signals, d), 1.0 / d, device=device))
        for name in ("non_edge_bias", "node_readout", "edge_base", "node_embedding"):  # zero: the release's
            if getattr(m, name) is not None:
                setattr(m, name, nn.Parameter(torch.zeros(getattr(m, name).shape, device=device)))
        for module in model.modules():  # the graph's and the count prior's tables: filled by set_graph
            for name, buf in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device),
                                       persistent=name not in module._non_persistent_buffers_set)
        if graph is not None:
            model.set_graph(graph)
        sharded = cls(model, owners=owners, group=group, source_counts=source_counts)
        sharded._initialise_rows(seed)
        return sharded

    @torch.no_grad()
    def _initialise_rows(self, seed: int):
        """Uniform(±initializer_range) rows: row 0 from the generator of (seed, V), each source's block from that of
        (seed, source), parameter after parameter."""
        cfg, params = self.config, [getattr(self.model.base_model, n) for n in self.table.names]
        r, shared = cfg.initializer_range, torch.Generator().manual_seed(seed * 1_000_003 + cfg.vocab_size)
        for p in params:
            p[0].copy_(torch.empty(p.shape[1:]).uniform_(-r, r, generator=shared))
        local = self.table.local_indptr.tolist()
        for u in self.table.owned_sources().tolist():
            a, e = local[u] + 1, local[u + 1] + 1
            if e == a:  # no successors, no rows
                continue
            g = torch.Generator().manual_seed(seed * 1_000_003 + u)
            for p in params:
                p[a:e].copy_(torch.empty(e - a, *p.shape[1:]).uniform_(-r, r, generator=g))

    config = property(lambda self: self.model.config)
    rank = property(lambda self: self.transport.rank)
    world_size = property(lambda self: self.transport.world)
    owners = property(lambda self: self.table.owners, doc="The owner (V,) of every source node.")
    bytes_sent = property(lambda self: self.transport.bytes_sent,
                          doc="Bytes this process sent to other processes so far (forward, backward, reductions).")

    def parameter_groups(self, weight_decay: float = 0.0, learning_rate: float | None = None, **options) -> list:
        """SparseAdamW groups as one process makes them (`optimization.parameter_groups` and its recipe options:
        local row 0 is the shared edge, so `shared_edge_lr_scale` scales exactly it)."""
        if options.get("node_lr_scale", 1.0) != 1.0 and learning_rate is None:
            raise ValueError("parameter_groups: node_lr_scale scales learning_rate; pass learning_rate (the "
                             "optimizer's lr) too.")
        return parameter_groups(self, weight_decay, learning_rate, **options)

    @exact_precision
    def forward(self, input_ids, attention_mask=None, labels=None, loss_type: str | None = None,
                signal_ids=None, dropout_rows=None, dropout_seed: int | None = None) -> ShardedOutput:
        """The loss of the global batch, every process passing its own sequences as often as the others; the keywords
        as in `BriLLMForCausalLM.forward` (`dropout_rows`: the rows' indices in the global batch)."""
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
        # each position's signal to the owner of its source
        order, send, recv = self.transport.route(self.owners[sources])
        meta = self.transport.exchange(meta[order], send, recv, differentiable=False)
        dtype = getattr(m, self.table.names[0]).dtype
        x = self.transport.exchange(run.signals[b_idx, j_idx].to(dtype)[order], send, recv, differentiable=True)
        local_sum = sum((t.sum() * 0 for t in anchors), x.sum() * 0)  # keeps every exchange in the graph
        if meta.shape[0]:
            local_sum = local_sum + self._owner_loss(x, meta, loss_type)
        totals = self.transport.all_reduce(torch.stack([local_sum.detach().double(), local_sum.new_tensor(
            b_idx.numel(), dtype=torch.float64)]))
        # value: the global mean; gradient: this process's share (the shares sum to the global gradient)
        loss = (local_sum + (totals[0] - local_sum.detach().double()).to(local_sum.dtype)) / max(float(totals[1]), 1.0)
        return ShardedOutput(loss=loss, num_targets=int(totals[1]), local_targets=int(b_idx.numel()),
                             owned_targets=int(meta.shape[0]))

    def _owner_loss(self, x: torch.Tensor, meta: torch.Tensor, loss_type: str) -> torch.Tensor:
        """Sum of the losses of the positions whose sources this process owns: the model's own scoring over the
        owned blocks."""
        sources, targets, next_index = meta.unbind(1)
        _, per_position, _ = self.model.base_model.score(
            x, sources, next_index, targets, loss_type=loss_type, link=self._link,
            csr=(self.table.local_indptr, self.table.local_indices), row_offset=self.table.local_offset)
        return per_position.sum()

    def reduce_gradients(self):
        """Sum the replicated gradients over the processes (once per optimizer step, after backward)."""
        gradients.reduce_gradients(self.model.base_model, self.table.names, self.transport)
        self._unreduced = False

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm, as one process clips (after `reduce_gradients()`); returns the norm."""
        if self._unreduced:
            raise RuntimeError("ShardedBriLLM.clip_grad_norm_: call reduce_gradients() first (after backward): the "
                               "replicated gradients are still this process's share, not the global sum.")
        return gradients.clip_grad_norm_(self.model.base_model, self.table.names, self.transport,
                                         list(self.parameters()), max_norm)

    save_shard = checkpoint.save_shard  # every process: its part of a checkpoint (optimizer state included)
    load_shard = checkpoint.load_shard  # a checkpoint saved on any process count
    saved_assignment = staticmethod(checkpoint.saved_assignment)
    load_full_state_dict = checkpoint.load_full_state_dict  # this process's part of a whole model's file
    full_state_dict = checkpoint.full_state_dict  # the whole model's state dict on rank 0 (call on every process)

    def export_model(self):
        """Rank 0: a plain `BriLLMForCausalLM` with the gathered parameters, for `save_pretrained`; None on the
        other ranks. Call on every process."""
        sd = self.full_state_dict()
        if sd is None:
            return None
        with torch.device("meta"):
            model = BriLLMForCausalLM(type(self.config).from_dict(self.config.to_dict()))
        model.base_model.load_state_dict(sd, assign=True)
        model.generation_config = self.model.generation_config
        return model
