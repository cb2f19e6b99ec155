"""Sharded checkpoints: `edge_shard_<rank>_of_<world>.safetensors` per process (its sources' rows with AdamW state) and
`edge_shared.safetensors` (owners, replicated parameters, row 0, their state): read on any process count."""

import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..optimization import MOMENTS, group_moment_dtype
from .table import global_rows_of, replicated_parameters

SHARED_FILE = "edge_shared.safetensors"
SHARD_PATTERN = "edge_shard_{rank:05d}_of_{world:05d}.safetensors"
ROW_STATE = (*MOMENTS, "decayed_at")  # per-row optimizer state (decayed_at: how far lazy decay has gone)
EXTENSIONS = ("non_edge_bias", "node_readout", "edge_base", "node_embedding")  # replicated, when the model has them
# checkpoints saved before a replicated parameter trained sharded lack its key: it was absent then
ABSENT = dict.fromkeys(("start_signals", *EXTENSIONS, "count_prior"), "0")


def shape_meta(sharded) -> dict:
    """What a checkpoint must match: the shapes, and which replicated parameters the model has."""
    cfg, m = sharded.config, sharded.model.base_model
    learned = cfg.num_start_signals if cfg.start_signal == "learned" else 0
    return {"vocab_size": str(cfg.vocab_size), "node_size": str(cfg.node_size), "num_edge_rows": str(cfg.num_edge_rows),
            "graph": cfg.graph, "max_position_embeddings": str(cfg.max_position_embeddings),
            "start_signals": str(learned), **{name: str(int(getattr(m, name) is not None)) for name in EXTENSIONS},
            "count_prior": str(int(cfg.count_prior))}


def _state(optimizer, p) -> dict:
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    return state if "exp_avg" in state else {}


def save_shard(sharded, directory, optimizer=None):
    """Write this process's rows and their AdamW state into `directory`, rank 0 also the shared file (on every
    process; the caller writes into a temporary folder and renames it once all have written)."""
    m, names, rank = sharded.model.base_model, sharded.table.names, sharded.rank
    os.makedirs(directory, exist_ok=True)
    tensors = {"sources": sharded.table.owned_sources()}
    for name in names:
        p = getattr(m, name)
        tensors[name] = p.detach()[1:]
        tensors.update({f"{name}.{k}": v[1:] for k, v in _state(optimizer, p).items() if k in ROW_STATE})
    meta = {"world_size": str(sharded.world_size), "rank": str(rank), **shape_meta(sharded)}
    path = os.path.join(directory, SHARD_PATTERN.format(rank=rank, world=sharded.world_size))
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, path, metadata=meta)
    if rank == 0:
        save_file({k: v.cpu().contiguous() for k, v in _shared_tensors(sharded, optimizer).items()},
                  os.path.join(directory, SHARED_FILE), metadata=meta)
    sharded.transport.barrier()


def _shared_tensors(sharded, optimizer) -> dict:
    m, names = sharded.model.base_model, sharded.table.names
    replicated = replicated_parameters(m, names)
    shared = {"owners": sharded.owners.cpu(), **{f"{n}.row0": getattr(m, n).detach()[0] for n in names},
              **{n: p.detach() for n, p in replicated}}
    for name, p in replicated + [(n, getattr(m, n)) for n in names]:
        if not (st := _state(optimizer, p)):
            continue
        for key in MOMENTS:  # the table's row 0, the others whole
            shared[f"{name}.{key}"] = st[key][0] if name in names else st[key]
        shared[f"{name}.step"] = st["step"].detach().reshape(1).float()
        if "decayed_at" in st:  # the same decay_log on every process (every table steps every step)
            shared[f"{name}.decayed_at.row0"] = st["decayed_at"][:1]
            shared[f"{name}.decay_log"] = torch.tensor([st["decay_log"]], dtype=torch.float64)
    return shared


def saved_assignment(directory) -> tuple[torch.Tensor, int] | None:
    """(owners (V,), process count) a checkpoint was saved with, or None for a folder without a sharded one."""
    if not os.path.exists(path := os.path.join(directory, SHARED_FILE)):
        return None
    with safe_open(path, "pt") as f:
        return f.get_tensor("owners"), int((f.metadata() or {}).get("world_size", "0"))


def load_shard(sharded, directory, optimizer=None):
    """This process's rows, the replicated parameters and `optimizer`'s state from a checkpoint of any process count."""
    m, names = sharded.model.base_model, sharded.table.names
    shared, saved_world = _read_shared(sharded, directory)
    files = [os.path.join(directory, SHARD_PATTERN.format(rank=r, world=saved_world)) for r in range(saved_world)]
    if missing := [p for p in files if not os.path.exists(p)]:
        raise ValueError(f"{directory}: shard file(s) {missing} are missing; the checkpoint is incomplete.")
    states = _saved_states(sharded, shared) if optimizer is not None and f"{names[0]}.exp_avg" in shared else {}
    with torch.no_grad():
        for name, p in replicated_parameters(m, names):
            p.copy_(shared[name])
        for name in names:
            getattr(m, name)[0].copy_(shared[f"{name}.row0"])
        targets = [(n, getattr(m, n)) for n in names] + [
            (f"{n}.{k}", v) for n in names for k, v in states.get(n, {}).items() if k in ROW_STATE]
        _read_rows(sharded.table, files, targets, directory)
    # the state where SparseAdamW keeps it: the step and lazy decay on the CPU, the moments in the group's dtype
    for name, st in states.items():
        p = getattr(m, name)
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        st["step"] = st["step"].to(p.device if group.get("fused") else "cpu")
        optimizer.state[p] = {k: (v.to(p.device, group_moment_dtype(group, p)) if k in MOMENTS else v)
                              for k, v in st.items()}


