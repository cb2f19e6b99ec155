"""SparseAdamW: AdamW that also takes sparse COO row gradients (`model.sparse_gradients = True` gives the edge tables
such gradients; docs/training.md, "Optimizer and precision") and updates only the rows they touch, in place.

Dense gradients get exactly `torch.optim.AdamW`. A sparse gradient's rows (explicit zero rows too, duplicates summed)
take AdamW's update; untouched rows neither move nor decay their moments, weight decay reaches touched rows only, and
bias correction counts the parameter's steps. Group options: `lazy_weight_decay` gives a row, when next touched, the
decay AdamW gave every row at every step (`decay_log` = Σ log(1 − lr_s·wd) over the steps, `decayed_at` = the
`decay_log` each row was decayed up to, float64 on the CPU; `apply_pending_weight_decay()` brings every row up to
date); `first_row_lr_scale` steps row 0 (the shared edge) with lr·scale, its decay staying lr·wd;
`moment_dtype="bfloat16"` keeps both moments in bfloat16 with stochastic rounding (docs/gpu.md, "Mixed precision")."""

import math

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as _adam_functional  # the functional update torch.optim.AdamW runs

from .ops import kernel_enabled
from .row_adamw import adamw_rows as ref_adamw_rows
from .row_adamw import coalesce_rows
from .triton_optim import sparse_adamw_rows as kernel_adamw_rows

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MOMENTS = ("exp_avg", "exp_avg_sq")


def adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, *, unique: bool = False,
               first_row_scale: float = 1.0):
    """Lazy AdamW on the listed rows of (n_rows, W) views, in place: the kernel where the backend picks it, or torch."""
    update = kernel_adamw_rows if kernel_enabled("adamw_rows", param) else ref_adamw_rows
    update(param, exp_avg, exp_avg_sq, rows, values, step, hyper, unique=unique, first_row_scale=first_row_scale)


def group_moment_dtype(group, param) -> torch.dtype:
    """The dtype of `param`'s AdamW moments in a SparseAdamW group: float64 for a float64 parameter (as AdamW)."""
    return torch.float64 if param.dtype == torch.float64 else MOMENT_DTYPES[group.get("moment_dtype", "float32")]


