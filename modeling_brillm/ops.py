"""TEMPORARY shim (replaced by the ops layer at merge)."""
import torch
import torch.nn.functional as F

from .backend import use_triton
from .energy import (  # noqa: F401
    CandidatePlan, EdgeGradLink, KernelPlan, candidate_energies, exact_log_partition, gather_edges, graph_max_degree,
    make_plan, scatter_logits, successor_logits, successor_logits_static, target_energies,
)
from .graph import edge_rows_from_keys


def _mix_in(out, weight_logit, mix_sum, mix_norm, mix_max):
    new_max = torch.maximum(mix_max, weight_logit)
    decay, weight = torch.exp(mix_max - new_max), torch.exp(weight_logit - new_max)
    return mix_sum * decay.unsqueeze(1) + weight.unsqueeze(1) * out, mix_norm * decay + weight, new_max


def signal_scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases, rows, has_edge, pe,
                sparse_grad=False, link=None, dropout=0.0):
    if use_triton(weights) and not dropout:
        from .triton_recurrence import signal_scan as scan, unsupported_reason
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (weights, biases, mix_weight, pe, signal))
        if unsupported_reason(weights, needs_grad) is None:
            stacked, mix_sum, mix_norm, mix_max = scan(signal, mix_sum, mix_norm, mix_max, mix_weight, weights, biases,
                                                       rows, has_edge, pe, sparse_grad, link)
            return stacked, stacked[:, -1], mix_sum, mix_norm, mix_max
    wdtype = weights.dtype
    w_steps, b_steps = gather_edges(weights, biases, rows, sparse_grad, link)
    w_steps, b_steps = w_steps.unbind(1), b_steps.unbind(1)
    pe, mix_weight = pe.unbind(1), mix_weight.unbind(1)
    feed = F.dropout(signal, dropout, training=True) if dropout else signal
    signals = []
    edge_cols = has_edge.any(0).tolist()
    for j in range(len(pe)):
        if edge_cols[j]:
            out = F.gelu(torch.bmm(feed.to(wdtype).unsqueeze(1), w_steps[j]).squeeze(1) + b_steps[j] + pe[j])
            new_sum, new_norm, new_max = _mix_in(out.float(), mix_weight[j], mix_sum, mix_norm, mix_max)
            step = has_edge[:, j]
            mix_sum = torch.where(step.unsqueeze(1), new_sum, mix_sum)
            mix_norm = torch.where(step, new_norm, mix_norm)
            mix_max = torch.where(step, new_max, mix_max)
            signal = torch.where(step.unsqueeze(1), mix_sum / mix_norm.clamp_min(1e-30).unsqueeze(1), signal)
            feed = F.dropout(signal, dropout, training=True) if dropout else signal
        signals.append(feed)
    return torch.stack(signals, 1), signal, mix_sum, mix_norm, mix_max


def decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights, biases, positions, pe_now,
                pe_next, indptr, indices, edge_keys, vocab_size, max_degree, non_edge_bias=None):
    M = positions.shape[1]
    if use_triton(tokens) and weights.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from .triton_energy import decode_step as kernel
        P = biases.shape[0]
        return kernel(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, weights, biases.view(P, -1),
                      positions.view(-1), pe_now, pe_next, indptr, indices, vocab_size, max_degree, non_edge_bias)
    wdtype = weights.dtype
    rows = edge_rows_from_keys(edge_keys, last_token, tokens, vocab_size)
    out = torch.bmm(signal.to(wdtype).unsqueeze(1), weights[rows]).squeeze(1)
    out = F.gelu(out + biases[rows, 0] + pe_now.to(wdtype))
    weight = positions.view(-1).float()[(length - 1).clamp(0, M - 1)]
    mix_sum, mix_norm, mix_max = _mix_in(out.float(), weight, mix_sum, mix_norm, mix_max)
    signal = mix_sum / mix_norm.unsqueeze(1)
    logits = successor_logits_static(signal.to(wdtype), pe_next.to(wdtype), weights, biases, tokens, indptr, indices,
                                     vocab_size, max_degree, non_edge_bias)
    return logits.float(), (signal, mix_sum, mix_norm, mix_max, length + 1, tokens)


def fused_decode_step(tokens, weights) -> bool:
    return use_triton(tokens) and weights.dtype in (torch.float32, torch.bfloat16, torch.float16)
