"""Which optimizer a run uses, and building it.

Paths (`--optimizer`):
  adamw         `torch.optim.AdamW` (torch's fused kernel where it has one) on dense gradients; DDP/FSDP
                all-reduce those gradients.
  sparse_adamw  `modeling_brillm.optimization.SparseAdamW` on sparse row gradients of the edge tables
                (`model.sparse_gradients = True`): only the touched rows are updated. One process only.

`choose_optimizer` decides (and says why), `build_optimizer` builds; the training step (loop.TrainStep) works
with either. Another path, e.g. a sharded edge table with its own optimizer and step, adds a name here and its
own step class beside TrainStep.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

OPTIMIZERS = ("adamw", "sparse_adamw")
BETAS, EPS = (0.9, 0.999), 1e-8  # the paper's AdamW


@dataclass
class OptimizerPlan:
    name: str  # the optimizer built: one of OPTIMIZERS
    sparse_gradients: bool  # the model gives sparse row gradients for its edge tables
    clip: bool  # the step clips the global gradient norm to max_grad_norm
    reason: str  # why, for the start-up summary


def choose_optimizer(requested: str, num_processes: int, max_grad_norm: float | None) -> OptimizerPlan:
    """The optimizer for `--optimizer requested` with `num_processes` processes; UsageError if it cannot run."""
    if requested == "adamw":
        return OptimizerPlan("adamw", False, bool(max_grad_norm), "asked for (--optimizer adamw)")
    if requested == "sparse_adamw":
        try:
            from modeling_brillm.optimization import SparseAdamW  # noqa: F401
        except ImportError:
            raise UsageError("--optimizer sparse_adamw needs modeling_brillm.optimization.SparseAdamW, "
                             "which this installation lacks; use --optimizer adamw.") from None
        if num_processes > 1:
            raise UsageError("--optimizer sparse_adamw supports a single process only; use --optimizer adamw.")
        return OptimizerPlan("sparse_adamw", True, False, "asked for (--optimizer sparse_adamw)")
    raise UsageError(f"--optimizer {requested!r}: choose one of {', '.join(OPTIMIZERS)}.")


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on the edge matrices (`...weights`) only; biases and position weights are not decayed."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weights")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weights")]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, plan: OptimizerPlan, learning_rate: float, weight_decay: float, accelerator):
    """The optimizer of `plan` over `model` (before accelerator.prepare); sets model.sparse_gradients to match."""
    import torch

    model.sparse_gradients = plan.sparse_gradients
    groups = parameter_groups(model, weight_decay)
    if plan.name == "sparse_adamw":
        from modeling_brillm.optimization import SparseAdamW

        return SparseAdamW(groups, lr=learning_rate, betas=BETAS, eps=EPS)
    # torch's fused kernel: one pass over parameter, gradient and moments (7x faster than the default on CPU)
    fused = accelerator.device.type in ("cpu", "cuda") and accelerator.distributed_type.value != "DEEPSPEED"
    return torch.optim.AdamW(groups, lr=learning_rate, betas=BETAS, eps=EPS, fused=fused)
