"""Which optimizer a run uses (`choose_optimizer`, which says why) and building it: `--optimizer auto` picks
SparseAdamW (only the edge rows a step touches are read and updated) in one process, torch's fused AdamW on dense
gradients with several processes and under FSDP."""

from dataclasses import dataclass

import torch

from modeling_brillm.optimization import SparseAdamW, parameter_groups

from .errors import UsageError

OPTIMIZERS = ("auto", "adamw", "sparse_adamw")
MOMENT_DTYPES = ("float32", "bfloat16")
BETAS, EPS = (0.9, 0.999), 1e-8  # the paper's AdamW


@dataclass
class OptimizerPlan:
    name: str  # the optimizer built: one of OPTIMIZERS
    sparse_gradients: bool  # the model gives sparse row gradients for its edge tables
    clip: bool  # the step clips the global gradient norm to max_grad_norm
    reason: str  # why, for the start-up summary


def choose_optimizer(requested: str, num_processes: int, max_grad_norm: float | None,
                     fsdp: bool = False) -> OptimizerPlan:
    """The optimizer for `--optimizer requested` (FSDP shards dense gradients only); UsageError if it cannot run."""
    clip = bool(max_grad_norm)
    if requested not in OPTIMIZERS:
        raise UsageError(f"--optimizer {requested!r}: choose one of {', '.join(OPTIMIZERS)}.")
    if requested == "sparse_adamw" and fsdp:
        raise UsageError("--optimizer sparse_adamw needs sparse row gradients, which FSDP cannot shard; use "
                         "--optimizer adamw (or auto) under FSDP, or --edge_sharding source for a sharded sparse "
                         "update.")
    if requested == "sparse_adamw" and num_processes > 1:
        raise UsageError("--optimizer sparse_adamw supports a single process only; use --optimizer adamw (or auto).")
    if requested == "sparse_adamw":
        return OptimizerPlan("sparse_adamw", True, clip, "--optimizer sparse_adamw")
    if requested == "adamw":
        return OptimizerPlan("adamw", False, clip, f"--optimizer adamw ({num_processes} process(es))" if fsdp else
                             "--optimizer adamw")
    if fsdp:
        return OptimizerPlan("adamw", False, clip, f"auto: FSDP shards dense gradients ({num_processes} process(es))")
    if num_processes > 1:
        return OptimizerPlan("adamw", False, clip, f"auto: {num_processes} processes, whose dense gradients DDP/FSDP "
                             "all-reduce")
    return OptimizerPlan("sparse_adamw", True, clip, "auto: one process, so only the edges a step touches are read and "
                         "updated")


def resolve_moment_dtype(requested: str | None, plan: OptimizerPlan, mixed_precision: str,
                         device_type: str = "cuda") -> str:
    """`--moment_dtype`, else bfloat16 under bf16 with SparseAdamW on a GPU (docs/gpu.md), else float32."""
    if requested is None:
        wanted = mixed_precision == "bf16" and plan.name == "sparse_adamw" and device_type == "cuda"
        return "bfloat16" if wanted else "float32"
    if requested not in MOMENT_DTYPES:
        raise UsageError(f"--moment_dtype {requested!r}: choose one of {', '.join(MOMENT_DTYPES)}.")
    if requested != "float32" and plan.name != "sparse_adamw":
        raise UsageError(f"--moment_dtype {requested} needs SparseAdamW (--optimizer sparse_adamw, or auto in one "
                         f"process, or --edge_sharding source); {plan.name} keeps float32 moments.")
    return requested


def describe_optimizer(plan: OptimizerPlan, max_grad_norm: float | None, moment_dtype: str = "float32") -> str:
    """The start-up line: the optimizer, why, the clipping and the moments' dtype."""
    kind = "SparseAdamW on sparse row gradients" if plan.name == "sparse_adamw" else "AdamW on dense gradients"
    clip = f"gradient norm clipped to {max_grad_norm:g}" if plan.clip else "no gradient clipping"
    moments = ("; moments in bfloat16 with stochastic rounding (4 bytes per parameter instead of 8)"
               if moment_dtype == "bfloat16" else "")
    return f"optimizer: {plan.name} ({kind}; {plan.reason}); {clip}{moments}"


def apply_pending_weight_decay(optimizer):
    """Bring lazily decayed rows up to date (SparseAdamW's lazy_weight_decay) before the weights are read."""
    inner = getattr(optimizer, "optimizer", optimizer)
    flush = getattr(inner, "apply_pending_weight_decay", None)
    if flush is not None:
        flush()


def build_optimizer(model, plan: OptimizerPlan, learning_rate: float, weight_decay: float, accelerator, *,
                    lazy_weight_decay: bool = False, shared_edge_lr_scale: float = 1.0, node_lr_scale: float = 1.0,
                    moment_dtype: str = "float32"):
    """The optimizer of `plan` over `model` (before accelerator.prepare); sets model.sparse_gradients to match."""
    model.sparse_gradients = sparse = plan.sparse_gradients
    if not sparse and shared_edge_lr_scale != 1.0:
        raise UsageError("--shared_edge_lr_scale needs sparse edge gradients (--optimizer sparse_adamw, or auto in one "
                         "process): dense AdamW updates the table as one tensor.")
    groups = parameter_groups(model, weight_decay, learning_rate, node_lr_scale=node_lr_scale,
                              lazy_weight_decay=lazy_weight_decay and sparse, shared_edge_lr_scale=shared_edge_lr_scale)
    if sparse:
        return SparseAdamW(groups, lr=learning_rate, betas=BETAS, eps=EPS, moment_dtype=moment_dtype)
    # torch's fused kernel: one pass over parameter, gradient and moments (7x faster than the default on CPU)
    fused = accelerator.device.type in ("cpu", "cuda") and accelerator.distributed_type.value != "DEEPSPEED"
    return torch.optim.AdamW(groups, lr=learning_rate, betas=BETAS, eps=EPS, fused=fused)
