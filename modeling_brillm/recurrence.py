"""The signal recurrence in torch: the reference that the Triton scan (triton_recurrence.py) and the fused decode
step (triton_energy.decode_step) compute too, and the path every device without them runs.

One edge step: the signal x leaving token u crosses the edge u→v (edge-table row r) and gives the edge output
c = GeLU(x·W[r] + b[r] + PE) (plus v's own vector e[v] with config.node_embedding); the signal leaving v is the
softmax mix of every edge output so far, weighted by the position weight logits p, kept as a running (sum S,
norm N, max M) so it costs O(d) a token:

    M' = max(M, p);  S' = S·e^{M−M'} + e^{p−M'}·c;  N' = N·e^{M−M'} + e^{p−M'};  x = S' / N'

(docs/model.md has the model's math). `ops.py` picks this module or the kernels; the model calls ops.
"""

import torch
import torch.nn.functional as F

from .energy import gather_edges, successor_logits_static
from .graph import edge_rows_from_keys


def mix_in(out, weight_logit, mix_sum, mix_norm, mix_max):
    """Add edge output `out` (B, d) with position weight logit (B,) to the running softmax mix."""
    new_max = torch.maximum(mix_max, weight_logit)
    decay, weight = torch.exp(mix_max - new_max), torch.exp(weight_logit - new_max)
    return mix_sum * decay.unsqueeze(1) + weight.unsqueeze(1) * out, mix_norm * decay + weight, new_max


def plus_edge_base(pe, x, edge_base):
    """PE plus x·edge_base, the shared matrix's part of an edge's input (config.edge_backoff), or PE alone."""
    return pe if edge_base is None else pe + x.to(edge_base.dtype) @ edge_base


def edge_update(signal, w, b, pe, weight_logit, mix_sum, mix_norm, mix_max, node_add=None):
    """One edge step of every row: the edge output GeLU(x·W + b + PE) in the edge table's dtype (`w` (B, d, d),
    `b` and `pe` (B, d)), plus the entered node's vector `node_add` (B, d) where given (config.node_embedding),
    mixed (float32) into the running softmax mix; returns the new (sum, norm, max).
    The one place the step is written: the column loop, the decode step and its reference all call it."""
    out = F.gelu(torch.bmm(signal.to(w.dtype).unsqueeze(1), w).squeeze(1) + b + pe).float()
    if node_add is not None:  # outside the GeLU: the mix carries the recent nodes' vectors as they are
        out = out + node_add.float()
    return mix_in(out, weight_logit, mix_sum, mix_norm, mix_max)


def signal_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe,
                sparse_grad: bool = False, link=None, keep=None, edge_base=None, node_add=None):
    """The recurrence over all columns, one column at a time; returns (signals, signal, mix_sum, mix_norm, mix_max).

    `signal`, `mix_sum` (B, d), `mix_norm`, `mix_max` (B,): the state before the first column (float32);
    `mix_weight` (B, L): each column's position weight logit; `weights` (P, d, d), `biases` (P, 1, d): the edge
    table; `rows` (B, L): each column's edge row (any valid row where `has_edge` (B, L) is False); `pe` (B, L, d):
    each column's PE row in the table's dtype. `sparse_grad` / `link`: as `energy.gather_edges`. `keep` (B, L + 1,
    d), optional: a dropout mask (0, or 1/(1−p)) on the signal where it is used; entry j multiplies the signal
    entering column j's edge, entry j + 1 the one leaving it, which is also what token j's candidates see
    (`signals`); the state and the returned `signal` keep the undropped one. `edge_base` (d, d), optional: the
    matrix every edge adds to its own (config.edge_backoff). `node_add` (B, L, d), optional: the vector of the node
    each column's edge enters, added to its output (config.node_embedding).
    """
    L = rows.shape[1]
    w_steps, b_steps = gather_edges(weights, biases, rows, sparse_grad, link)
    w_steps, b_steps = w_steps.unbind(1), b_steps.unbind(1)
    pe, mix_weight = pe.unbind(1), mix_weight.unbind(1)
    signals = []
    edge_cols = has_edge.any(0).tolist()
    for j in range(L):
        if edge_cols[j]:
            feed = signal if keep is None else signal * keep[:, j]
            edge_input = plus_edge_base(pe[j], feed, edge_base)
            new_sum, new_norm, new_max = edge_update(feed, w_steps[j], b_steps[j], edge_input, mix_weight[j], mix_sum,
                                                     mix_norm, mix_max, None if node_add is None else node_add[:, j])
            step = has_edge[:, j]
            mix_sum = torch.where(step.unsqueeze(1), new_sum, mix_sum)
            mix_norm = torch.where(step, new_norm, mix_norm)
            mix_max = torch.where(step, new_max, mix_max)
            signal = torch.where(step.unsqueeze(1), mix_sum / mix_norm.clamp_min(1e-30).unsqueeze(1), signal)
        signals.append(signal)
    stacked = torch.stack(signals, 1) if signals else signal.new_zeros(signal.shape[0], 0, signal.shape[1])
    if keep is not None:
        stacked = stacked * keep[:, 1:]
    return stacked, signal, mix_sum, mix_norm, mix_max


