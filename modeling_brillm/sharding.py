"""Source-sharded training: each process owns the edge blocks of a set of source nodes (like expert parallelism).

The edge table (`weights` (P, d, d), `biases` (P, 1, d)) is split by source node: a process keeps the CSR blocks of
the sources it owns (plus the shared edge, row 0) and the AdamW state of those rows only. Every other parameter
is small and replicated (`node_bias`, `positions`, row 0, and whichever of the learned start signals, the
non-edge offsets, the node readout, the shared edge matrix `edge_base` and the node vectors the config has), and
so are the count prior's fixed tables; the replicated gradients are all-reduced. A training step:

1. recurrence: every process runs the model's own signal recurrence over its own sequences; the edge rows it
   crosses are fetched from their owners (unique rows only: counts, then row ids, then rows, by
   `all_to_all_single`), and the rows' gradients travel back the same way in the backward (differentiable
   all-to-all);
2. candidates: the signal of every scored position goes to the owner of its source, which scores it with the
   model's own code (`BriLLMModel.score`) over its own blocks: the same energies, readout, count prior and loss
   (exact, or sampled by frequency) as one process; the signal gradients return in the backward;
3. optimizer: `reduce_gradients()` all-reduces the replicated gradients; `clip_grad_norm_()` clips by the global
   norm (each owner's squared norm of its own rows plus the replicated ones counted once, one all-reduce of a
   scalar); each owner updates its touched rows with lazy AdamW (`SparseAdamW`). The table's gradient never
   crosses the network and is never dense.

The recipe options of `parameter_groups` (SparseAdamW group options, as `training.optimizers.parameter_groups`
makes them for one process) need nothing more: local row 0 is the shared edge, so `first_row_lr_scale`
(`shared_edge_lr_scale`) scales exactly it; every process's table has a gradient at every step (empty where the
step touched none of its rows), so each process's step count and `lazy_weight_decay` bookkeeping equal one
process's, and each owner decays its own rows lazily (`apply_pending_weight_decay()` on every process brings
them up to date; checkpoints keep each row's pending decay); `node_lr_scale` is the node group's rate
(`node_bias`, `non_edge_bias`).

The same global batch gives the losses and parameters of one process with `SparseAdamW` and the same clipping (up
to float summation order). Model-level API, for a custom loop (torch.distributed initialised, e.g. by
accelerate)::

    model = BriLLMForCausalLM.from_graph(graph, config)       # or ShardedBriLLM.from_config(...) for huge graphs
    sharded = ShardedBriLLM(model)                             # frees the blocks of other processes' sources
    optimizer = SparseAdamW(sharded.parameter_groups(weight_decay=0.01, learning_rate=1e-3), lr=1e-3)
    for batch in loader:                                      # each process: its own part of the global batch
        out = sharded(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()                                    # value: the global mean; gradient: exact once reduced
        sharded.reduce_gradients()
        sharded.clip_grad_norm_(1.0)                           # optional: the global norm, as one process clips
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
    sharded.save_shard(directory, optimizer)                   # every process; resume on any process count
    optimizer.apply_pending_weight_decay()                     # with lazy_weight_decay: before reading the weights
    full = sharded.export_model()                              # rank 0: a plain BriLLMForCausalLM (None elsewhere)
"""

from __future__ import annotations

import heapq
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .backend import exact_precision
from .losses import shift_labels
from .modeling_brillm import BriLLMForCausalLM, initial_positions
from .ops import EdgeGradLink, gather_edges
from .optimization import group_moment_dtype, parameter_groups
from .validation import check_labels

SHARED_FILE = "edge_shared.safetensors"
SHARD_PATTERN = "edge_shard_{rank:05d}_of_{world:05d}.safetensors"


# ------------------------------------------------------------------------------------------------ assignment
def _csr(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indptr, indices) of the model's graph on the CPU (works while the edge table is on the meta device)."""
    V = model.config.vocab_size
    if model.config.graph == "dense":
        return torch.arange(V + 1) * V, None
    return model.base_model.graph_indptr.cpu(), model.base_model.graph_indices.cpu()


