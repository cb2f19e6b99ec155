"""`BriLLMSFTTrainer`: TRL's `SFTTrainer` with its loss and metrics from BriLLM's own forward. TRL's loss goes through a
fused linear LM head, which BriLLM (its logits are edge energies) does not have; the rest (datasets, tokenization,
collation, logging, saving) is TRL's. Packing is refused: BriLLM's signal runs through a whole row."""

import torch

try:
    from trl import SFTTrainer
except ImportError as err:
    raise ImportError("BriLLMSFTTrainer needs TRL: pip install 'trl>=1.16.0'") from err

__all__ = ["BriLLMSFTTrainer", "scored_positions"]


def scored_positions(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T-1) bool: the positions t whose logits BriLLM scores against `labels[:, t + 1]`."""
    scored = labels[:, 1:] != -100
    if attention_mask is not None:
        real = attention_mask != 0
        scored = scored & real[:, 1:] & real[:, :-1]
    return scored


class BriLLMSFTTrainer(SFTTrainer):
    """`trl.SFTTrainer` for BriLLM models (also loaded as remote code): same arguments, datasets and logs."""

    def __init__(self, model, args=None, *pos, **kwargs):
        if args is not None and (getattr(args, "packing", False) or getattr(args, "padding_free", False)):
            raise ValueError("BriLLMSFTTrainer does not support packing or padding_free: BriLLM's signal runs "
                             "through a whole row, so packed documents would feed each other. Set packing=False "
                             "and padding_free=False.")
        super().__init__(model, args, *pos, **kwargs)
        # SFTTrainer patched the model's forward with its fused LM head (for linear heads); BriLLM keeps its own.
        patched = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if "forward" in vars(patched):
            del patched.forward

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(**{k: v for k, v in inputs.items() if k != "use_cache"}, use_cache=False)
        scored = scored_positions(labels, inputs.get("attention_mask")).to(outputs.logits.device)
        if num_items_in_batch is None:
            loss = outputs.loss
        else:
            # BriLLM's loss is the mean over this batch's scored positions; TRL's is a sum over num_items_in_batch
            loss = outputs.loss * scored.sum() / torch.as_tensor(num_items_in_batch, device=scored.device).clamp(min=1)
            if self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes // self._tp_size)
        self._log_token_metrics("train" if model.training else "eval", outputs.logits.detach(), labels, scored, inputs)
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode, logits, labels, scored, inputs):
        """TRL's entropy and mean_token_accuracy (over the scored tokens of every process) and num_tokens."""
        logits = logits[:, :-1][scored].float()
        targets = labels[:, 1:].to(scored.device)[scored]
        log_probs = torch.log_softmax(logits, dim=-1)
        gather = self.accelerator.gather_for_metrics
        entropy_sum = gather(-(log_probs.exp() * log_probs).sum()).sum()
        correct = gather((logits.argmax(dim=-1) == targets).sum()).sum()
        num_valid = gather(scored.sum()).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train" and "attention_mask" in inputs:
            self._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
