"""Training with the source-sharded edge table (`--edge_sharding source`, see modeling_brillm/sharding.py).

The model is not handed to `accelerator.prepare` (no DDP, no dense all-reduce): each process keeps the blocks of
the sources it owns, `ShardedTrainStep` runs the step (backward, the all-reduce of the replicated gradients, the
clipping by the global gradient norm, SparseAdamW on the owned rows, with the recipe options `--node_lr_scale`,
`--shared_edge_lr_scale` and `--lazy_weight_decay` as in one process), validation splits every batch over the
processes, checkpoints add one shard file per process (written into the checkpoint's temporary folder before its
one rename), and the final model is gathered on the main process for `save_pretrained`. Accelerate still prepares
the training loader and the scheduler and forms the process group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import math

from .errors import UsageError
from .loop import StepKeys, StepResult, _extra_inputs
from .optimizers import BETAS, EPS

EDGE_SHARDINGS = ("none", "source")


def resolve_optimizer(edge_sharding: str, optimizer: str | None) -> str:
    """The optimizer name for this sharding: lazy AdamW is the only one a sharded table can use."""
    if edge_sharding not in EDGE_SHARDINGS:
        raise UsageError(f"--edge_sharding {edge_sharding!r}: choose one of {', '.join(EDGE_SHARDINGS)}.")
    if edge_sharding == "none":
        return optimizer or "auto"
    if optimizer not in (None, "auto", "sparse_adamw"):
        raise UsageError(
            f"--edge_sharding source updates each process's own rows with lazy AdamW and never forms the dense "
            f"gradient that --optimizer {optimizer} needs; use --optimizer sparse_adamw (or auto, the default)."
        )
    return "sparse_adamw"


def checkpoint_kind_error(checkpoint, sharded: bool) -> UsageError | None:
    """A clear error when a checkpoint was saved by the other kind of run (sharded or not)."""
    from modeling_brillm.sharding import SHARED_FILE

    is_sharded = (checkpoint / SHARED_FILE).is_file()
    if is_sharded and not sharded:
        return UsageError(f"{checkpoint} was saved by a run with --edge_sharding source: resume it with "
                          "--edge_sharding source (any number of processes).")
    if sharded and not is_sharded:
        return UsageError(f"{checkpoint} was saved without --edge_sharding source (it holds the whole model, not "
                          "edge shards): resume it the way it was trained.")
    return None


def whole_model_fits(config, accelerator, args) -> bool:
    """Whether every process can build the whole model before sharding it (the same initialisation as one
    process); else each process initialises only its own sources' blocks."""
    import torch

    from .memory import available_memory, sharded_training_memory

    need = sharded_training_memory(config, accelerator.num_processes,
                                   args.per_device_train_batch_size * args.block_size)["whole_model"]
    have, _ = available_memory(accelerator, args.available_memory_gb)
    if accelerator.num_processes > 1 and math.isfinite(have):  # every process must take the same path
        have = float(accelerator.gather(torch.tensor([have], dtype=torch.float64, device=accelerator.device)).min())
    return need <= have


def build_sharded(model, accelerator, checkpoint=None, config=None, graph=None, seed: int = 0):
    """Shard `model` (built identically on every process) by source node, or with `model=None` build the shards
    directly from `config` / `graph` (`ShardedBriLLM.from_config`). A checkpoint saved with this process count
    keeps its assignment; another count gets a fresh balanced one (the rows are re-read by owner)."""
    from modeling_brillm.sharding import ShardedBriLLM

    owners = None
    if checkpoint is not None:
        saved = ShardedBriLLM.saved_assignment(checkpoint)
        if saved is not None and saved[1] == accelerator.num_processes:
            owners = saved[0]
    try:
        if model is None:
            return ShardedBriLLM.from_config(config, graph, owners=owners, seed=seed, device=accelerator.device)
        return ShardedBriLLM(model.to(accelerator.device), owners=owners)
    except ValueError as err:
        raise UsageError(f"--edge_sharding source: {err}") from None


def build_sharded_optimizer(sharded, learning_rate: float, weight_decay: float, *, lazy_weight_decay: bool = False,
                            shared_edge_lr_scale: float = 1.0, node_lr_scale: float = 1.0,
                            moment_dtype: str = "float32"):
    """SparseAdamW over the shards with the groups (and recipe options) of the one-process optimizer
    (`optimizers.build_optimizer`): on each process it updates the rows it owns exactly as one process would."""
    from modeling_brillm.optimization import SparseAdamW

    groups = sharded.parameter_groups(weight_decay, learning_rate, lazy_weight_decay=lazy_weight_decay,
                                      shared_edge_lr_scale=shared_edge_lr_scale, node_lr_scale=node_lr_scale)
    return SparseAdamW(groups, lr=learning_rate, betas=BETAS, eps=EPS, moment_dtype=moment_dtype)