class SparseAdamW(Optimizer):
    """AdamW for dense and sparse COO gradients (module docstring), used as any `torch.optim.Optimizer`. `lr`,
    `betas`, `eps`, `weight_decay`, `foreach` and `fused` are `torch.optim.AdamW`'s; the other options are per group."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, foreach: bool | None = None, fused: bool | None = None, lazy_weight_decay: bool = False,
                 first_row_lr_scale: float = 1.0, moment_dtype: str = "float32"):
        for what, value in (("learning rate", lr), ("epsilon value", eps), ("weight_decay value", weight_decay)):
            if not 0.0 <= value:
                raise ValueError(f"Invalid {what}: {value}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach, fused=fused,
                        lazy_weight_decay=lazy_weight_decay, first_row_lr_scale=first_row_lr_scale,
                        moment_dtype=moment_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["first_row_lr_scale"] > 0:
                raise ValueError(f"Invalid first_row_lr_scale: {group['first_row_lr_scale']} (must be > 0)")
            if group["moment_dtype"] not in MOMENT_DTYPES:
                raise ValueError(f"Invalid moment_dtype: {group['moment_dtype']!r} (one of {', '.join(MOMENT_DTYPES)})")
            if group["moment_dtype"] != "float32" and any(p.dtype != torch.float32 for p in group["params"]):
                raise ValueError("moment_dtype='bfloat16' needs float32 parameters (they stay the master copy).")

    def _state(self, p, group):
        """The parameter's AdamW state, created (moments in the group's dtype) on its first gradient."""
        state = self.state[p]
        if len(state) == 0:  # as torch.optim.AdamW: the step on the CPU unless the fused dense kernel is used
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group.get("fused") else "cpu")
            dtype = group_moment_dtype(group, p)
            for key in MOMENTS:
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _decay_rows(p, state, rows):
        """Multiply `rows` (unique) of p by their pending decay, exp(decay_log − decayed_at[row])."""
        n_rows = state["decayed_at"].numel()
        P2 = p.view(n_rows, -1)
        pending = (state["decay_log"] - state["decayed_at"][rows.cpu()]).exp_().to(device=p.device, dtype=p.dtype)
        if rows.numel() == n_rows:
            P2.mul_(pending.unsqueeze(1))
        else:
            P2.index_copy_(0, rows, P2.index_select(0, rows) * pending.unsqueeze(1))

    @torch.no_grad()
    def apply_pending_weight_decay(self):
        """Bring every lazily decayed row up to date (before evaluating or saving); training continues unchanged."""
        for p in [p for group in self.param_groups for p in group["params"]]:
            state = self.state.get(p, {})
            if "decayed_at" in state:
                stale = (state["decayed_at"] != state["decay_log"]).nonzero().squeeze(1).to(p.device)
                if stale.numel():
                    self._decay_rows(p, state, stale)
                    state["decayed_at"].fill_(state["decay_log"])

    def load_state_dict(self, state_dict):
        """Optimizer.load_state_dict, with the float64 decay bookkeeping and bfloat16 moments kept exact."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept = {k: v["decayed_at"] for k, v in state_dict["state"].items() if isinstance(v, dict) and "decayed_at" in v}
        state = {k: {n: x for n, x in v.items() if n != "decayed_at"} if k in kept else v
                 for k, v in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": state})
        params = [(group, p) for group in self.param_groups for p in group["params"]]
        for saved_id, (group, p) in zip(saved_ids, params):
            if saved_id in kept:
                self.state[p]["decayed_at"] = kept[saved_id].to(dtype=torch.float64, device="cpu").clone()
            state = self.state.get(p, {})  # bfloat16 moments were cast to float32 on the way in: exactly back
            state.update({key: state[key].to(group_moment_dtype(group, p)) for key in MOMENTS if key in state})

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step: sparse gradients through their rows (`adamw_rows`), dense ones as AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            hyper = (float(lr) if torch.is_tensor(lr) else lr, beta1, beta2, eps, wd)
            dense = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("SparseAdamW does not support complex parameters.")
                state = self._state(p, group)
                if p.grad.is_sparse:
                    self._sparse_step(p, state, group, hyper)
                elif not self._rows_step(p, state, group, hyper):
                    dense.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
            if dense:
                params, grads, exp_avgs, exp_avg_sqs, steps = (list(column) for column in zip(*dense))
                _adam_functional(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group.get("foreach"),
                                 capturable=False, differentiable=False, fused=group.get("fused"), grad_scale=None,
                                 found_inf=None, has_complex=False, decoupled_weight_decay=True, amsgrad=False,
                                 beta1=beta1, beta2=beta2, lr=hyper[0], weight_decay=wd, eps=eps, maximize=False)
        return loss

    @staticmethod
    def _rows_step(p, state, group, hyper) -> bool:
        """A dense gradient: with bfloat16 moments every row through `adamw_rows` (True), else AdamW's (False)."""
        if group.get("first_row_lr_scale", 1.0) != 1.0:
            raise RuntimeError("SparseAdamW: first_row_lr_scale needs sparse gradients (set "
                               "model.sparse_gradients = True); a dense gradient updates all rows at once.")
        if state["exp_avg"].dtype == p.dtype:
            return False
        state["step"] += 1
        n_rows = p.shape[0] if p.dim() else 1
        P2, M2, V2 = (t.view(n_rows, -1) for t in (p, state["exp_avg"], state["exp_avg_sq"]))
        rows = torch.arange(n_rows, device=p.device)
        adamw_rows(P2, M2, V2, rows, p.grad.reshape(n_rows, -1), state["step"], hyper, unique=True)
        return True

    def _sparse_step(self, p, state, group, hyper):
        """Lazy AdamW on the rows of a sparse COO gradient (their pending decay first, with lazy weight decay)."""
        lr, wd = hyper[0], hyper[4]
        state["step"] += 1
        lazy = bool(group.get("lazy_weight_decay")) and wd != 0
        if lazy and "decayed_at" not in state:  # float64 bookkeeping on the CPU (module docstring)
            state["decay_log"] = 0.0
            state["decayed_at"] = torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.float64)
        grad = p.grad
        indices, values = grad._indices(), grad._values()
        if values.numel() and indices.shape[1]:
            if not p.is_contiguous():
                raise RuntimeError("SparseAdamW needs contiguous parameters for sparse gradients.")
            rows = indices[0]
            for dim in range(1, grad.sparse_dim()):  # linearise the sparse dimensions (row-major)
                rows = rows * p.shape[dim] + indices[dim]
            values = values.reshape(rows.numel(), -1).to(p.dtype)
            n_rows = math.prod(p.shape[:grad.sparse_dim()])
            P2, M2, V2 = (t.view(n_rows, -1) for t in (p, state["exp_avg"], state["exp_avg_sq"]))
            if lazy:  # the pending decay needs unique rows (sorted rows stay as they are)
                rows, values = coalesce_rows(rows, values)
                self._decay_rows(p, state, rows.to(p.device))
                state["decayed_at"][rows.cpu()] = state["decay_log"] + math.log1p(-lr * wd)
            adamw_rows(P2, M2, V2, rows, values, state["step"], hyper, unique=lazy,
                       first_row_scale=float(group.get("first_row_lr_scale", 1.0)))
        if lazy:
            state["decay_log"] += math.log1p(-lr * wd)


def parameter_groups(model, weight_decay: float = 0.0, learning_rate: float | None = None, *,
                     lazy_weight_decay: bool = False, shared_edge_lr_scale: float = 1.0,
                     node_lr_scale: float = 1.0) -> list[dict]:
    """Weight decay on the edge matrices (`...weights`) only; `shared_edge_lr_scale` scales the rate of row 0 of the
    edge tables, `node_lr_scale` that of `node_bias` and `non_edge_bias` (SparseAdamW's group options)."""
    if node_lr_scale != 1.0 and learning_rate is None:
        raise ValueError("parameter_groups: node_lr_scale scales learning_rate; pass learning_rate (the "
                         "optimizer's lr) too.")
    named = list(model.named_parameters())
    edge = [p for n, p in named if n.endswith("weights")]
    if not lazy_weight_decay and shared_edge_lr_scale == 1.0 and node_lr_scale == 1.0:
        rest = [p for n, p in named if not n.endswith("weights")]
        return [{"params": edge, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    lr = {} if learning_rate is None else {"lr": learning_rate}
    node_lr = {} if learning_rate is None else {"lr": learning_rate * node_lr_scale}
    node_names = ("node_bias", "non_edge_bias")
    edge_bias = [p for n, p in named if n.endswith("biases")]
    nodes = [p for n, p in named if n.endswith(node_names)]
    rest = [p for n, p in named if not n.endswith(("weights", "biases", *node_names))]
    groups = [
        {"params": edge, "weight_decay": weight_decay, "lazy_weight_decay": lazy_weight_decay,
         "first_row_lr_scale": shared_edge_lr_scale, **lr},
        {"params": edge_bias, "weight_decay": 0.0, "first_row_lr_scale": shared_edge_lr_scale, **lr},
        {"params": nodes, "weight_decay": 0.0, **node_lr},
        {"params": rest, "weight_decay": 0.0, **lr},
    ]
    return [g for g in groups if g["params"]]
