"""SparseAdamW: AdamW that also takes sparse COO row gradients and updates only the rows they touch.

BriLLM's edge tables hold one d×d matrix per edge (0.96B parameters at the paper's English shape), but a training
step touches only the blocks of the sources in the batch (a few percent of the rows). With
`model.sparse_gradients = True` the model gives those parameters sparse COO gradients over the touched rows;
this optimizer applies AdamW to exactly those rows, in place, without any full-size temporary.

Semantics ("lazy AdamW", like TF's LazyAdam or `torch.optim.SparseAdam`, with AdamW's decoupled weight decay):

* Dense gradient: exactly `torch.optim.AdamW` (the same functional update, bit for bit).
* Sparse gradient, for every row r it contains (a *touched* row; explicit zero rows count as touched):
      m[r] ← β1·m[r] + (1−β1)·g[r]
      v[r] ← β2·v[r] + (1−β2)·g[r]²
      p[r] ← p[r]·(1 − lr·wd) − lr · (m[r] / (1−β1^t)) / (√(v[r] / (1−β2^t)) + ε)
  which is AdamW's update restricted to that row. Duplicate rows of an uncoalesced gradient are summed first.
* How it differs from AdamW over the whole tensor (where untouched rows would see a zero gradient):
  untouched rows do not move at all: their moments do not decay, no momentum step is applied to them, and
  weight decay is applied to touched rows only (once per step in which they are touched).
* Lazy weight decay (group option `lazy_weight_decay=True`; default False, the rule above): the decoupled decay
  that AdamW applies to every row at every step, applied to a row when it is next touched. Per sparse-gradient
  parameter the state keeps `decay_log`, Σ over the steps s in which the parameter had a gradient of
  log(1 − lr_s·wd) (a Python float, float64), and `decayed_at` (float64, one value per row): the `decay_log` up to
  which the row has been decayed. At a step t, before its AdamW update, every touched row r is multiplied by
  exp(decay_log_{t−1} − decayed_at[r]) = Π (1 − lr_s·wd) over the steps s it missed; the update then applies
  step t's own (1 − lr_t·wd) as above, and decayed_at[r] ← decay_log_t. A row's weights thus equal AdamW's
  decay-only path over every step (up to float rounding: one float64 product instead of a float32 chain), while
  its moments stay lazy. `apply_pending_weight_decay()` brings every row up to date (call it before reading or
  saving the weights: evaluation, `save_pretrained`); training after it continues identically. Dense gradients
  are decayed every step anyway, so the option changes nothing for them.
* First-row learning rate (group option `first_row_lr_scale`, default 1.0; BriLLM's shared edge is row 0 of the
  edge tables): row 0 of every sparse-gradient parameter of the group takes its Adam step with lr·scale; its
  weight decay stays lr·wd (the fused kernel is called with lr·scale and wd/scale). Must be > 0; with a dense
  gradient it is refused (use sparse gradients).
* Bias correction uses one step count t per parameter: the number of `step()` calls in which that parameter
  had a gradient (global, not per row), as `torch.optim.SparseAdam` and LazyAdam do. A row first touched at a
  late step t therefore takes a first step of (1−β1)/(1−β1^t) of AdamW's first-step size; per-row step
  counts would need another full-size tensor and break the single fused update of contiguous row ranges.
  On the first step every touched row gets exactly AdamW's first update.

* bfloat16 moments (group option `moment_dtype="bfloat16"`, default "float32"): `exp_avg` and `exp_avg_sq` are
  stored in bfloat16 (half their memory and bytes); each update computes in float32 from them and stores them back
  with stochastic rounding: up or down to a neighbouring bfloat16 with the probabilities that make the stored value
  unbiased, so v still moves when (1−β2)·g² (0.1% of v at β2 = 0.999) is below bfloat16's resolution (0.4%), where
  round-to-nearest would freeze it. The random bits hash the element's row and column, the step count and the
  moment (`rounding_bits`): the torch path and the Triton kernel draw the same bits. Parameters stay float32.

State per parameter, as in AdamW: `step` (float32 scalar tensor), `exp_avg`, `exp_avg_sq` (full size, created
on the parameter's first gradient), so `state_dict()` / `load_state_dict()` (checkpoint resume, accelerate) work
unchanged and a dense-trained checkpoint resumes with sparse gradients and back.

Speed: the row update is `adamw_rows`, which runs one fused Triton pass where the kernel backend picks Triton
(`backend.use_triton`: CUDA tensors by default; triton_optim.py: one pass over p, m, v and the values, duplicates
summed and row 0's `first_row_lr_scale` applied inside it, no host synchronisation) and the torch reference
elsewhere (row_adamw.py): torch's fused AdamW over views of contiguous row ranges of the parameter, its moments and
the gradient values (no copies), scattered rows gathered, updated and written back in bounded chunks, duplicate
rows found by one sort of the row indices with only the duplicated entries summed (torch's `coalesce()`, which
sorts and copies every value row, is never called). Lazy weight decay keeps its torch pre-pass before either (its
float64 `decayed_at` table lives on the CPU by design, so the pending decay reads the touched rows back to the
host).
"""