def source_costs(model, source_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Expected work of every source node: (uses as a source + 1) x (real successors + 1), float64 (V,).

    Uses come from `source_counts` (V,) when given (token counts of the training data), else from the graph's
    bigram counts (a sparse graph); a dense graph without counts weighs every node alike.
    """
    V = model.config.vocab_size
    indptr, _ = _csr(model)
    degree = indptr.diff().double()
    if source_counts is not None:
        uses = torch.as_tensor(source_counts, dtype=torch.float64).cpu()
        if uses.shape != (V,):
            raise ValueError(f"source_counts must have shape ({V},), got {tuple(uses.shape)}.")
    elif model.config.graph == "sparse":
        src = torch.repeat_interleave(torch.arange(V), indptr.cpu().diff())
        uses = torch.zeros(V, dtype=torch.float64).index_add_(0, src, model.base_model.graph_counts.cpu().double())
    else:
        uses = torch.zeros(V, dtype=torch.float64)
    return (uses + 1) * (degree + 1)


def balance_sources(costs: torch.Tensor, num_shards: int, degree: torch.Tensor | None = None) -> torch.Tensor:
    """Owner (V,) int64 of every source: greedy longest-processing-time, each source in falling cost order goes
    to the least loaded shard. Sources without real successors hold no rows; they are spread last."""
    V = costs.numel()
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    order = torch.argsort(costs, descending=True, stable=True).tolist()
    if degree is not None:  # row-holding sources first, so every shard gets some when there are enough
        has_rows = (degree > 0).tolist()
        order = [u for u in order if has_rows[u]] + [u for u in order if not has_rows[u]]
    owners = torch.empty(V, dtype=torch.long)
    heap = [(0.0, shard) for shard in range(num_shards)]
    cost = costs.tolist()
    for u in order:
        load, shard = heapq.heappop(heap)
        owners[u] = shard
        heapq.heappush(heap, (load + cost[u], shard))
    return owners


def check_assignment(owners: torch.Tensor, degree: torch.Tensor, world_size: int):
    """Raise a clear error when `owners` does not fit this graph and process count."""
    V = degree.numel()
    if owners.shape != (V,):
        raise ValueError(f"the source assignment has shape {tuple(owners.shape)}, expected ({V},) "
                         "(one owner per node).")
    if owners.numel() and (int(owners.min()) < 0 or int(owners.max()) >= world_size):
        raise ValueError(f"the source assignment names processes outside 0..{world_size - 1}.")
    rows = torch.zeros(world_size, dtype=torch.long).index_add_(0, owners.cpu(), degree.cpu())
    empty = (rows == 0).nonzero().flatten().tolist()
    if empty:
        sources = int((degree > 0).sum())
        raise ValueError(
            f"with {world_size} processes, process(es) {empty} would own no edge rows: only {sources} source nodes "
            f"have real successors. Use at most {sources} processes (or a larger graph)."
        )


# ------------------------------------------------------------------------------------------------ transport
class _Transport:
    """all-to-all over the default process group (or nothing with one process), counting bytes sent to others."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.bytes_sent = 0

    def _count(self, send_counts: list[int], row_bytes: int):
        self.bytes_sent += row_bytes * (sum(send_counts) - send_counts[self.rank])

    def counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return send_counts
        out = torch.empty_like(send_counts)
        dist.all_to_all_single(out, send_counts, group=self.group)
        self._count([1] * self.world, send_counts.element_size())
        return out

    def exchange(self, tensor: torch.Tensor, send: list[int], recv: list[int], differentiable: bool) -> torch.Tensor:
        """Rows `tensor[sum(send[:r]):...]` go to process r; returns the rows received, by sending process."""
        if self.world == 1:
            return tensor
        row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
        self._count(send, row_bytes)
        out = tensor.new_empty(sum(recv), *tensor.shape[1:])
        if differentiable:
            from torch.distributed.nn.functional import all_to_all_single

            # the backward sends as many rows the other way
            self._count(recv, row_bytes)
            with warnings.catch_warnings():  # deprecated in favour of a functional collective without autograd
                warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_to_all_single")
                return all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)
        dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, group=self.group)
            self.bytes_sent += 2 * tensor.numel() * tensor.element_size() * (self.world - 1) // self.world  # ring
        return tensor


def _row_squares(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, squared L2 norm of each row, float64) of a gradient; a sparse COO one's duplicate rows summed first
    (without `coalesce()`, which would sort and copy every value: only the duplicated entries are copied)."""
    if not grad.is_sparse:
        flat = grad.detach().reshape(grad.shape[0], -1) if grad.dim() else grad.detach().reshape(1, 1)
        return torch.arange(flat.shape[0], device=grad.device), _squares(flat)
    rows = grad._indices()[0]
    values = grad._values().detach().reshape(rows.numel(), -1)
    squares = _squares(values)
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
        dup = counts[inverse] > 1
        if bool(dup.any()):  # the norm of a duplicated row is that of its entries' sum
            dup_rows = uniq[counts > 1]
            merged = values.new_zeros(dup_rows.numel(), values.shape[1])
            merged.index_add_(0, torch.searchsorted(dup_rows, rows[dup]), values[dup])
            single = ~dup
            return torch.cat([rows[single], dup_rows]), torch.cat([squares[single], _squares(merged)])
    return rows, squares


def _squares(values: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of every row of (n, k) values, in float64 (a row's norm in its dtype, then squared)."""
    if values.numel() == 0:
        return values.new_zeros(values.shape[0], dtype=torch.float64)
    return torch.linalg.vector_norm(values.float(), dim=1).double().square()


@dataclass
class ShardedOutput:
    """`loss`: the token-weighted mean over the global batch (its gradient: this process's share of it);
    `num_targets`: scored positions in the global batch; `local_targets`: in this process's own sequences."""

    loss: torch.Tensor
    num_targets: int
    local_targets: int


