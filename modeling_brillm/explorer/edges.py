"""A node's outgoing edges for the Node view. A sparse BriLLM lists its real edges (CSR buffers `graph_indptr`,
`graph_indices`); every other pair u->v is served by the one shared edge, so all such targets of u get the same output
and mostly the same energy: real edges are ranked apart, and a tie on the shared edge is one row with its count."""

from __future__ import annotations

import math
import os

import torch

SHARED_ROWS = 3  # distinct shared-edge energies listed per node (each row one tie)
EXAMPLES = 6  # targets named per shared-edge row


def rounded(x: float, digits: int = 6) -> float | None:
    """Six significant digits keep a 2,000-step page small; non-finite values become null (JSON has no NaN)."""
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def successors(model):
    """u -> the (V,) mask of u's real successors, read from the model's CSR edge list; None for a dense graph."""
    base, V = getattr(model, "base_model", model), int(model.config.vocab_size)
    if getattr(model.config, "graph", "sparse") != "sparse" or not hasattr(base, "graph_indptr"):
        return None
    indptr, indices = base.graph_indptr.detach().long().cpu(), base.graph_indices.detach().long().cpu()

    def mask(u: int) -> torch.Tensor:
        out = torch.zeros(V, dtype=torch.bool)
        out[indices[int(indptr[u]):int(indptr[u + 1])]] = True
        return out

    return mask


def _new_positions(paths: list[list[int]]) -> list[int]:
    """For each path, the first position no earlier path has read: a later path that starts with an earlier one's
    tokens (a continuation holds its prompt) sends the same signal over them, so those visits count once."""
    return [max([len(os.path.commonprefix([path, earlier])) for earlier in paths[:j]], default=0)
            for j, path in enumerate(paths)]


@torch.no_grad()
def _visit_means(model, paths: list[list[int]]):
    """(nodes, visits, means): every node the signal sits on in `paths`, its visits and the mean (N, V) energies."""
    V = int(model.config.vocab_size)
    device = getattr(model, "device", torch.device("cpu"))
    nodes, rows = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, V)]
    for path, start in zip(paths, _new_positions(paths)):
        if start < len(path):
            ids = torch.as_tensor(path, dtype=torch.long)
            nodes.append(ids[start:])
            rows.append(model(ids.unsqueeze(0).to(device), use_cache=False).logits[0, start:].float().cpu())
    nodes, where = torch.unique(torch.cat(nodes), return_inverse=True)
    counts = torch.bincount(where, minlength=len(nodes))
    means = torch.zeros(len(nodes), V).index_add_(0, where, torch.cat(rows)) / counts.clamp_min(1).unsqueeze(1)
    return nodes, counts, means


@torch.no_grad()
def _start_means(model, nodes: list[int], bos_token_id) -> torch.Tensor:
    """(N, V): the energies after the path <BOS> u for each u (u alone, the start signal, without a BOS)."""
    if not nodes:
        return torch.zeros(0, int(model.config.vocab_size))
    starts = torch.tensor([[bos_token_id, u] if bos_token_id is not None else [u] for u in nodes])
    return model(starts.to(getattr(model, "device", "cpu")), use_cache=False).logits[:, -1].float().cpu()


def _shared_rows(row: torch.Tensor, real: torch.Tensor) -> list:
    """[energy, targets tied at it, its rank, a few of them] for the strongest energies the shared edge delivers."""
    ids = (~real).nonzero().squeeze(1)
    values = row[ids]
    out = []
    for e in torch.unique(values, sorted=True).flip(0)[:SHARED_ROWS]:
        tied = ids[values == e]
        out.append([rounded(e), int(len(tied)), 1 + int((row > e).sum()), tied[:EXAMPLES].tolist()])
    return out


def _hood(row: torch.Tensor, u: int, visits: int, graph, top_k: int, after: str) -> dict:
    real = graph(u) if graph else torch.ones(len(row), dtype=torch.bool)
    ids = real.nonzero().squeeze(1)
    top = torch.topk(row[ids], min(top_k, len(ids)))
    ranks = 1 + (row.unsqueeze(0) > top.values.unsqueeze(1)).sum(1)
    edges = [[int(ids[i]), rounded(e), int(r)] for i, e, r in zip(top.indices, top.values, ranks)]
    measure = f"mean over {visits} visit{'s' if visits != 1 else ''} in the text(s)" if visits else after
    return {"real": edges, "shared": _shared_rows(row, real) if graph else [], "count": visits,
            "measure": measure, "degree": len(ids)}


def neighbourhoods(model, paths: list[list[int]], extra_nodes=(), top_k: int = 10, bos_token_id=None,
                   follow: int = 0) -> dict:
    """{u: {"real": [[v, energy, rank among all V], ...] (the `top_k` strongest), "shared": [[energy, ties, rank,
    [v, ...]], ...], "count": visits, "measure", "degree"}} for every node the `paths` visit (energies averaged over
    its visits, a repeated prefix counted once), every one of `extra_nodes` and up to `follow` more that those tables
    lead to (energies after the path <BOS> u)."""
    V = int(model.config.vocab_size)
    extra = list(dict.fromkeys(int(u) for u in extra_nodes))
    for u in extra:
        if not 0 <= u < V:
            raise ValueError(f"node {u} is outside the vocabulary [0, {V}) of this model.")
    graph, k = successors(model), max(1, min(int(top_k), V))
    after = "after the path <BOS> u" if bos_token_id is not None else "from the start signal"
    nodes, counts, means = _visit_means(model, [list(p) for p in paths if len(p)])
    out = {u: _hood(means[r], u, int(counts[r]), graph, k, after) for r, u in enumerate(nodes.tolist())}
    extra = [u for u in extra if u not in out]
    for u, row in zip(extra, _start_means(model, extra, bos_token_id)):
        out[u] = _hood(row, u, 0, graph, k, after)
    leads = [v for h in list(out.values()) for v in [e[0] for e in h["real"]] + [x for s in h["shared"] for x in s[3]]]
    leads = [v for v in dict.fromkeys(leads) if v not in out][:max(0, int(follow))]
    for u, row in zip(leads, _start_means(model, leads, bos_token_id)):
        out[u] = _hood(row, u, 0, graph, k, after)
    return out