def _read_shared(sharded, directory) -> tuple[dict, int]:
    """The shared file's tensors and the saved process count, after checking it was saved for this model."""
    if not os.path.exists(path := os.path.join(directory, SHARED_FILE)):
        raise ValueError(f"{directory} holds no source-sharded checkpoint ({SHARED_FILE} is missing): it was "
                         "saved without --edge_sharding source; resume it the way it was trained.")
    with safe_open(path, "pt") as f:
        meta = {**ABSENT, **(f.metadata() or {})}
        shared = {k: f.get_tensor(k) for k in f.keys()}
    m, names = sharded.model.base_model, sharded.table.names
    shapes = {n: p.shape for n, p in replicated_parameters(m, names)}
    shapes.update({f"{n}.row0": getattr(m, n).shape[1:] for n in names})
    diff = {k: (meta.get(k), v) for k, v in shape_meta(sharded).items() if meta.get(k) != v}
    diff.update({k: (tuple(shared[k].shape) if k in shared else None, tuple(s)) for k, s in shapes.items()
                 if k not in shared or shared[k].shape != s})
    if diff:
        raise ValueError(f"{directory}: the sharded checkpoint was saved for another model (saved vs this run: "
                         f"{diff}); resume with the data, tokenizer and graph it was trained with.")
    return shared, int(meta["world_size"])


def _saved_states(sharded, shared) -> dict:
    """The optimizer state of every parameter the shared file has one for (the table's rows 1.. still zero)."""
    m, names = sharded.model.base_model, sharded.table.names
    states = {}
    for name, p in replicated_parameters(m, names) + [(n, getattr(m, n)) for n in names]:
        if f"{name}.step" not in shared:  # never had a gradient (e.g. frozen): no state to restore
            continue
        st = states[name] = {"step": shared[f"{name}.step"].reshape(()).clone()}
        for key in MOMENTS:
            st[key] = torch.zeros_like(p)
            (st[key][0] if name in names else st[key]).copy_(shared[f"{name}.{key}"])
        if name in names and f"{name}.decay_log" in shared:  # lazy_weight_decay bookkeeping (SparseAdamW)
            st["decay_log"] = float(shared[f"{name}.decay_log"][0])
            st["decayed_at"] = torch.zeros(p.shape[0], dtype=torch.float64)
            st["decayed_at"][0] = shared[f"{name}.decayed_at.row0"][0]
    return states


def _read_rows(table, files, targets, directory):
    """Copy the blocks of this process's sources from the shard files into `targets` ((key, local tensor))."""
    need = set(table.owned_sources().tolist())
    degree, local, found = table.global_indptr.cpu().diff(), table.local_indptr.cpu().tolist(), 0
    for path in files:
        with safe_open(path, "pt") as f:
            sources = f.get_tensor("sources")
            deg = degree[sources]
            blocks = [(a, n, local[u] + 1) for u, a, n in zip(sources.tolist(), (deg.cumsum(0) - deg).tolist(),
                                                                 deg.tolist()) if u in need and n]
            _copy_blocks(targets, {key: f.get_slice(key) for key, _ in targets}, blocks)
            found += len(blocks)
    expected = int((degree[sorted(need)] > 0).sum()) if need else 0
    if found != expected:
        raise ValueError(f"{directory}: the shard files hold {found} of this process's {expected} sources "
                         "with edges; the checkpoint is incomplete or belongs to another graph.")


def _copy_blocks(targets, slices, blocks):  # rows [first, first + n) of each slice into [local, local + n)
    for key, t in targets:
        for first, n, local in blocks:
            t[local:local + n].copy_(slices[key][first:first + n])


def load_full_state_dict(sharded, path):
    """This process's part of a whole model's file (`full_state_dict`'s keys, or `brillm.`-prefixed), read by slice."""
    m, table = sharded.model.base_model, sharded.table
    indptr, local = table.global_indptr.tolist(), table.local_indptr.tolist()
    blocks = [(0, 1, 0)] + [(indptr[u] + 1, indptr[u + 1] - indptr[u], local[u] + 1)
                            for u in table.owned_sources().tolist() if indptr[u + 1] > indptr[u]]
    with safe_open(str(path), "pt") as f, torch.no_grad():
        prefix = "brillm." if f"brillm.{table.names[0]}" in f.keys() else ""
        for name, p in replicated_parameters(m, table.names):
            p.copy_(f.get_tensor(prefix + name))
        _copy_blocks([(n, getattr(m, n)) for n in table.names], {n: f.get_slice(prefix + n) for n in table.names},
                     blocks)


def full_state_dict(sharded) -> dict | None:
    """The whole model's state dict on rank 0, None elsewhere (call on every process; rank 0 holds the whole table)."""
    m, table, transport = sharded.model.base_model, sharded.table, sharded.transport
    params, main = [getattr(m, n).detach() for n in table.names], transport.rank == 0
    full = [torch.empty(sharded.config.num_edge_rows, *p.shape[1:], dtype=p.dtype) for p in params] if main else []
    for t, p in zip(full, params):
        t[0] = p[0].cpu()
    for r in range(transport.world):
        rows = global_rows_of((table.owners.cpu() == r).nonzero().flatten(), table.global_indptr.cpu())
        mine = r == transport.rank  # rank r sends its rows, rank 0 receives them
        got = [p[1:] if mine else p.new_empty(rows.numel(), *p.shape[1:]) for p in params] if main or mine else []
        transport.to_main(got, r)
        for t, g in zip(full, got):
            t.index_copy_(0, rows, g.cpu())
    if not main:
        return None
    state = {k: v.detach().cpu() for k, v in m.state_dict().items() if k not in table.names}
    return {**state, **dict(zip(table.names, full))}
