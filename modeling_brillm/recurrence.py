"""The signal recurrence in torch: the scan over a batch's columns, one row's step, and the signal dropout's mask.
An edge's output joins the softmax mix as a running (sum, norm, max), O(d) a token (docs/model.md, "O(d) state")."""

import math

import torch
import torch.nn.functional as F

from .csr import edge_row
from .energy import gather_edges, row_energies
from .state import BriLLMState, Columns, Mix, RowCache
from .tables import EdgeTable


def mix_in(mix: Mix, out: torch.Tensor, weight_logit: torch.Tensor) -> Mix:
    """`mix` with edge output c = `out` (B, d) of position weight logit p = `weight_logit` (B,) added:
    M' = max(M, p);  S' = S·e^{M−M'} + e^{p−M'}·c;  N' = N·e^{M−M'} + e^{p−M'};  x = S' / N'."""
    new_max = torch.maximum(mix.mix_max, weight_logit)
    decay, weight = torch.exp(mix.mix_max - new_max), torch.exp(weight_logit - new_max)
    total = torch.addcmul(mix.mix_sum * decay.unsqueeze(1), weight.unsqueeze(1), out)
    norm = torch.addcmul(weight, mix.mix_norm, decay)
    return Mix(total / norm.unsqueeze(1), total, norm, new_max)


def plus_edge_base(pe, x, edge_base):
    """PE plus x·edge_base, the shared matrix's part of an edge's input (config.edge_backoff), or PE alone."""
    return pe if edge_base is None else pe + x.to(edge_base.dtype) @ edge_base


def edge_update(mix: Mix, x, w, b, pe, weight_logit, node_add=None) -> Mix:
    """One edge step of every row (the one place it is written): GeLU(x·W + b + PE) (+ `node_add`) mixed into `mix`."""
    ct = torch.promote_types(w.dtype, torch.float32)  # bfloat16 and float16 tables: float32 math
    if w.dtype != ct:
        w, b = w.to(ct), b.to(ct)
    h = torch.baddbmm((b + pe).to(ct).unsqueeze(1), x.to(ct).unsqueeze(1), w).squeeze(1)
    out = F.gelu(h).float()
    if node_add is not None:  # outside the GeLU: the mix carries the recent nodes' vectors as they are
        out = out + node_add.float()
    return mix_in(mix, out, weight_logit)


def signal_scan(mix: Mix, columns: Columns, edges: EdgeTable, link=None) -> tuple[torch.Tensor, Mix]:
    """The recurrence, one column at a time: (signals (B, L, d), the mix after the last column). `signals[:, j]` leaves
    token j, dropped out with `columns.keep[:, j + 1]`; the mix keeps the undropped one. `link`: as `gather_edges`."""
    w_steps, b_steps = gather_edges(edges.weights, edges.biases, columns.rows, edges.sparse_grad, link)
    keep, node_add = columns.keep, columns.node_add
    out = []
    for j, crosses in enumerate(columns.has_edge.any(0).tolist()):
        if crosses:
            x = mix.signal if keep is None else mix.signal * keep[:, j]
            pe = plus_edge_base(columns.pe[:, j], x, edges.edge_base)
            step = edge_update(mix, x, w_steps[:, j], b_steps[:, j], pe, columns.weight[:, j],
                               None if node_add is None else node_add[:, j])
            mix = step.where(columns.has_edge[:, j], mix)
        out.append(mix.signal)
    signals = torch.stack(out, 1) if out else mix.signal.new_zeros(mix.signal.shape[0], 0, mix.signal.shape[1])
    return (signals if keep is None else signals * keep[:, 1:]), mix


def row_step(tokens, state: BriLLMState, tables):
    """`decode_step` of one row on the CPU, looked up on the host (`state.RowCache`): the crossed edge's output is the
    previous step's (it scored that edge), the mix's scalars host floats. (float32 logits (1, V), new state)"""
    v, edges, graph, positions = int(tokens), tables.edges, tables.graph, tables.positions
    row = state.row or RowCache(int(state.last_token), int(state.length), float(state.mix_norm), float(state.mix_max))
    with without_onednn(tokens):
        edge = edge_row(None if graph.host[0] is None else graph.host, row.node, v, graph.vocab_size)
        if row.successors is not None:
            out = row.successors[edge - 1 - row.first:edge - row.first] if edge else row.shared
        else:  # the first step after the general path
            x, pe = state.signal, positions.row(row.length)
            bias = edges.biases[edge].to(x.dtype) + plus_edge_base(pe, x, edges.edge_base)
            out = F.gelu(torch.addmm(bias, x, edges.weights[edge].to(x.dtype)))
        if tables.node_embedding is not None:
            out = out + tables.node_embedding[v:v + 1].float()
        p = tables.host_logits[min(max(row.length - 1, 0), positions.trained - 1)]  # the edge's weight logit
        top = max(row.top, p)
        decay, weight = math.exp(row.top - top), math.exp(p - top)
        total = torch.add(state.mix_sum if decay == 1.0 else state.mix_sum * decay, out.float(), alpha=weight)
        norm = row.norm * decay + weight
        signal = total / norm
        pe = plus_edge_base(positions.row(row.length + 1), signal, edges.edge_base)
        logits, (successors, shared, first) = row_energies(signal, pe, tables.row_tables, graph, v)
    mix = Mix(signal, total, torch.full((1,), norm), torch.full((1,), top))
    cache = RowCache(v, row.length + 1, norm, top, successors, shared, first)
    return logits, BriLLMState(mix, torch.full((1,), row.length + 1), tokens, state.seen + 1,
                               None if state.longest is None else state.longest + 1, row=cache)