def load_sharded_checkpoint(sharded, optimizer, lr_scheduler, checkpoint):
    """Rows, moments and step counts from the shards; the learning rate from the restored scheduler (the
    optimizer is not registered with accelerate, whose load_state would otherwise restore it)."""
    try:
        sharded.load_shard(checkpoint, optimizer)
    except ValueError as err:
        raise UsageError(f"could not restore the edge shards: {err}") from None
    for group, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr()):
        group["lr"] = lr


class ShardedTrainStep(StepKeys):
    """`loop.TrainStep` for a `ShardedBriLLM`: the same token-weighted global mean and StepResult.

    Every process backpropagates (global mean of this micro-batch) x (its global targets) / ref; at the last
    micro-batch of an accumulation the replicated gradients are all-reduced and every gradient is multiplied by
    ref / (targets of the whole accumulation), which gives the gradient of the mean over every target of the
    global batch; then, as `TrainStep` in one process, the gradients are clipped to `max_grad_norm` by their global
    norm (`ShardedBriLLM.clip_grad_norm_`: one all-reduce of the owners' squared norms; None or 0: no clipping).
    """

    def __init__(self, accelerator, sharded, optimizer, lr_scheduler, *, per_device_batch_size: int,
                 block_size: int, learning_rate: float, max_grad_norm: float | None = None,
                 seed: int | None = None):
        import torch

        self.accelerator, self.sharded = accelerator, sharded
        self.keys_from(accelerator, per_device_batch_size, seed)
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.ref = float(per_device_batch_size * block_size)
        self.lr_used = learning_rate
        self.max_grad_norm = max_grad_norm
        self.sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, targets, own tokens

    def __call__(self, batch, step: int | None = None) -> StepResult | None:
        """As `TrainStep.__call__`."""
        import torch

        acc, sharded = self.accelerator, self.sharded
        totals = None
        with acc.accumulate(sharded):
            out = sharded(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], **_extra_inputs(batch),
                          **self.dropout_inputs(batch, step))
            (out.loss * (out.num_targets / self.ref)).backward()
            self.sums += torch.tensor([float(out.loss.detach()) * out.num_targets, out.num_targets,
                                       float(batch["attention_mask"].sum())], dtype=torch.float64,
                                      device=self.sums.device)
            if acc.sync_gradients:
                sharded.reduce_gradients()
                scale = self.ref / max(float(self.sums[1]), 1.0)
                for p in sharded.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
                if self.max_grad_norm:
                    sharded.clip_grad_norm_(self.max_grad_norm)
                self.optimizer.step()
                self.lr_used = self.lr_scheduler.get_last_lr()[0]
                self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                tokens = acc.reduce(self.sums[2:].clone(), reduction="sum")
                totals = (float(self.sums[0]), float(self.sums[1]), int(tokens[0]))
        self.advance(totals is not None)
        if totals is None:
            return None
        self.sums.zero_()
        return StepResult(loss=totals[0] / max(totals[1], 1.0), targets=int(totals[1]), tokens=totals[2],
                          lr=self.lr_used)


def evaluate_sharded(sharded, dataloader, accelerator) -> tuple[float, float, int]:
    """(mean loss, perplexity, scored tokens) over the validation blocks with the full softmax, as
    `loop.evaluate`. `dataloader` is NOT prepared: every process reads every batch and scores its share of the
    rows (a process left without rows scores a one-token row with no target), so no block counts twice."""
    import torch

    W, rank = accelerator.num_processes, accelerator.process_index
    total, count = 0.0, 0
    sharded.eval()
    for batch in dataloader:
        rows = torch.arange(batch["input_ids"].shape[0]).tensor_split(W)[rank]
        ids, mask, labels = (batch[k][rows] for k in ("input_ids", "attention_mask", "labels"))
        extra = {k: v[rows] for k, v in _extra_inputs(batch).items()}
        if rows.numel() == 0:
            ids, mask = batch["input_ids"][:1, :1], batch["attention_mask"][:1, :1].clamp_min(1)
            labels = torch.full_like(ids, -100)
            extra = {k: v[:1] for k, v in _extra_inputs(batch).items()}
        dev = accelerator.device
        with torch.no_grad():
            out = sharded(ids.to(dev), mask.to(dev), labels=labels.to(dev), loss_type="exact",
                          **{k: v.to(dev) for k, v in extra.items()})
        total += float(out.loss) * out.num_targets
        count += out.num_targets
    sharded.train()
    if count == 0:
        return float("nan"), float("nan"), 0
    loss = total / count
    return loss, math.exp(min(loss, 700.0)), count
