"""Training with the source-sharded edge table (`--edge_sharding source`, see modeling_brillm/sharding/): the model
is not handed to `accelerator.prepare` (no DDP); accelerate prepares the training loader and the scheduler."""

import math

import torch

from ..modeling_brillm import BriLLMForCausalLM
from ..optimization import SparseAdamW
from ..sharding import SHARED_FILE, ShardedBriLLM
from .errors import UsageError
from .loop import StepBase, StepResult, _extra_inputs
from .memory import agreed_free, available_memory, whole_model_bytes
from .optimizers import BETAS, EPS

EDGE_SHARDINGS = ("none", "source")
_EVAL_KEYS = ("input_ids", "attention_mask", "labels", "signal_ids")


def resolve_optimizer(edge_sharding: str, optimizer: str | None) -> str:
    """The optimizer for `--edge_sharding` (argparse checked it): lazy AdamW is the only one a sharded table can use."""
    if edge_sharding == "none":
        return optimizer or "auto"
    if optimizer not in (None, "auto", "sparse_adamw"):
        raise UsageError(f"--edge_sharding source updates each process's own rows with lazy AdamW and never forms "
                         f"the dense gradient that --optimizer {optimizer} needs; use --optimizer sparse_adamw (or "
                         "auto, the default).")
    return "sparse_adamw"


def check_checkpoint_kind(checkpoint, sharded: bool):
    """Refuse a checkpoint saved by the other kind of run (sharded or not), with a clear error."""
    is_sharded = (checkpoint / SHARED_FILE).is_file()
    if is_sharded and not sharded:
        raise UsageError(f"{checkpoint} was saved by a run with --edge_sharding source: resume it with "
                         "--edge_sharding source (any number of processes).")
    if sharded and not is_sharded:
        raise UsageError(f"{checkpoint} was saved without --edge_sharding source (it holds the whole model, not "
                         "edge shards): resume it the way it was trained.")


def prepare_sharded(args, config, graph, accelerator, checkpoint, train_loader, *, moment_dtype: str, **options):
    """(the sharded model, its SparseAdamW, the prepared training loader): built whole where every process can hold it,
    else by each process's sources; a checkpoint of this process count keeps its assignment, another gets a new one."""
    free = agreed_free(accelerator, available_memory(accelerator, args.available_memory_gb)[0])
    whole = whole_model_bytes(config) <= free
    if not whole:
        accelerator.print("the whole model does not fit one process: each process initialises only the blocks of "
                          "its own sources (ShardedBriLLM.from_config: seeded per source, not the one-process "
                          "initialisation)")
    model = BriLLMForCausalLM.from_graph(graph, config=config) if whole else None
    saved = ShardedBriLLM.saved_assignment(checkpoint) if checkpoint is not None else None
    owners = saved[0] if saved is not None and saved[1] == accelerator.num_processes else None
    try:
        if model is None:
            model = ShardedBriLLM.from_config(config, graph, owners=owners, seed=args.seed, device=accelerator.device)
        else:
            model = ShardedBriLLM(model.to(accelerator.device), owners=owners)
    except ValueError as err:
        raise UsageError(f"--edge_sharding source: {err}") from None
    optimizer = SparseAdamW(model.parameter_groups(args.weight_decay, args.learning_rate, **options),
                            lr=args.learning_rate, betas=BETAS, eps=EPS, moment_dtype=moment_dtype)
    rows = torch.tensor([model.model.base_model.biases.shape[0] - 1], device=accelerator.device)
    accelerator.print(f"edge sharding by source: edge rows per process "
                      f"{[int(r) for r in accelerator.gather(rows).tolist()]} of {config.num_edge_rows - 1:,}")
    return model, optimizer, accelerator.prepare(train_loader)


def load_sharded_checkpoint(sharded, optimizer, lr_scheduler, checkpoint):
    """Rows, moments and step counts from the shards; the rates from the scheduler (accelerate knows no shards)."""
    try:
        sharded.load_shard(checkpoint, optimizer)
    except ValueError as err:
        raise UsageError(f"could not restore the edge shards: {err}") from None
    for group, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr()):
        group["lr"] = lr


class ShardedTrainStep(StepBase):
    """`loop.TrainStep` for a `ShardedBriLLM`: the last micro-batch's step all-reduces the replicated gradients,
    rescales every gradient to the mean over the global batch and clips them by the global norm."""

    def __call__(self, batch, step: int | None = None) -> StepResult | None:
        """As `TrainStep.__call__`."""
        acc, sharded = self.accelerator, self.model
        totals = None
        with acc.accumulate(sharded):
            out = sharded(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], **_extra_inputs(batch),
                          **self.dropout_inputs(batch, step))
            (out.loss * (out.num_targets / self.ref)).backward()
            self.sums += torch.tensor([float(out.loss.detach()) * out.num_targets, out.num_targets,
                                       float(batch["attention_mask"].sum())], dtype=torch.float64,
                                      device=self.sums.device)
            if acc.sync_gradients:
                totals = self._optimizer_step()
        return self.finish(totals)

    def _optimizer_step(self) -> tuple[float, float, int]:
        """Reduce, rescale, clip and step; (loss sum, targets, real tokens) of the global batch."""
        self.model.reduce_gradients()
        scale = self.ref / max(float(self.sums[1]), 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        if self.max_grad_norm:
            self.model.clip_grad_norm_(self.max_grad_norm)
        self.optimizer.step()
        self.lr_used = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self.accelerator.reduce(self.sums[2:].clone(), reduction="sum")
        return float(self.sums[0]), float(self.sums[1]), int(tokens[0])


def evaluate_sharded(sharded, dataloader, accelerator) -> tuple[float, float, int]:
    """(mean loss, perplexity, scored tokens) as `loop.evaluate`, from an unprepared `dataloader`: each process scores
    its share of every batch's rows (with none, where a batch has fewer rows than processes, a row with no target)."""
    total, count, dev, W = 0.0, 0, accelerator.device, accelerator.num_processes
    sharded.eval()
    for batch in dataloader:
        rows = torch.arange(batch["input_ids"].shape[0]).tensor_split(W)[accelerator.process_index]
        part = {k: v[rows] for k, v in batch.items() if k in _EVAL_KEYS}  # the model's inputs (`_extra_inputs`)
        if rows.numel() == 0:
            part = {k: v[:1, :1] if v.dim() > 1 else v[:1] for k, v in batch.items() if k in _EVAL_KEYS}
            part["attention_mask"] = part["attention_mask"].clamp_min(1)
            part["labels"] = torch.full_like(part["labels"], -100)
        with torch.no_grad():
            out = sharded(loss_type="exact", **{k: v.to(dev) for k, v in part.items()})
        total, count = total + float(out.loss) * out.num_targets, count + out.num_targets
    sharded.train()
    if count == 0:
        return float("nan"), float("nan"), 0
    return total / count, math.exp(min(total / count, 700.0)), count