class without_onednn:
    """oneDNN off while a CPU step runs: its GeLU costs ~10 µs a call whatever the size, torch's own ~1.5 µs."""

    def __init__(self, tensor):
        self.off = tensor.device.type == "cpu"

    def __enter__(self):
        self.onednn = torch.backends.mkldnn.enabled
        if self.off:
            torch.backends.mkldnn.enabled = False

    def __exit__(self, *exc):
        torch.backends.mkldnn.enabled = self.onednn


# Signal dropout masks: a counter-based hash of (seed, row, position, dimension) (splitmix64's increment, murmur3's
# fmix64) in int64 torch ops, which wrap as unsigned ones do; a row's mask depends on its global index, not its process.
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio, odd)
_FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)  # murmur3's fmix64 multipliers
_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(*values: int) -> int:
    """A 64-bit hash (int64 range) of integers, in Python: what the training loop derives a step's seed from."""
    h = 0
    for v in values:
        h = (h + (v & _MASK64) + _GOLDEN) & _MASK64
        for mult in _FMIX:
            h = ((h ^ (h >> 33)) * mult) & _MASK64
        h ^= h >> 33
    return _int64(h)


def _fmix64_(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 on int64 bits, in place: the right shifts are logical (the sign bits masked off)."""
    for mult in _FMIX:
        x.bitwise_xor_((x >> 33) & ((1 << 31) - 1)).mul_(_int64(mult))
    return x.bitwise_xor_((x >> 33) & ((1 << 31) - 1))


def dropout_mask(p: float, seed: int, rows: torch.Tensor, positions: torch.Tensor, d: int) -> torch.Tensor:
    """The signal dropout mask (B, C, d) float32: 1/(1−p) where kept, else 0. Entry (b, c, k) hashes (`seed`, `rows[b]`
    the row's index in the global batch, `positions[b, c]` its signal's (leaving token t: t + 1), k), so it is the
    same on any device and in any batch the row sits in."""
    if not 0 < p < 1:
        raise ValueError(f"dropout_mask: p must be in (0, 1), got {p!r}.")
    key = _fmix64_(rows.long() * _int64(_GOLDEN) + _int64(seed + _GOLDEN))  # each row's own stream
    # the counter of entry (c, k): position · d + k, spread by splitmix64's increment
    start = key.unsqueeze(1) + positions.long() * _int64(d * _GOLDEN)
    counter = torch.arange(d, device=rows.device, dtype=torch.long) * _int64(_GOLDEN)
    bits = _fmix64_(start.unsqueeze(2) + counter)
    # the bits are uniform over int64: an entry drops where they fall in the lowest share p of that range
    threshold = round(p * 2.0 ** 64) - (1 << 63)
    keep = torch.full((), 1.0 / (1.0 - p), dtype=torch.float32, device=rows.device)
    return torch.where(bits >= threshold, keep, torch.zeros((), dtype=torch.float32, device=rows.device))


def check_dropout_rows(rows, batch: int, device) -> torch.Tensor | None:
    """`dropout_rows` as (B,) long on `device` (None stays None): each row's index in the global batch."""
    if rows is None:
        return None
    rows = torch.as_tensor(rows, device=device)
    if rows.is_floating_point() or rows.dtype == torch.bool or tuple(rows.shape) != (batch,):
        raise ValueError(f"dropout_rows must be integer row indices of shape (batch,) = ({batch},), got "
                         f"{tuple(rows.shape)} {rows.dtype}: pass each row's index in the global batch.")
    return rows.long()


def scan_dropout_mask(p: float, seed: int, rows, start, shape, d: int, device) -> torch.Tensor:
    """The (B, L + 1, d) mask of a scan over `shape` = (B, L) columns (entry j: column j's input, at start + j)."""
    B, L = shape
    rows = torch.arange(B, device=device) if rows is None else rows.to(device)
    start = torch.zeros(B, dtype=torch.long, device=device) if start is None else start.to(device)
    return dropout_mask(p, seed, rows, start.unsqueeze(1) + torch.arange(L + 1, device=device), d)
