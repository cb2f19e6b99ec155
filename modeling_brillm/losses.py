"""BriLLM's training objectives (exact, sampled) over candidate energies: the model's and the sharded trainer's."""

import torch

from .ops import exact_log_partition, scatter_logits, target_energies


def shift_labels(labels: torch.Tensor, attention_mask, column: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Targets (B, L) of the compacted tokens: `logits[:, t]` predicts `labels[:, t + 1]` (as every HF causal LM);
    -100 where the next column is padding, past the end, or ignored. `column` maps compacted tokens to columns."""
    T = labels.shape[1]
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        next_real = torch.zeros_like(shifted, dtype=torch.bool)
        next_real[:, :-1] = attention_mask[:, -T:][:, 1:] != 0
        shifted = torch.where(next_real, shifted, torch.full_like(shifted, -100))
    targets = shifted.gather(1, column)
    if bool(((targets != -100) & ((targets < 0) | (targets >= vocab_size))).any()):
        raise ValueError(f"labels hold ids outside the vocabulary [0, {vocab_size}) (use -100 to ignore a position).")
    return targets


def sampled_loss(logits, shared, sources, targets, num_negatives: int, negative_sampling: str,
                 successors_by_count=None) -> torch.Tensor:
    """Per-position cross-entropy over the target (first) and K negatives: "uniform", K nodes other than the target;
    "frequency", the source's K most frequent successors but the target (`successors_by_count`), then non-successors."""
    K = num_negatives
    if negative_sampling == "uniform":
        noise = torch.rand(logits.shape, device=logits.device)
        noise.scatter_(1, targets.unsqueeze(1), -1.0)
        neg_logits = logits.gather(1, noise.topk(K, dim=1).indices)
    else:
        table = successors_by_count[sources]  # (n, K+1), -1 = no further real successor
        drop = table == targets.unsqueeze(1)
        drop[:, -1] |= ~drop.any(1)  # drop the target if listed, else the least frequent
        chosen = table.gather(1, torch.argsort(drop.to(torch.int8), dim=1, stable=True)[:, :K])
        neg_logits = torch.where(chosen < 0, shared.unsqueeze(1), logits.gather(1, chosen.clamp_min(0)))
    scores = torch.cat([logits.gather(1, targets.unsqueeze(1)), neg_logits], 1)
    return torch.logsumexp(scores, 1) - scores[:, 0]


def position_losses(energies, shared, plan, sources, targets, target_rows, block_first_row, config,
                    non_edge_bias=None, logits=None, successors_by_count=None, loss_type=None) -> torch.Tensor:
    """Loss of every planned position (sorted as `plan`): exact or sampled (`loss_type`, else `config.loss_type`)."""
    V = config.vocab_size
    true_energy = target_energies(energies, shared, plan, targets, target_rows, block_first_row, non_edge_bias)
    if (loss_type or config.loss_type) == "exact":
        return exact_log_partition(energies, shared, plan, V, non_edge_bias) - true_energy
    if logits is None:
        logits = scatter_logits(energies, shared, plan, V, non_edge_bias)
    return sampled_loss(logits, shared, sources, targets, config.num_negatives, config.negative_sampling,
                        successors_by_count)