@torch.no_grad()
def decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights, biases, positions, pe_now,
                pe_next, indptr, indices, edge_keys, vocab_size: int, max_degree: int, non_edge_bias=None,
                edge_base=None, node_add=None):
    """One token per row with no host read and shapes fixed by (B, max_degree): the edge last_token→tokens, the mix,
    then every node's energy as the successor of `tokens`. Returns ((B, V) float32 logits, (signal, mix_sum,
    mix_norm, mix_max, length + 1, tokens)). `positions` is the model's (1, M, 1) weight logits (a position past
    them uses the last), `pe_now` / `pe_next` the PE rows of `length` / `length + 1`, `edge_keys` as
    `graph.edge_rows_from_keys` (None: dense), `edge_base` the matrix every edge adds to its own (or None),
    `node_add` (B, d) the vector of the node each row enters, `node_embedding[tokens]` (or None)."""
    wdtype = weights.dtype
    M = positions.numel()
    rows = edge_rows_from_keys(edge_keys, last_token, tokens, vocab_size)
    weight = positions.view(-1).float()[(length - 1).clamp(0, M - 1)]
    mix_sum, mix_norm, mix_max = edge_update(signal, weights[rows], biases.reshape(weights.shape[0], -1)[rows],
                                             plus_edge_base(pe_now.to(wdtype), signal, edge_base), weight, mix_sum,
                                             mix_norm, mix_max, node_add)
    signal = mix_sum / mix_norm.unsqueeze(1)
    pe_next = plus_edge_base(pe_next.to(wdtype), signal, edge_base)
    logits = successor_logits_static(signal.to(wdtype), pe_next, weights, biases, tokens, indptr, indices, vocab_size,
                                     max_degree, non_edge_bias)
    return logits.float(), (signal, mix_sum, mix_norm, mix_max, length + 1, tokens)


# ------------------------------------------------------------------------------------- signal dropout masks
# The mask is a pure function of (seed, row, position, dimension): a counter-based hash (splitmix64's stream
# increment, murmur3's 64-bit finaliser) in int64 torch ops, which wrap on overflow as unsigned arithmetic does. A
# row's mask thus depends on its index in the global batch, not on which process holds it or beside which rows.
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
    """The signal dropout mask (B, C, d) float32: 1/(1−p) where kept (probability 1 − p), else 0.

    Entry (b, c, k) hashes (`seed`, `rows[b]`, `positions[b, c]`, k): `rows` (B,) are the rows' indices in the
    global batch, `positions` (B, C) the positions whose signals the columns carry. The same arguments give the
    same mask on any device and in any batch the row sits in."""
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


__all__ = ["decode_step", "dropout_mask", "edge_update", "mix64", "mix_in", "plus_edge_base", "signal_scan"]