import math

import torch
from torch.optim import Optimizer

from .ops import kernel_enabled
from .row_adamw import adamw_rows as ref_adamw_rows
from .row_adamw import coalesce_rows, rounding_bits, stochastic_round_bf16  # noqa: F401  (public here too)
from .triton_optim import sparse_adamw_rows as kernel_adamw_rows

try:  # the same functional update torch.optim.AdamW runs
    from torch.optim.adam import adam as _adam_functional
except ImportError:  # pragma: no cover
    _adam_functional = None

__all__ = ["SparseAdamW", "parameter_groups"]

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def adamw_rows(param, exp_avg, exp_avg_sq, rows, values, step, hyper, *, unique: bool = False,
               first_row_scale: float = 1.0):
    """Lazy AdamW on the listed rows of `param` ((n_rows, W) views of it and its moments), in place: one fused pass
    (triton_optim.sparse_adamw_rows) where the kernel backend picks Triton, else torch (row_adamw.adamw_rows)."""
    update = kernel_adamw_rows if kernel_enabled("adamw_rows", param) else ref_adamw_rows
    update(param, exp_avg, exp_avg_sq, rows, values, step, hyper, unique=unique, first_row_scale=first_row_scale)


def group_moment_dtype(group) -> torch.dtype:
    """The dtype of the AdamW moments of a SparseAdamW parameter group."""
    return MOMENT_DTYPES[group.get("moment_dtype", "float32")]


