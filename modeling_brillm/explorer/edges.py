"""A node's real outgoing edges, read from the graph a saved model stores, and its neighbourhood in the page.

A sparse BriLLM stores its edge list as CSR buffers (`graph_indptr` (V+1,), `graph_indices` (E,)); every pair u->v
not listed is served by the one shared edge, so after a given signal every such target of u gets the same shared
edge output and, unless a per-node term tells them apart, the same energy. The Node view therefore ranks a node's
real edges apart from the shared edge and shows a tie among shared targets as one row with its count.
"""

from __future__ import annotations

import torch

SHARED_ROWS = 3  # distinct shared-edge energies listed per node (each row one tie)
EXAMPLES = 6  # targets named per shared-edge row


class Successors:
    """The real successors of every node: `of(u)` the ids, `real(sources, targets)` a bool per pair, `degree(u)`."""

    def __init__(self, model):
        base = getattr(model, "base_model", model)
        self.vocab_size = int(model.config.vocab_size)
        self.dense = getattr(model.config, "graph", "sparse") != "sparse" or not hasattr(base, "graph_indptr")
        if not self.dense:
            self.indptr = base.graph_indptr.detach().long().cpu()
            self.indices = base.graph_indices.detach().long().cpu()

    def of(self, u: int) -> torch.Tensor:
        if self.dense:
            return torch.arange(self.vocab_size)
        return self.indices[int(self.indptr[u]):int(self.indptr[u + 1])]

    def degree(self, u: int) -> int:
        return self.vocab_size if self.dense else int(self.indptr[u + 1] - self.indptr[u])

    def mask(self, u: int) -> torch.Tensor:
        """(V,) True where u->v is a real edge."""
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[self.of(u)] = True
        return out

    def real(self, sources, targets) -> list[bool]:
        return [bool(self.dense or (self.of(int(u)) == int(v)).any()) for u, v in zip(sources, targets)]


def _new_positions(paths: list[list[int]]) -> list[int]:
    """For each path, the first position not already read by an earlier path: a later path that starts with an
    earlier one's tokens (a continuation holds its prompt) sends the same signal over that prefix, so those
    positions are the same visits and are counted once."""
    starts = []
    for j, path in enumerate(paths):
        shared = 0
        for earlier in paths[:j]:
            n = 0
            while n < min(len(path), len(earlier)) and path[n] == earlier[n]:
                n += 1
            shared = max(shared, n)
        starts.append(shared)
    return starts


@torch.no_grad()
def _visit_means(model, paths: list[list[int]]):
    """(nodes, counts, means): every node the signal sits on in `paths`, its number of visits (each position once)
    and the mean over them of the energies every node receives, (N, V)."""
    V = int(model.config.vocab_size)
    device = getattr(model, "device", torch.device("cpu"))
    nodes, rows = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, V)]
    for path, start in zip(paths, _new_positions(paths)):
        if start >= len(path):
            continue
        ids = torch.as_tensor(path, dtype=torch.long)
        logits = model(ids.unsqueeze(0).to(device), use_cache=False).logits[0].float().cpu()  # (T, V)
        nodes.append(ids[start:])
        rows.append(logits[start:])
    nodes, where = torch.unique(torch.cat(nodes), return_inverse=True)
    counts = torch.bincount(where, minlength=len(nodes))
    means = torch.zeros(len(nodes), V).index_add_(0, where, torch.cat(rows)) / counts.clamp_min(1).unsqueeze(1)
    return nodes, counts, means


@torch.no_grad()
def _start_means(model, nodes: list[int], bos_token_id) -> torch.Tensor:
    """(N, V): the energies after the path <BOS> u for each u (u alone, the start signal, without a BOS)."""
    if not nodes:
        return torch.zeros(0, int(model.config.vocab_size))
    device = getattr(model, "device", torch.device("cpu"))
    starts = torch.tensor([[bos_token_id, u] if bos_token_id is not None else [u] for u in nodes])
    return model(starts.to(device), use_cache=False).logits[:, -1].float().cpu()


def _round(x: float) -> float | None:
    x = float(x)
    return float(f"{x:.6g}") if x == x and abs(x) != float("inf") else None


def _rank(row: torch.Tensor, energy: torch.Tensor) -> int:
    return 1 + int((row > energy).sum())


def _shared_rows(row: torch.Tensor, real: torch.Tensor) -> list:
    """The strongest distinct energies among the targets u reaches only through the shared edge: [energy, how
    many targets tie at it, its rank among all V, a few of those targets]."""
    ids = (~real).nonzero().squeeze(1)
    if not len(ids):
        return []
    values = row[ids]
    top = torch.unique(values, sorted=True).flip(0)[:SHARED_ROWS]
    out = []
    for e in top:
        tied = ids[values == e]
        out.append([_round(e), int(len(tied)), _rank(row, e), tied[:EXAMPLES].tolist()])
    return out


def _hood(row: torch.Tensor, u: int, visits: int, graph: Successors, top_k: int, after: str) -> dict:
    real = graph.mask(u)
    ids = real.nonzero().squeeze(1)
    edges = []
    if len(ids):
        top = torch.topk(row[ids], min(top_k, len(ids)))
        ranks = 1 + (row.unsqueeze(0) > top.values.unsqueeze(1)).sum(1)
        edges = [[int(ids[i]), _round(e), int(r)] for i, e, r in zip(top.indices, top.values, ranks)]
    measure = f"mean over {visits} visit{'s' if visits != 1 else ''} in the text(s)" if visits else after
    return {"real": edges, "shared": [] if graph.dense else _shared_rows(row, real), "count": visits,
            "measure": measure, "degree": graph.degree(u)}


def neighbourhoods(model, paths: list[list[int]], extra_nodes=(), top_k: int = 10, bos_token_id=None,
                   follow: int = 0) -> dict:
    """Every node's strongest outgoing edges, real edges ranked apart from the shared edge.

    For each node u the token paths `paths` visit, the energies every node received, averaged over the positions
    where the signal sat on u (a position a later path repeats, such as a continuation's prompt, counts once);
    for each node of `extra_nodes`, and up to `follow` more nodes that those tables lead to, the energies after
    the path <BOS> u (u alone without a BOS). Returns {u: {"real": [[v, energy, rank], ...] (u's `top_k` strongest
    real edges, rank among all V nodes), "shared": [[energy, ties, rank, [v, ...]], ...] (the strongest energies
    the shared edge delivers, one row per tie), "count": visits, "measure": ..., "degree": real out-degree}}."""
    V = int(model.config.vocab_size)
    extra = list(dict.fromkeys(int(u) for u in extra_nodes))
    for u in extra:
        if not 0 <= u < V:
            raise ValueError(f"node {u} is outside the vocabulary [0, {V}) of this model.")
    graph, k = Successors(model), max(1, min(int(top_k), V))
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