# ------------------------------------------------------------------------------------------------ the model
class ShardedBriLLM(nn.Module):
    """A `BriLLMForCausalLM` whose edge table is split by source node over the processes (module docstring).

    Parameters: every parameter of the model but the edge table, replicated, and `weights` (1 + R, d, d), `biases`
    (1 + R, 1, d): row 0 the shared edge (replicated), rows 1.. the owned sources' blocks in ascending source order.
    """

    def __init__(self, model, owners: torch.Tensor | None = None, group=None, source_counts=None):
        super().__init__()
        self.transport = _Transport(group)
        W, rank = self.transport.world, self.transport.rank
        cfg = model.config
        V = cfg.vocab_size
        indptr, indices = _csr(model)
        degree = indptr.diff()
        if owners is None:
            owners = balance_sources(source_costs(model, source_counts), W, degree)
        owners = torch.as_tensor(owners, dtype=torch.long).cpu()
        check_assignment(owners, degree, W)
        device = model.base_model.node_bias.device
        self.model = model
        self.register_buffer("owners", owners.to(device), persistent=False)
        owned = owners == rank
        local_degree = torch.where(owned, degree, torch.zeros_like(degree))
        local_indptr = torch.zeros(V + 1, dtype=torch.long)
        local_indptr[1:] = torch.cumsum(local_degree, 0)
        # global row + offset = local row, for the rows of owned sources
        self.register_buffer("local_offset", (local_indptr[:-1] - indptr[:-1]).to(device), persistent=False)
        self.register_buffer("local_indptr", local_indptr.to(device), persistent=False)
        self.register_buffer("global_indptr", indptr.to(device), persistent=False)
        self.local_rows = self._global_rows_of(owned.nonzero().flatten(), indptr)  # (R,) global rows, ascending
        if indices is not None:
            self.register_buffer("local_indices", indices[(self.local_rows - 1).to(indices.device)].to(device),
                                 persistent=False)
        else:
            self.local_indices = None
        keep = torch.cat([torch.zeros(1, dtype=torch.long), self.local_rows]).to(device)
        with torch.no_grad():
            weights = (model.base_model.weights.detach().index_select(0, keep)
                       if model.base_model.weights.device.type != "meta" else None)
            biases = (model.base_model.biases.detach().index_select(0, keep)
                      if model.base_model.biases.device.type != "meta" else None)
        # the model now holds the local table (its own full one is freed); `run_signals` reads only its dtype
        d = cfg.node_size
        if weights is None:  # built on the meta device (from_config): filled there
            weights = torch.empty(len(keep), d, d, device=device)
        self.model.base_model.weights = nn.Parameter(weights)
        self.model.base_model.biases = nn.Parameter(biases if biases is not None
                                                    else torch.empty(len(keep), 1, d, device=device))
        self.model.sparse_gradients = True  # node_bias's gradient: the rows of the sequences' first tokens
        self._link = None
        self._unreduced = False  # a backward ran since the last reduce_gradients (clip_grad_norm_ checks it)

    # ------------------------------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config, graph=None, owners=None, group=None, seed: int = 0, source_counts=None,
                    device=None) -> "ShardedBriLLM":
        """A freshly initialised sharded model that never builds the full edge table (for graphs that do not fit
        one process). Every source's block is drawn from a generator seeded by (seed, source), so the
        initialisation is the same for any process count (but not the one of `BriLLMForCausalLM(config)`)."""
        with torch.device("meta"):
            model = BriLLMForCausalLM(config)
        device = torch.device(device or "cpu")
        r = config.initializer_range
        gen = torch.Generator().manual_seed(seed)
        V, d = config.vocab_size, config.node_size
        model.base_model.node_bias = nn.Parameter(torch.empty(V, 1, d).uniform_(-r, r, generator=gen).to(device))
        model.base_model.positions = nn.Parameter(initial_positions(config, device))
        # 1/d, the release's uniform start, as BriLLMForCausalLM initialises it
        if model.base_model.start_signals is not None:
            model.base_model.start_signals = nn.Parameter(torch.full((config.num_start_signals, d), 1.0 / d,
                                                                     device=device))
        # the extensions start at zero (the release's energies), as BriLLMForCausalLM initialises them
        for name in ("non_edge_bias", "node_readout", "edge_base", "node_embedding"):
            p = getattr(model.base_model, name)
            if p is not None:
                setattr(model.base_model, name, nn.Parameter(torch.zeros(p.shape, device=device)))
        for name, buf in list(model.named_buffers(recurse=False)):
            model.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
        if graph is not None:
            model.set_graph(graph)
        sharded = cls(model, owners=owners, group=group, source_counts=source_counts)
        with torch.no_grad():
            w, b = sharded.model.base_model.weights, sharded.model.base_model.biases
            shared = torch.Generator().manual_seed(seed * 1_000_003 + V)
            w[0].copy_(torch.empty(d, d).uniform_(-r, r, generator=shared))
            b[0].copy_(torch.empty(1, d).uniform_(-r, r, generator=shared))
            lp = sharded.local_indptr.tolist()
            for u in (sharded.owners == sharded.rank).nonzero().flatten().tolist():
                a, e = lp[u] + 1, lp[u + 1] + 1
                if e > a:
                    g = torch.Generator().manual_seed(seed * 1_000_003 + u)
                    w[a:e].copy_(torch.empty(e - a, d, d).uniform_(-r, r, generator=g))
                    b[a:e].copy_(torch.empty(e - a, 1, d).uniform_(-r, r, generator=g))
        return sharded

    @staticmethod
    def _global_rows_of(sources: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
        starts, sizes = indptr[sources] + 1, indptr[sources + 1] - indptr[sources]
        total = int(sizes.sum())
        first = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
        return first + torch.arange(total)

    # ------------------------------------------------------------------------------------- properties
    @property
    def config(self):
        return self.model.config

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world

    @property
    def bytes_sent(self) -> int:
        """Bytes this process sent to other processes so far (forward, backward, reductions)."""
        return self.transport.bytes_sent

    def parameter_groups(self, weight_decay: float = 0.0, learning_rate: float | None = None, *,
                         lazy_weight_decay: bool = False, shared_edge_lr_scale: float = 1.0,
                         node_lr_scale: float = 1.0) -> list[dict]:
        """SparseAdamW groups as examples/pretrain.py makes them for one process
        (`optimization.parameter_groups`): weight decay on the edge matrices only; the recipe options
        `lazy_weight_decay`, `shared_edge_lr_scale` (row 0 of the local tables, the shared edge) and `node_lr_scale`
        (`node_bias`, `non_edge_bias`; needs `learning_rate`, the optimizer's base rate)."""
        if node_lr_scale != 1.0 and learning_rate is None:
            raise ValueError("parameter_groups: node_lr_scale scales learning_rate; pass learning_rate (the "
                             "optimizer's lr) too.")
        return parameter_groups(self, weight_decay, learning_rate, lazy_weight_decay=lazy_weight_decay,
                                shared_edge_lr_scale=shared_edge_lr_scale, node_lr_scale=node_lr_scale)

    def _replicated(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every parameter each process holds whole: all but the edge table (whose row 0,
        the shared edge, is replicated too): node_bias, positions and whichever of start_signals, non_edge_bias,
        node_readout, edge_base and node_embedding the config has."""
        return [(n, p) for n, p in self.model.base_model.named_parameters() if n not in ("weights", "biases")]

    def _dense_replicated(self) -> list:
        """The replicated parameters whose one-process gradient is dense (all but node_bias's rows)."""
        return [p for n, p in self._replicated() if n != "node_bias"]

    def _source_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Source node of global edge rows (> 0)."""
        if self.local_indices is None:  # dense: row = 1 + u·V + v
            return (rows - 1) // self.config.vocab_size
        return torch.searchsorted(self.global_indptr, rows - 1, right=True) - 1

    def _to_local(self, rows: torch.Tensor) -> torch.Tensor:
        """Local row of global rows of owned sources (row 0 stays 0)."""
        real = rows > 0
        src = self._source_of_rows(rows.clamp_min(1))
        return torch.where(real, rows + self.local_offset[src], torch.zeros_like(rows))

    def _split(self, dest: torch.Tensor):
        """Order that groups items by destination process, and the send / receive counts."""
        W = self.world_size
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=W)
        recv = self.transport.counts(send)
        return order, send.tolist(), recv.tolist()

    # ------------------------------------------------------------------------------------- forward
    def _fetch_rows(self, rows: torch.Tensor):
        """`edge_fetch` for the recurrence: the (B, L) global rows' matrices and biases, from their owners."""
        m = self.model.base_model
        d = self.config.node_size
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        dest = torch.where(uniq > 0, self.owners[self._source_of_rows(uniq.clamp_min(1))],
                           torch.full_like(uniq, self.rank))  # row 0 is replicated: served locally
        order, send, recv = self._split(dest)
        wanted = self.transport.exchange(uniq[order], send, recv, differentiable=False)
        # the owner reads its rows; with the link, their gradient joins the candidate gradient (one sparse tensor)
        w, b = gather_edges(m.weights, m.biases, self._to_local(wanted), True, self._link)
        payload = torch.cat([w.reshape(-1, d * d), b.reshape(-1, d)], 1)
        got = self.transport.exchange(payload, recv, send, differentiable=True)
        self._anchors.append(got)
        by_uniq = got.index_select(0, torch.argsort(order))  # back to `uniq` order
        steps = by_uniq.index_select(0, inverse)
        B, L = rows.shape
        return steps[:, :d * d].view(B, L, d, d), steps[:, d * d:].view(B, L, d)

    @exact_precision
    def forward(self, input_ids, attention_mask=None, labels=None, loss_type: str | None = None,
                signal_ids=None, dropout_rows=None, dropout_seed: int | None = None) -> ShardedOutput:
        """The loss of the global batch (every process passes its own sequences, and every process must call
        this the same number of times); see `ShardedOutput`. `loss_type` overrides the config's ("exact" for
        validation whatever the training loss); `signal_ids` (B,) picks each row's learned start signal,
        `dropout_rows` (B,) / `dropout_seed` key the signal dropout's mask (each row's index in the global batch,
        one seed on every process), as in `BriLLMForCausalLM.forward`."""
        if labels is None:
            raise ValueError("ShardedBriLLM computes the training loss only: pass labels (for logits or generation, "
                             "use export_model() on rank 0).")
        m, cfg = self.model.base_model, self.config
        V = cfg.vocab_size
        loss_type = loss_type or cfg.loss_type
        if loss_type not in ("exact", "sampled"):
            raise ValueError(f"loss_type must be 'exact' or 'sampled', got {loss_type!r}.")
        if loss_type == "sampled" and m.non_edge_bias is not None:  # BriLLMConfig.check's refusal, word for word
            raise ValueError("non_edge_bias needs loss_type='exact' (the sampled loss's negatives do not cover the "
                             "non-successors).")
        check_labels(labels, input_ids)
        self._link = EdgeGradLink() if torch.is_grad_enabled() else None
        self._unreduced = self._unreduced or torch.is_grad_enabled()
        self._anchors = []
        run = m.run_signals(input_ids, attention_mask, None, signal_ids=signal_ids, edge_fetch=self._fetch_rows,
                            dropout_rows=dropout_rows, dropout_seed=dropout_seed)
        wdtype = m.weights.dtype

        targets = shift_labels(labels, attention_mask, run.column, V)  # as BriLLMForCausalLM.forward scores
        b_idx, j_idx = (run.valid & (targets != -100)).nonzero(as_tuple=True)
        sources = run.tokens[b_idx, j_idx]
        meta = torch.stack([sources, targets[b_idx, j_idx], run.index[b_idx, j_idx] + 1], 1)
        x = run.signals[b_idx, j_idx].to(wdtype)

        # each position's signal to the owner of its source
        order, send, recv = self._split(self.owners[sources])
        meta = self.transport.exchange(meta[order], send, recv, differentiable=False)
        xr = self.transport.exchange(x[order], send, recv, differentiable=True)
        local_sum = xr.sum() * 0  # keeps the exchange in the graph when this process received nothing
        for got in self._anchors:
            local_sum = local_sum + got.sum() * 0
        if meta.shape[0]:
            local_sum = local_sum + self._owner_loss(xr, meta, loss_type)
        self._anchors = []

        totals = torch.stack([local_sum.detach().double(), torch.tensor(float(b_idx.numel()), dtype=torch.float64,
                                                                        device=local_sum.device)])
        self.transport.all_reduce(totals)
        count = max(float(totals[1]), 1.0)
        # value: the global mean; gradient: this process's share (the shares sum to the global gradient)
        loss = (local_sum + (totals[0] - local_sum.detach().double()).to(local_sum.dtype)) / count
        return ShardedOutput(loss=loss, num_targets=int(totals[1]), local_targets=int(b_idx.numel()))

    def _owner_loss(self, x: torch.Tensor, meta: torch.Tensor, loss_type: str) -> torch.Tensor:
        """Sum of the per-position losses of positions whose sources this process owns: the model's own scoring
        (`BriLLMModel.score`) over the owned sources' local blocks, whose successor sets are the global ones."""
        sources, targets, next_index = meta.unbind(1)
        _, per_position, _ = self.model.base_model.score(
            x, sources, next_index, targets, loss_type=loss_type, link=self._link,
            csr=(self.local_indptr, self.local_indices), row_offset=self.local_offset)
        return per_position.sum()

    # ------------------------------------------------------------------------------------- gradients
    def reduce_gradients(self):
        """Sum the replicated parameters' gradients over the processes (once per optimizer step, after backward).

        Lazy AdamW must update a replicated row iff the global batch touched it, and every process's table must
        count every step (SparseAdamW's bias correction is per parameter, as the single process counts the whole
        table): an untouched local table gets an empty sparse gradient. The dense ones (every replicated parameter
        but `node_bias`: one process gives them a dense gradient, so AdamW moves every row) get the global sum
        wherever any process had a gradient, so they step exactly when one process would.
        """
        m = self.model.base_model
        d = self.config.node_size
        V = self.config.vocab_size
        dev = m.weights.device
        parts = []
        # the shared edge (row 0 of the local table): its gradient entries and whether this process touched it
        # No coalesce: it would sort every touched row's d x d values (a third of the step's CPU at the text
        # shape); the row-0 entries (several after accumulation) are found and summed directly, and SparseAdamW
        # merges any duplicate rows itself.
        row0, row0_pos = [], []
        for p in (m.weights, m.biases):
            g = p.grad
            if g is not None and not g.is_sparse:
                raise RuntimeError("ShardedBriLLM expects sparse gradients for its edge table.")
            pos = (g._indices()[0] == 0).nonzero().flatten() if g is not None else None
            hit = pos is not None and bool(pos.numel())
            row0.append(hit)
            row0_pos.append(pos)
            parts.append(g._values().index_select(0, pos).sum(0).reshape(-1) if hit
                         else torch.zeros(p[0].numel(), device=dev))
        parts.append(torch.tensor([float(row0[0]), float(row0[1])], device=dev))
        nb = m.node_bias.grad
        nb_dense = torch.zeros(V, d + 1, device=dev)
        if nb is not None:
            nb = nb.coalesce()
            idx = nb._indices()[0]
            nb_dense[:, :d].index_add_(0, idx, nb._values().reshape(-1, d))
            nb_dense[idx, d] = 1.0
        parts.append(nb_dense.reshape(-1))
        dense = self._dense_replicated()
        for p in dense:  # its gradient (or zeros) and whether this process had one
            parts.append(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=dev))
            parts.append(torch.tensor([float(p.grad is not None)], device=dev))
        flat = self.transport.all_reduce(torch.cat([t.float() for t in parts]))
        self._unreduced = False

        pieces = flat.split([d * d, d, 2, V * (d + 1)] + [n for p in dense for n in (p.numel(), 1)])
        for p, summed, touched_here, pos, touched_any in zip((m.weights, m.biases), pieces[:2], row0, row0_pos,
                                                             pieces[2].tolist()):
            g = p.grad
            if touched_here:  # the first row-0 entry holds the global sum, the others (duplicates) become zero
                values = g._values()
                values[pos[0]].copy_(summed.view_as(values[0]))
                if pos.numel() > 1:
                    values.index_fill_(0, pos[1:], 0.0)
            elif touched_any > 0:  # row 0 first keeps sorted rows sorted (SparseAdamW's fast path)
                extra = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long, device=dev),
                                                summed.view(1, *p.shape[1:]), p.shape, check_invariants=False)
                p.grad = extra if g is None else torch.sparse_coo_tensor(
                    torch.cat([extra._indices(), g._indices()], 1), torch.cat([extra._values(), g._values()]),
                    p.shape, is_coalesced=g.is_coalesced(), check_invariants=False)
            elif g is None:  # count the step (SparseAdamW increments its step on any gradient, even empty)
                p.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=dev),
                                                 torch.zeros(0, *p.shape[1:], device=dev), p.shape,
                                                 check_invariants=False)
        nb_sum = pieces[3].view(V, d + 1)
        rows = (nb_sum[:, d] > 0).nonzero().flatten()
        m.node_bias.grad = (torch.sparse_coo_tensor(rows.unsqueeze(0), nb_sum[rows, :d].reshape(-1, 1, d).contiguous(),
                                                    m.node_bias.shape, is_coalesced=True, check_invariants=False)
                            if rows.numel() else None)
        for p, summed, any_grad in zip(dense, pieces[4::2], pieces[5::2]):
            p.grad = summed.view_as(p).to(p.dtype).clone() if float(any_grad) > 0 else None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every gradient by the global L2 norm, as `torch.nn.utils.clip_grad_norm_` does in one process;
        returns that norm (before clipping), the same number on every process. Call after `reduce_gradients()`.

        The norm is the one-process model's: every owner adds the squared norm of its own edge rows (duplicate
        entries of its uncoalesced gradient summed first, so it is the norm of the dense gradient they stand for)
        and rank 0 the replicated parameters' (row 0 and `_replicated()`: identical on every process after the
        reduction, so counted once), then one all-reduce of that scalar. Every
        process multiplies its gradients by the same clamp(max_norm / (norm + 1e-6), max=1).
        """
        if self._unreduced:
            raise RuntimeError("ShardedBriLLM.clip_grad_norm_: call reduce_gradients() first (after backward): the "
                               "replicated gradients are still this process's share, not the global sum.")
        m = self.model.base_model
        dev = m.weights.device
        owned = torch.zeros((), dtype=torch.float64, device=dev)
        replicated = torch.zeros((), dtype=torch.float64, device=dev)
        for p in (m.weights, m.biases):
            if p.grad is not None:
                rows, squares = _row_squares(p.grad)
                shared = rows == 0
                replicated += squares[shared].sum()
                owned += squares[~shared].sum()
        for p in [m.node_bias] + self._dense_replicated():
            if p.grad is not None:
                replicated += _row_squares(p.grad)[1].sum()
        total = owned + replicated if self.rank == 0 else owned
        norm = float(self.transport.all_reduce(total.reshape(1))[0].sqrt())
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    (p.grad._values() if p.grad.is_sparse else p.grad).mul_(coef)
        return norm

    # ------------------------------------------------------------------------------------- checkpoints
    def _moments(self, optimizer, p):
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        return state if "exp_avg" in state else None

    def save_shard(self, directory, optimizer=None):
        """Write this process's rows (+ their AdamW moments) into `directory`; rank 0 also writes the replicated
        parameters, the assignment and the step counts. Call on every process (no rename here: the caller
        writes into a temporary folder and renames it once every process has written)."""
        from safetensors.torch import save_file

        m = self.model.base_model
        os.makedirs(directory, exist_ok=True)
        tensors = {"sources": (self.owners == self.rank).nonzero().flatten().cpu(),
                   "weights": m.weights.detach()[1:].cpu(), "biases": m.biases.detach()[1:].cpu()}
        for name, p in (("weights", m.weights), ("biases", m.biases)):
            st = self._moments(optimizer, p)
            if st is not None:
                tensors[f"{name}.exp_avg"] = st["exp_avg"][1:].cpu()
                tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"][1:].cpu()
                if "decayed_at" in st:  # lazy_weight_decay: how far each row has been decayed (float64)
                    tensors[f"{name}.decayed_at"] = st["decayed_at"][1:].cpu()
        meta = {"world_size": str(self.world_size), "rank": str(self.rank), **self._shape_meta()}
        path = os.path.join(directory, SHARD_PATTERN.format(rank=self.rank, world=self.world_size))
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
        if self.rank == 0:
            shared = {"owners": self.owners.cpu(), "weights.row0": m.weights.detach()[0].cpu(),
                      "biases.row0": m.biases.detach()[0].cpu(),
                      **{name: p.detach().cpu() for name, p in self._replicated()}}
            for name, p in self._with_moments_saved():
                st = self._moments(optimizer, p)
                if st is not None:
                    sl = (lambda t: t[0]) if name in ("weights", "biases") else (lambda t: t)
                    shared[f"{name}.exp_avg"] = sl(st["exp_avg"]).cpu()
                    shared[f"{name}.exp_avg_sq"] = sl(st["exp_avg_sq"]).cpu()
                    shared[f"{name}.step"] = st["step"].detach().reshape(1).float().cpu()
                    if "decayed_at" in st:  # the same decay_log on every process (every table steps every step)
                        shared[f"{name}.decayed_at.row0"] = st["decayed_at"][:1].cpu()
                        shared[f"{name}.decay_log"] = torch.tensor([st["decay_log"]], dtype=torch.float64)
            save_file({k: v.contiguous() for k, v in shared.items()}, os.path.join(directory, SHARED_FILE),
                      metadata=meta)
        if self.world_size > 1:
            dist.barrier(group=self.transport.group)

    def _with_moments_saved(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of every parameter whose optimizer state the shared file holds (row 0 for the table)."""
        m = self.model.base_model
        return self._replicated() + [("weights", m.weights), ("biases", m.biases)]

    def _shape_meta(self) -> dict:
        """What a checkpoint must match: the shapes, and which replicated parameters the model has."""
        cfg, m = self.config, self.model.base_model
        learned = getattr(cfg, "start_signal", "uniform") == "learned"
        has = {name: str(int(getattr(m, name) is not None))
               for name in ("non_edge_bias", "node_readout", "edge_base", "node_embedding")}
        has["count_prior"] = str(int(bool(getattr(cfg, "count_prior", False))))
        return {"vocab_size": str(cfg.vocab_size), "node_size": str(cfg.node_size),
                "num_edge_rows": str(cfg.num_edge_rows), "graph": cfg.graph,
                "max_position_embeddings": str(cfg.max_position_embeddings),
                "start_signals": str(cfg.num_start_signals if learned else 0), **has}

    @staticmethod
    def saved_assignment(directory) -> tuple[torch.Tensor, int] | None:
        """(owners (V,), process count) a checkpoint was saved with, or None when `directory` holds no sharded
        checkpoint."""
        from safetensors import safe_open

        path = os.path.join(directory, SHARED_FILE)
        if not os.path.exists(path):
            return None
        with safe_open(path, "pt") as f:
            return f.get_tensor("owners"), int((f.metadata() or {}).get("world_size", "0"))

    def load_shard(self, directory, optimizer=None):
        """Read the rows of the sources this process owns now (from whichever shard files hold them, any saved
        process count) and the replicated parameters; restore their AdamW moments and step counts into
        `optimizer` (a SparseAdamW over this module's parameters) when given."""
        from safetensors import safe_open

        m = self.model.base_model
        shared_path = os.path.join(directory, SHARED_FILE)
        if not os.path.exists(shared_path):
            raise ValueError(f"{directory} holds no source-sharded checkpoint ({SHARED_FILE} is missing): it was "
                             "saved without --edge_sharding source; resume it the way it was trained.")
        with safe_open(shared_path, "pt") as f:
            # checkpoints saved before a replicated parameter trained sharded lack its key: it was absent then
            absent = {"start_signals": "0", "non_edge_bias": "0", "node_readout": "0", "edge_base": "0",
                      "node_embedding": "0", "count_prior": "0"}
            meta = {**absent, **(f.metadata() or {})}
            mine = self._shape_meta()
            diff = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
            if diff:
                raise ValueError(f"{directory}: the sharded checkpoint was saved for another model "
                                 f"(saved vs this run: {diff}); resume with the data, tokenizer and graph it was "
                                 "trained with.")
            shared = {k: f.get_tensor(k) for k in f.keys()}
        saved_world = int(meta["world_size"])
        files = [os.path.join(directory, SHARD_PATTERN.format(rank=r, world=saved_world)) for r in range(saved_world)]
        missing = [p for p in files if not os.path.exists(p)]
        if missing:
            raise ValueError(f"{directory}: shard file(s) {missing} are missing; the checkpoint is incomplete.")
        with_moments = optimizer is not None and "weights.exp_avg" in shared
        dev = m.weights.device
        with torch.no_grad():
            for name, p in self._replicated():
                p.copy_(shared[name])
            m.weights[0].copy_(shared["weights.row0"])
            m.biases[0].copy_(shared["biases.row0"])
            moments = {}
            if with_moments:
                for name, p in self._with_moments_saved():
                    if f"{name}.step" not in shared:  # never had a gradient (e.g. frozen): no state to restore
                        continue
                    st = {"step": shared[f"{name}.step"].reshape(()).clone(),
                          "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                    if name in ("weights", "biases"):
                        st["exp_avg"][0].copy_(shared[f"{name}.exp_avg"])
                        st["exp_avg_sq"][0].copy_(shared[f"{name}.exp_avg_sq"])
                        if f"{name}.decay_log" in shared:  # lazy_weight_decay bookkeeping (SparseAdamW)
                            st["decay_log"] = float(shared[f"{name}.decay_log"][0])
                            st["decayed_at"] = torch.zeros(p.shape[0], dtype=torch.float64)
                            st["decayed_at"][0] = shared[f"{name}.decayed_at.row0"][0]
                    else:
                        st["exp_avg"].copy_(shared[f"{name}.exp_avg"])
                        st["exp_avg_sq"].copy_(shared[f"{name}.exp_avg_sq"])
                    moments[name] = st
            lp = self.local_indptr.cpu()
            need = set((self.owners == self.rank).nonzero().flatten().tolist())
            found = 0
            for path in files:
                with safe_open(path, "pt") as f:
                    srcs = f.get_tensor("sources")
                    keys = set(f.keys())
                    deg = self.global_indptr.cpu().diff()[srcs]
                    file_first = torch.cumsum(deg, 0) - deg  # row of each source in this file
                    slices = {k: f.get_slice(k) for k in keys if k != "sources"}
                    for u, a, n in zip(srcs.tolist(), file_first.tolist(), deg.tolist()):
                        if u not in need or n == 0:
                            continue
                        found += 1
                        la = int(lp[u]) + 1
                        m.weights[la:la + n].copy_(slices["weights"][a:a + n])
                        m.biases[la:la + n].copy_(slices["biases"][a:a + n])
                        if with_moments:
                            for name in ("weights", "biases"):
                                for k in ("exp_avg", "exp_avg_sq", "decayed_at"):
                                    if k in moments[name]:
                                        moments[name][k][la:la + n].copy_(slices[f"{name}.{k}"][a:a + n])
            expected = int((self.global_indptr.cpu().diff()[sorted(need)] > 0).sum()) if need else 0
            if found != expected:
                raise ValueError(f"{directory}: the shard files hold {found} of this process's {expected} sources "
                                 "with edges; the checkpoint is incomplete or belongs to another graph.")
        if with_moments:
            for name, st in moments.items():
                p = getattr(m, name)
                group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
                st["step"] = st["step"].to(dev if group.get("fused") else "cpu")
                # the step and the lazy-decay bookkeeping stay where SparseAdamW keeps them (CPU, float64 / float); the
                # moments in the group's dtype (bfloat16 moments were saved as such: exact)
                moment = group_moment_dtype(group)
                optimizer.state[p] = {k: (v.to(dev, moment) if k in ("exp_avg", "exp_avg_sq") else v)
                                      for k, v in st.items()}

    def load_full_state_dict(self, path):
        """Every process reads its own sources' rows and the replicated parameters from a whole model's
        safetensors file (`full_state_dict`'s keys, or the plain model's with the `brillm.` prefix): how the best
        model of a sharded run comes back. Row blocks are read by slice: no process holds the whole table."""
        from safetensors import safe_open

        m = self.model.base_model
        with safe_open(str(path), "pt") as f:
            prefix = "brillm." if "brillm.weights" in f.keys() else ""
            with torch.no_grad():
                for name, p in self._replicated():
                    p.copy_(f.get_tensor(prefix + name))
                weights, biases = f.get_slice(prefix + "weights"), f.get_slice(prefix + "biases")
                m.weights[0].copy_(weights[0:1][0])
                m.biases[0].copy_(biases[0:1][0])
                indptr, local = self.global_indptr.tolist(), self.local_indptr.tolist()
                for u in (self.owners == self.rank).nonzero().flatten().tolist():
                    a, e, la = indptr[u] + 1, indptr[u + 1] + 1, local[u] + 1
                    if e > a:
                        m.weights[la:la + e - a].copy_(weights[a:e])
                        m.biases[la:la + e - a].copy_(biases[a:e])

    # ------------------------------------------------------------------------------------- export
    def full_state_dict(self) -> dict | None:
        """The state dict of the whole `BriLLMForCausalLM`, gathered on rank 0 (None on the others). Rank 0 needs
        host memory for the full table: 4·P·(d² + d) bytes in fp32 (67.6 GB for the dense V=4000, d=32 graph)."""
        m = self.model.base_model
        W, rank = self.world_size, self.rank
        sd = None
        if rank == 0:
            P, d = self.config.num_edge_rows, self.config.node_size
            weights = torch.empty(P, d, d, dtype=m.weights.dtype)
            biases = torch.empty(P, 1, d, dtype=m.biases.dtype)
            weights[0], biases[0] = m.weights.detach()[0].cpu(), m.biases.detach()[0].cpu()
        indptr = self.global_indptr.cpu()
        for r in range(W):
            sources = (self.owners.cpu() == r).nonzero().flatten()
            rows = self._global_rows_of(sources, indptr)
            if r == rank:
                w, b = m.weights.detach()[1:], m.biases.detach()[1:]
                if rank != 0:
                    dist.send(w.contiguous(), 0, group=self.transport.group)
                    dist.send(b.contiguous(), 0, group=self.transport.group)
            elif rank == 0:
                d = self.config.node_size
                w = torch.empty(rows.numel(), d, d, dtype=m.weights.dtype, device=m.weights.device)
                b = torch.empty(rows.numel(), 1, d, dtype=m.biases.dtype, device=m.biases.device)
                dist.recv(w, r, group=self.transport.group)
                dist.recv(b, r, group=self.transport.group)
            if rank == 0:
                weights.index_copy_(0, rows, w.cpu())
                biases.index_copy_(0, rows, b.cpu())
        if rank == 0:
            sd = {k: v.detach().cpu() for k, v in m.state_dict().items() if k not in ("weights", "biases")}
            sd["weights"], sd["biases"] = weights, biases
        return sd

    def export_model(self):
        """Rank 0: a plain `BriLLMForCausalLM` with the gathered parameters, for `save_pretrained` (loadable in
        one process with no knowledge of the sharding). None on the other ranks. Call on every process."""
        sd = self.full_state_dict()
        if sd is None:
            return None
        config = type(self.config).from_dict(self.config.to_dict())
        with torch.device("meta"):
            model = BriLLMForCausalLM(config)
        model.base_model.load_state_dict(sd, assign=True)
        model.generation_config = self.model.generation_config
        return model


# ------------------------------------------------------------------------------------------------ memory
def sharded_memory(config, world_size: int, global_tokens: int = 8192, imbalance: float = 1.25,
                   optimizer_state: bool = True, moment_bytes: int = 8) -> dict:
    """Bytes per process of the source-sharded path in fp32, by part (an upper estimate for the busiest process).

    The process's share of the edge table under a balanced split (table / world size, plus one source's block of
    slack), its two AdamW moments, the sparse gradient of its touched rows (at most its whole share), the
    candidate workspace (5 (M, d) fp32 buffers, M = positions it scores x successors, the positions being the
    global batch's / world size x `imbalance`; with the node readout or the count prior also the (positions, V)
    logits and their gradient), the rows its recurrence fetches and their gradient, and the replicated parameters
    with their moments (and the count prior's tables). `global_tokens`: batch x length over all processes;
    `moment_bytes`: the two moments per parameter (8 in float32, 4 with SparseAdamW's bfloat16 moments).
    """
    V, d, P = config.vocab_size, config.node_size, config.num_edge_rows
    row = 4 * (d * d + d)
    degree = V if config.graph == "dense" else max(1, (P - 1) // max(V, 1))
    rows = (P - 1 + world_size - 1) // world_size + degree
    scored = math.ceil(global_tokens / world_size * imbalance)
    parts = {"edge rows (weights + biases)": rows * row}
    if optimizer_state:
        parts["AdamW moments"] = moment_bytes * rows * row // 4
    parts["row gradients (touched rows, at most the share)"] = rows * row
    every_node = getattr(config, "node_readout", False) or getattr(config, "count_prior", False)
    parts["candidate workspace"] = 5 * 4 * scored * degree * d + (2 * 4 * scored * V if every_node else 0)
    parts["fetched rows + their gradients"] = 2 * math.ceil(global_tokens / world_size) * row
    sparse = config.graph == "sparse"
    extra = (V * (getattr(config, "non_edge_bias", False) and sparse) + V * d * getattr(config, "node_readout", False)
             + d * d * getattr(config, "edge_backoff", False) + V * d * getattr(config, "node_embedding", False))
    parts["replicated (node_bias, positions, shared edge, extensions) + moments"] = (4 + moment_bytes) * (
        V * d + config.max_position_embeddings + d * d + d + extra)
    if getattr(config, "count_prior", False):  # fixed tables: V node values, K bigrams (index + value)
        parts["count prior"] = 4 * V + 12 * getattr(config, "count_prior_bigrams", 0)
    parts["total"] = sum(parts.values())
    return parts


__all__ = ["ShardedBriLLM", "ShardedOutput", "balance_sources", "source_costs", "check_assignment", "sharded_memory"]