class SparseAdamW(Optimizer):
    r"""AdamW for dense and sparse COO gradients; sparse ones update only the rows they touch (lazy AdamW).

    Args:
        params: parameters or parameter groups.
        lr (`float`, defaults to 1e-3): learning rate.
        betas (`tuple[float, float]`, defaults to (0.9, 0.999)): moment decay rates β1, β2.
        eps (`float`, defaults to 1e-8): added to the denominator.
        weight_decay (`float`, defaults to 0.0): decoupled weight decay (AdamW); with sparse gradients applied
            to the touched rows only, or lazily to every row with `lazy_weight_decay`.
        lazy_weight_decay (`bool`, defaults to False): with sparse gradients, decay every row as AdamW would at
            every step, applied when the row is next touched (module docstring). Per group.
        first_row_lr_scale (`float`, defaults to 1.0): learning-rate multiplier of row 0 of sparse-gradient
            parameters (BriLLM's shared edge). Per group.
        moment_dtype (`str`, defaults to "float32"): "bfloat16" stores both moments in bfloat16 with stochastic
            rounding (module docstring). Per group; float32 parameters only.
        foreach, fused (`bool`, *optional*): passed to the dense update exactly as `torch.optim.AdamW` takes them
            (dense gradients then equal `AdamW(..., foreach=..., fused=...)`); `fused=True` is several times faster
            on CPU for large dense parameters. Sparse gradients always use the fused kernel on row ranges.

    Dense gradients get exactly `torch.optim.AdamW`; see the module docstring for the sparse (lazy) semantics.
    Works as any `torch.optim.Optimizer` (schedulers, `state_dict()` / `load_state_dict()`, accelerate).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, foreach: bool | None = None, fused: bool | None = None, lazy_weight_decay: bool = False,
                 first_row_lr_scale: float = 1.0, moment_dtype: str = "float32"):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
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
            dtype = group_moment_dtype(group)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _lazy(self, group) -> bool:
        """Whether the group decays untouched rows lazily (see the module docstring)."""
        return bool(group.get("lazy_weight_decay")) and group["weight_decay"] != 0

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
        """Bring every row of every lazily decayed parameter up to date (before evaluating or saving the weights).
        Training afterwards continues as if this had not been called (up to float rounding)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "decayed_at" not in state:
                    continue
                stale = (state["decayed_at"] != state["decay_log"]).nonzero().squeeze(1).to(p.device)
                if stale.numel():
                    self._decay_rows(p, state, stale)
                    state["decayed_at"].fill_(state["decay_log"])

    def load_state_dict(self, state_dict):
        # Optimizer.load_state_dict casts floating state to the parameter's dtype; the float64 decay bookkeeping
        # must survive a checkpoint bit for bit, so it is set aside and put back.
        """Optimizer.load_state_dict, keeping the float64 lazy-decay bookkeeping exact."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept = {}
        state = dict(state_dict["state"])
        for key, value in state.items():
            if isinstance(value, dict) and "decayed_at" in value:
                value = dict(value)
                kept[key] = value.pop("decayed_at")
                state[key] = value
        super().load_state_dict({**state_dict, "state": state})
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            if saved_id in kept:
                self.state[p]["decayed_at"] = kept[saved_id].to(dtype=torch.float64, device="cpu").clone()
        for group in self.param_groups:  # bfloat16 moments were cast to float32 on the way in: exactly back
            dtype = group_moment_dtype(group)
            for p in group["params"]:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in self.state.get(p, {}):
                        self.state[p][key] = self.state[p][key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step: sparse gradients through their rows (`adamw_rows`), dense ones as AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            if torch.is_tensor(lr):
                lr = float(lr)
            dense = ([], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("SparseAdamW does not support complex parameters.")
                state = self._state(p, group)
                if p.grad.is_sparse:
                    state["step"] += 1
                    lazy = None
                    if self._lazy(group):
                        if "decayed_at" not in state:  # float64 bookkeeping on the CPU (module docstring)
                            state["decay_log"] = 0.0
                            state["decayed_at"] = torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.float64)
                        lazy = state
                    self._sparse_update(p, p.grad, state, lr, beta1, beta2, eps, wd, lazy,
                                        float(group.get("first_row_lr_scale", 1.0)))
                    if lazy is not None:
                        state["decay_log"] += math.log1p(-lr * wd)
                else:
                    if group.get("first_row_lr_scale", 1.0) != 1.0:
                        raise RuntimeError("SparseAdamW: first_row_lr_scale needs sparse gradients (set "
                                           "model.sparse_gradients = True); a dense gradient updates all rows at once.")
                    if state["exp_avg"].dtype != p.dtype:  # bfloat16 moments: every row, through the rows path
                        state["step"] += 1
                        n_rows = p.shape[0] if p.dim() else 1
                        P2, M2, V2 = (t.view(n_rows, -1) for t in (p, state["exp_avg"], state["exp_avg_sq"]))
                        rows, hyper = torch.arange(n_rows, device=p.device), (lr, beta1, beta2, eps, wd)
                        adamw_rows(P2, M2, V2, rows, p.grad.reshape(n_rows, -1), state["step"], hyper, unique=True)
                        continue
                    for lst, item in zip(dense, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                        lst.append(item)
            if dense[0]:
                params, grads, exp_avgs, exp_avg_sqs, steps = dense
                _adam_functional(
                    params, grads, exp_avgs, exp_avg_sqs, [], steps,
                    foreach=group.get("foreach"), capturable=False, differentiable=False, fused=group.get("fused"),
                    grad_scale=None,
                    found_inf=None, has_complex=False, decoupled_weight_decay=True,
                    amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False,
                )
        return loss

    # --------------------------------------------------------------------------------------- sparse rows
    @staticmethod
    def _sparse_update(p, grad, state, lr, beta1, beta2, eps, wd, lazy=None, first_row_scale: float = 1.0):
        """Lazy AdamW on the rows of one sparse COO gradient (pending decay first when lazy)."""
        sparse_dim = grad.sparse_dim()
        n_rows = 1
        for s in p.shape[:sparse_dim]:
            n_rows *= s
        if grad.layout != torch.sparse_coo:
            raise RuntimeError(f"SparseAdamW takes dense or sparse COO gradients, got layout {grad.layout}.")
        indices = grad._indices()
        values = grad._values()
        if values.numel() == 0 or indices.shape[1] == 0:
            return
        if sparse_dim == 1:
            rows = indices[0]
        else:  # linearise the sparse dimensions (row-major)
            rows = torch.zeros_like(indices[0])
            for dim in range(sparse_dim):
                rows = rows * p.shape[dim] + indices[dim]
        values = values.reshape(rows.numel(), -1)
        if values.dtype != p.dtype:
            values = values.to(p.dtype)
        P2 = p.view(n_rows, -1) if p.is_contiguous() else None
        if P2 is None:
            raise RuntimeError("SparseAdamW needs contiguous parameters for sparse gradients.")
        M2 = state["exp_avg"].view(n_rows, -1)
        V2 = state["exp_avg_sq"].view(n_rows, -1)
        step = state["step"]
        hyper = (lr, beta1, beta2, eps, wd)
        unique = False
        if lazy is not None:  # the pending decay needs unique rows (sorted rows stay as they are)
            rows, values = coalesce_rows(rows, values)
            SparseAdamW._decay_rows(p, lazy, rows.to(p.device))
            lazy["decayed_at"][rows.cpu()] = lazy["decay_log"] + math.log1p(-lr * wd)
            unique = True
        # one fused pass where the backend picks the kernel (duplicates summed and row 0's learning rate scaled
        # inside it, no host synchronisation), else the torch reference (row_adamw.py)
        adamw_rows(P2, M2, V2, rows, values, step, hyper, unique=unique, first_row_scale=first_row_scale)


def parameter_groups(model, weight_decay: float, learning_rate: float | None = None, *,
                     lazy_weight_decay: bool = False, shared_edge_lr_scale: float = 1.0,
                     node_lr_scale: float = 1.0) -> list[dict]:
    """Weight decay on the edge matrices (`...weights`) only; biases and position weights are not decayed.

    Recipe options (SparseAdamW's group options, see modeling_brillm.optimization): `lazy_weight_decay` decays every
    edge row as dense AdamW would, applied when the row is next touched; `shared_edge_lr_scale` multiplies the
    learning rate of row 0 of the edge tables (the shared edge that every non-successor uses); `node_lr_scale` that
    of the per-node parameters (`node_bias`, `non_edge_bias`). With the defaults the groups are the plain two.
    """
    named = list(model.named_parameters())
    edge = [p for n, p in named if n.endswith("weights")]
    if not lazy_weight_decay and shared_edge_lr_scale == 1.0 and node_lr_scale == 1.0:
        rest = [p for n, p in named if not n.endswith("weights")]
        return [{"params": edge, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    lr = {} if learning_rate is None else {"lr": learning_rate}
    node_names = ("node_bias", "non_edge_bias")
    edge_bias = [p for n, p in named if n.endswith("biases")]
    nodes = [p for n, p in named if n.endswith(node_names)]
    rest = [p for n, p in named if not n.endswith(("weights", "biases", *node_names))]
    groups = [
        {"params": edge, "weight_decay": weight_decay, "lazy_weight_decay": lazy_weight_decay,
         "first_row_lr_scale": shared_edge_lr_scale, **lr},
        {"params": edge_bias, "weight_decay": 0.0, "first_row_lr_scale": shared_edge_lr_scale, **lr},
        {"params": nodes, "weight_decay": 0.0,
         **({} if learning_rate is None else {"lr": learning_rate * node_lr_scale})},
        {"params": rest, "weight_decay": 0.0, **lr},
    ]
    return [g for g in groups if g["params"]]
