"""The page's records: a path (traced or generated) with the characters its tokens make together, a node's edges."""

import codecs
import math
import os

import torch

from .text import TokenText, char_groups, label, prose, unfinished

SHARED_ROWS = 3  # distinct shared-edge energies listed per node (each row one tie)
EXAMPLES = 6  # targets named per shared-edge row


def rounded(x: float) -> float | None:
    """Six significant digits keep a 2,000-step page small; non-finite values become null (JSON has no NaN)."""
    return float(f"{float(x):.6g}") if math.isfinite(x) else None


def _positions(model) -> torch.Tensor:
    return getattr(model, "base_model", model).positions.detach().float().reshape(-1).cpu()


def mix_weights(model, position: int) -> torch.Tensor:
    """(i,) float32 weights of the signal's mix at position i, as the model mixes them (docs/explorer.md)."""
    logits = _positions(model)
    return torch.softmax(logits[torch.arange(position).clamp_max(len(logits) - 1)], 0)


def position_logits(model) -> list[float]:
    return [rounded(p) for p in _positions(model).tolist()]


def successors(model):
    """u -> the (V,) mask of u's real successors, read from the model's CSR edge list (all V in a dense graph)."""
    base, V = getattr(model, "base_model", model), int(model.config.vocab_size)
    if getattr(model.config, "graph", "sparse") != "sparse" or not hasattr(base, "graph_indptr"):
        return lambda u: torch.ones(V, dtype=torch.bool)
    indptr, indices = base.graph_indptr.tolist(), base.graph_indices.detach().long().cpu()
    return lambda u: torch.zeros(V, dtype=torch.bool).index_fill_(0, indices[indptr[u]:indptr[u + 1]], True)


def _after(waiting: bytes, data: bytes | None) -> str:
    """What a token's bytes make after a character's unfinished bytes: what it completes, "goes on", "cannot follow"."""
    if data is None:
        return "a special token"
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(waiting + data)
    except UnicodeDecodeError:
        return "cannot follow"
    if decoder.getstate()[0]:
        return (label(text) + " " if text else "") + "\u2026 goes on"
    return label(text)


def _path(kind: str, tokens: list[int], prompt_length: int, steps: list[tuple], texts: TokenText) -> dict:
    """A path's record: its steps, what each candidate makes inside a character ("ctx"), its character groups."""
    pieces = [texts.bytes(t) for t in tokens]
    waiting, records = list(unfinished(pieces)), []
    groups = [[first, last, label(joined), prose(joined)] for first, last in char_groups(pieces)
              for joined in [b"".join(pieces[first:last + 1]).decode("utf-8", errors="backslashreplace")]]
    for i, src, tgt, e, rank, p, real, alts, more in steps:
        records.append({"i": i, "src": src, "tgt": tgt, "e": rounded(e), "rank": rank, "p": rounded(p), **more,
                        "real": real, "alts": [[t, rounded(a)] for t, a in alts]})
        if waiting[i]:
            candidates = [tgt, more.get("pred", tgt)] + [t for t, _ in alts]
            records[-1]["ctx"] = {str(int(t)): _after(waiting[i], texts.bytes(t)) for t in candidates}
    return {"kind": kind, "tokens": tokens, "prompt_length": prompt_length, "steps": records, "groups": groups}


def trace_path(trace, texts: TokenText) -> dict:
    steps = [(s.position, s.source, s.target, s.energy, s.rank, s.probability, s.real_edge, s.alternatives,
              {"pred": s.predicted, "pe": rounded(s.predicted_energy)}) for s in trace.steps()]
    path = _path("trace", trace.tokens.tolist(), 0, steps, texts)
    return {**path, "summary": {k: rounded(v) for k, v in trace.summary().items()}}


def generation_path(model, out, texts: TokenText) -> dict:
    generated, T = out.path(0), out.prompt_length  # energy_generate's prompt rows are left-padded: drop the padding
    prompt = out.sequences[0, :T].cpu()[out.attention_mask[0, :T].bool().cpu()]
    real = successors(model)
    steps = [(s.position - 1, s.source, s.token, s.energy, s.rank, s.probability, bool(real(s.source)[s.token]),
              s.alternatives, {}) for s in generated]
    return _path("generation", prompt.tolist() + [s.token for s in generated], len(prompt), steps, texts)


@torch.no_grad()
def _visit_means(model, paths: list[list[int]]):
    """(nodes, visits, mean (N, V) energies) of every node the signal sits on; a prefix read before counts once."""
    V, device = int(model.config.vocab_size), getattr(model, "device", torch.device("cpu"))
    nodes, rows = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, V)]
    for j, path in enumerate(paths):
        start = max([len(os.path.commonprefix([path, earlier])) for earlier in paths[:j]], default=0)
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


def _hood(row: torch.Tensor, u: int, visits: int, graph, top_k: int, after: str) -> dict:
    """Node u's strongest real edges and the shared edge's strongest energies, [energy, ties, rank, a few ties]."""
    real = graph(u)
    ids, others = real.nonzero().squeeze(1), (~real).nonzero().squeeze(1)
    top = torch.topk(row[ids], min(top_k, len(ids)))
    ranks = 1 + (row.unsqueeze(0) > top.values.unsqueeze(1)).sum(1)
    shared, values = [], row[others]
    for e in torch.unique(values, sorted=True).flip(0)[:SHARED_ROWS]:
        tied = others[values == e]
        shared.append([rounded(e), int(len(tied)), 1 + int((row > e).sum()), tied[:EXAMPLES].tolist()])
    measure = f"mean over {visits} visit{'s' if visits != 1 else ''} in the text(s)" if visits else after
    return {"real": [[int(ids[i]), rounded(e), int(r)] for i, e, r in zip(top.indices, top.values, ranks)],
            "shared": shared, "count": visits, "measure": measure, "degree": len(ids)}


def neighbourhoods(model, paths: list[list[int]], extra_nodes=(), top_k: int = 10, bos_token_id=None,
                   follow: int = 0) -> dict:
    """{u: {"real": [[v, energy, rank among all V], ...], "shared": [[energy, ties, rank, [v, ...]], ...], "count",
    "measure", "degree"}} of the nodes `paths` visit, `extra_nodes` and up to `follow` that those tables lead to."""
    V, extra = int(model.config.vocab_size), list(dict.fromkeys(int(u) for u in extra_nodes))
    if bad := [u for u in extra if not 0 <= u < V]:
        raise ValueError(f"node {bad[0]} is outside the vocabulary [0, {V}) of this model.")
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
