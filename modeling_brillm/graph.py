"""Building and growing BriLLM graphs: count the bigrams of token-id sequences, build the sparse graph and its count
prior, add nodes for added tokens and real edges for new bigrams (docs/training.md, "Growing the graph"). Tools of
the package: a saved model's code carries only what reading a graph needs (csr.py); the models' methods
(`from_token_sequences`, `add_edges`, `resize_token_embeddings`) call these."""

from collections.abc import Iterable

import torch
from torch import nn

from .count_prior import DISCOUNT, CountPrior
from .csr import BigramGraph, check_csr, edge_keys, edge_row, edge_rows_from_keys  # noqa: F401  (public here too)
from .graph_editing import NODE_ROWS


def _sequence_chunks(sequences: Iterable, chunk_tokens: int):
    """The sequences of two tokens or more as long tensors, in lists of about `chunk_tokens` tokens."""
    chunk, tokens = [], 0
    for seq in sequences:
        seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if seq.numel() < 2:
            continue  # no bigram, and (as before) never checked
        chunk.append(seq)
        tokens += seq.numel()
        if tokens >= chunk_tokens:
            yield chunk
            chunk, tokens = [], 0
    if chunk:
        yield chunk


def count_bigrams(sequences: Iterable, vocab_size: int, ignore_ids: Iterable[int] = (),
                  chunk_tokens: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """Count every bigram u→v of the token-id sequences (`ignore_ids`, padding say, never form one); returns sorted
    keys u·V+v and their counts. Counted per chunk of sequences and merged, so memory follows the distinct bigrams."""
    ignore = torch.tensor(sorted(set(int(i) for i in ignore_ids)), dtype=torch.long)
    keys, counts = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    for chunk in _sequence_chunks(sequences, chunk_tokens):
        flat = torch.cat(chunk)
        low, high = torch.aminmax(flat)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"token id out of range: sequences must hold ids in [0, {vocab_size}), found "
                             f"{int(low)}..{int(high)}. Use the tokenizer the graph is built for.")
        keep = torch.ones(flat.numel() - 1, dtype=torch.bool)
        ends = torch.tensor([seq.numel() for seq in chunk[:-1]], dtype=torch.long).cumsum(0) - 1
        keep[ends] = False  # a sequence's last token → the next one's first
        if ignore.numel():
            ignored = torch.isin(flat, ignore)
            keep &= ~(ignored[:-1] | ignored[1:])
        new_keys, new_counts = torch.unique((flat[:-1] * vocab_size + flat[1:])[keep], return_counts=True)
        keys, inverse = torch.unique(torch.cat([keys, new_keys]), return_inverse=True)
        counts = torch.zeros(keys.numel(), dtype=torch.long).index_add_(0, inverse, torch.cat([counts, new_counts]))
    return keys, counts


def _bigrams_seen(sequences, vocab_size: int, min_count: int, ignore_ids):
    """`count_bigrams`' keys and counts, and which of them were seen at least `min_count` times."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}.")
    keys, counts = count_bigrams(sequences, vocab_size, ignore_ids)
    return keys, counts, counts >= min_count


def build_sparse_graph(sequences: Iterable, vocab_size: int, min_count: int = 1, ignore_ids: Iterable[int] = (),
                       with_prior: bool = False) -> BigramGraph:
    """The sparse graph of the bigrams seen `min_count` times or more, with the count prior of all when `with_prior`."""
    all_keys, all_counts, keep = _bigrams_seen(sequences, vocab_size, min_count, ignore_ids)
    keys, counts = all_keys[keep], all_counts[keep]
    if keys.numel() == 0:
        seen = f"{min_count} times or more" if min_count > 1 else "at all"
        raise ValueError(f"no bigram was seen {seen}: the training sequences need at least two tokens each (or lower "
                         "min_count).")
    graph = graph_from_edges(keys // vocab_size, keys % vocab_size, vocab_size, counts)
    if with_prior:
        graph.prior = count_prior(all_keys, all_counts, vocab_size)
    return graph


def graph_from_edges(sources, targets, vocab_size: int, counts=None) -> BigramGraph:
    """CSR graph from edge lists (any order, no duplicates)."""
    sources, targets = (torch.as_tensor(t, dtype=torch.long) for t in (sources, targets))
    counts = torch.zeros_like(sources) if counts is None else torch.as_tensor(counts, dtype=torch.long)
    keys, order = torch.sort(sources * vocab_size + targets)
    if keys.numel() > 1 and bool((keys[1:] == keys[:-1]).any()):
        raise ValueError("duplicate edges: each pair u→v may be listed once.")
    indptr = torch.cat([sources.new_zeros(1), torch.bincount(sources, minlength=vocab_size).cumsum(0)])
    return BigramGraph(indptr=indptr, indices=targets[order], counts=counts[order])


def merge_edges(graph: BigramGraph, sources, targets, counts=None) -> tuple[BigramGraph, torch.Tensor, torch.Tensor]:
    """`graph` plus the new edges source→target (none real yet, no duplicates: the caller checks), and where its old
    edges and the new ones land in the merged CSR order (edge-table rows minus one), to lay edge tables out alike."""
    V, E, device = graph.vocab_size, graph.num_edges, graph.indptr.device
    sources, targets = (torch.as_tensor(t, dtype=torch.long, device=device) for t in (sources, targets))
    counts = torch.zeros_like(sources) if counts is None else torch.as_tensor(counts, dtype=torch.long, device=device)
    old_sources = torch.repeat_interleave(torch.arange(V, device=device), graph.indptr.diff())
    keys = torch.cat([old_sources * V + graph.indices, sources * V + targets])
    order = torch.argsort(keys, stable=True)
    position = torch.argsort(order)  # merged index of every concatenated edge (the inverse permutation)
    degree = torch.bincount(torch.cat([old_sources, sources]), minlength=V)
    merged = BigramGraph(indptr=torch.cat([degree.new_zeros(1), degree.cumsum(0)]), indices=keys[order] % V,
                         counts=torch.cat([graph.counts, counts])[order])
    return merged, position[:E], position[E:]


def count_prior(keys: torch.Tensor, counts: torch.Tensor, vocab_size: int, discount: float = DISCOUNT) -> CountPrior:
    """The count prior of the bigrams with sorted keys u·V + v and their counts (`graph.count_bigrams`)."""
    if not 0 < discount <= 1:
        raise ValueError(f"discount must be in (0, 1], got {discount!r}.")
    V = vocab_size
    keys, counts = keys.long(), counts.double()
    sources, targets = keys // V, keys % V
    unigram = (torch.bincount(targets, counts, minlength=V) + 1) / (counts.sum() + V)
    source_total = torch.bincount(sources, counts, minlength=V)
    degree = torch.bincount(sources, minlength=V)  # seen successors of every source: λ's numerator and the CSR's rows
    backoff = discount * degree.double() / source_total.clamp_min(1)  # λ(u), > 0 for every seen source
    total, weight = source_total[sources], backoff[sources]
    probability = (counts - discount).clamp_min(0) / total + weight * unigram[targets]
    values = probability.log() - weight.log() - unigram[targets].log()
    indptr = torch.cat([degree.new_zeros(1), degree.cumsum(0)])
    return CountPrior(unigram.log().float(), indptr, targets, values.float())


def _replace_parameter(model, name: str, value: torch.Tensor):
    setattr(model, name, nn.Parameter(value, requires_grad=getattr(model, name).requires_grad))


def _check_new_size(new_num_tokens, pad_to_multiple_of, V: int) -> int:
    if not isinstance(new_num_tokens, int) or isinstance(new_num_tokens, bool):
        raise TypeError(f"new_num_tokens must be an int (the tokenizer's len()), got {type(new_num_tokens).__name__}.")
    if pad_to_multiple_of is not None:
        if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}.")
        new_num_tokens = -(-new_num_tokens // pad_to_multiple_of) * pad_to_multiple_of
    if new_num_tokens < V:
        raise ValueError(f"resize_token_embeddings({new_num_tokens}) would drop nodes {new_num_tokens}..{V - 1} of "
                         f"this {V}-node graph with their edges; BriLLM can only add nodes. Pass at least {V} "
                         "(len(tokenizer) of the tokenizer the model was trained with, plus any added tokens).")
    return new_num_tokens


def _grow_dense_edges(model, V: int, new_V: int):
    """Re-lay the V² edge rows (row 1 + u·V + v) for the new V; new pairs start like a fresh model's edges."""
    r = model.config.initializer_range
    for name in ("weights", "biases"):
        old = getattr(model, name)
        shape = old.shape[1:]
        rows = old.new_empty(1 + new_V ** 2, *shape).uniform_(-r, r)
        rows[0] = old[0]
        rows[1:].view(new_V, new_V, *shape)[:V, :V] = old[1:].view(V, V, *shape)
        _replace_parameter(model, name, rows)
    model.config.num_edges = new_V ** 2


def resize_nodes(model, new_num_tokens, pad_to_multiple_of=None, mean_resizing: bool = True):
    """`model.resize_token_embeddings` (docs/training.md, "Growing the graph"); in a dense graph a new node's pairs are
    real edges, initialised like a fresh model's. `mean_resizing`: the new nodes' rows start at the old nodes' mean,
    else as a fresh model's (start biases) or zero (offsets, readouts, vectors)."""
    V = model.config.vocab_size
    if new_num_tokens is None:
        return
    new_V = _check_new_size(new_num_tokens, pad_to_multiple_of, V)
    if new_V == V:
        return
    d, r = model.config.node_size, model.config.initializer_range
    with torch.no_grad():
        fill = (model.node_bias.mean(0, keepdim=True).expand(new_V - V, 1, d) if mean_resizing
                else model.node_bias.new_empty(new_V - V, 1, d).uniform_(-r, r))
        bias = torch.cat([model.node_bias, fill])
        if model.config.graph == "dense":
            _grow_dense_edges(model, V, new_V)
        else:  # new nodes have no real successors yet: their CSR rows are empty
            model.graph_indptr = torch.cat([model.graph_indptr, model.graph_indptr[-1:].expand(new_V - V)])
        _replace_parameter(model, "node_bias", bias)
        if model.config.count_prior:  # a new token was never seen: the smallest unigram, and no seen successor
            model.prior_node = torch.cat([model.prior_node, model.prior_node.min().expand(new_V - V)])
            model.prior_indptr = torch.cat([model.prior_indptr, model.prior_indptr[-1:].expand(new_V - V)])
        for name in NODE_ROWS:  # a new node's offset and readout: the old nodes' mean (or zero, a plain node)
            rows = getattr(model, name)
            if rows is not None:
                fill = rows.mean(0, keepdim=True) if mean_resizing else rows.new_zeros(1, *rows.shape[1:])
                _replace_parameter(model, name, torch.cat([rows, fill.expand(new_V - V, *rows.shape[1:])]))
    model.config.vocab_size = new_V
    model.reset_caches()


def _as_pairs(pairs, device) -> torch.Tensor:
    """(N, 2) long tensor of (source, target) pairs from a tensor or a list of pairs."""
    if isinstance(pairs, torch.Tensor):
        pairs = pairs.detach().to(device=device)
    else:
        pairs = list(pairs)
        if any(not hasattr(p, "__len__") or len(p) != 2 for p in pairs):
            raise ValueError("add_edges: pairs must be (source, target) node-id pairs, e.g. [(5, 7), (7, 9)].")
        pairs = torch.tensor(pairs, device=device).reshape(-1, 2) if pairs else torch.zeros(0, 2, dtype=torch.long)
    if pairs.is_floating_point() or pairs.dtype == torch.bool:
        raise TypeError(f"add_edges: pairs must hold integer node ids, got dtype {pairs.dtype}.")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"add_edges: pairs must have shape (N, 2) (source, target), got {tuple(pairs.shape)}.")
    return pairs.long()


def _check_new_pairs(model, pairs: torch.Tensor):
    """Every pair names existing nodes, once, and is not a real edge yet."""
    V = model.config.vocab_size
    outside = (pairs < 0) | (pairs >= V)
    if bool(outside.any()):
        u, v = pairs[int(outside.any(1).nonzero()[0])].tolist()
        raise ValueError(f"add_edges: pair ({u}, {v}) names a node outside [0, {V}) of this graph; add the node first "
                         "(tokenizer.add_tokens([...]); model.resize_token_embeddings(len(tokenizer))).")
    unique_keys, counts_of_key = torch.unique(pairs[:, 0] * V + pairs[:, 1], return_counts=True)
    if bool((counts_of_key > 1).any()):
        key = int(unique_keys[counts_of_key > 1][0])
        raise ValueError(f"add_edges: pair ({key // V}, {key % V}) is listed more than once; list each pair once.")
    real = model.edge_rows(pairs[:, 0], pairs[:, 1]) > 0
    if bool(real.any()):
        shown = ", ".join(f"({u}, {v})" for u, v in pairs[real][:5].tolist())
        raise ValueError(f"add_edges: {int(real.sum())} pair(s) already are real edges: {shown}"
                         f"{' ...' if int(real.sum()) > 5 else ''}. Drop them, or use add_edges_from_sequences, which "
                         "skips them.")


def add_edges(model, pairs, counts=None) -> torch.Tensor:
    """`model.add_edges`; `counts` (N,): the new edges' bigram counts (the sampled loss's frequency negatives read
    them). Returns the edge-table rows of the new edges, in the order of `pairs`."""
    if model.config.graph != "sparse":
        raise ValueError("add_edges: this graph is dense, so every pair u→v already is a real edge; there is "
                         "nothing to add (only a sparse graph has non-edges).")
    device = model.graph_indices.device
    pairs = _as_pairs(pairs, device)
    if pairs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    _check_new_pairs(model, pairs)
    if counts is not None:
        counts = torch.as_tensor(counts, dtype=torch.long, device=device).reshape(-1)
        if counts.numel() != pairs.shape[0]:
            raise ValueError(f"add_edges: counts has {counts.numel()} entries for {pairs.shape[0]} pairs.")
    graph, old_at, new_at = merge_edges(model.get_graph(), pairs[:, 0], pairs[:, 1], counts)
    E, N = model.config.num_edges, pairs.shape[0]
    with torch.no_grad():
        for name in ("weights", "biases"):
            old = getattr(model, name)
            rows = old.new_empty(1 + E + N, *old.shape[1:])
            rows[0], rows[1 + old_at], rows[1 + new_at] = old[0], old[1:], old[0]  # new edges: the shared edge's
            _replace_parameter(model, name, rows)
        model.graph_indptr, model.graph_indices, model.graph_counts = graph.indptr, graph.indices, graph.counts
    model.config.num_edges = E + N
    model.reset_caches()
    return 1 + new_at


def add_edges_from_sequences(model, sequences, min_count: int = 1, ignore_ids=()) -> torch.Tensor:
    """Make real every bigram of `sequences` seen `min_count` times that is not real yet (with its count)."""
    V = model.config.vocab_size
    keys, counts, keep = _bigrams_seen(sequences, V, min_count, ignore_ids)
    keys, counts = keys[keep].to(model.graph_indices.device), counts[keep].to(model.graph_indices.device)
    if model.config.graph == "sparse" and keys.numel():
        fresh = model.edge_rows(keys // V, keys % V) == 0
        keys, counts = keys[fresh], counts[fresh]
    return add_edges(model, torch.stack([keys // V, keys % V], 1), counts)


# ------------------------------------------------------------------------------------- models on graphs
def from_graph(cls, graph: BigramGraph | None, config=None, **config_kwargs):
    """A freshly initialised model on `graph` (a sparse `BigramGraph`, or None for a dense graph)."""
    if graph is not None and not isinstance(graph, BigramGraph):
        raise TypeError(f"from_graph: graph must be a BigramGraph (or None for a dense graph), got "
                        f"{type(graph).__name__}; build one with modeling_brillm.build_sparse_graph.")
    if config is not None and config_kwargs:
        raise ValueError(f"from_graph: pass either config or config fields, not both (got config and "
                         f"{sorted(config_kwargs)}); set the fields on the config instead.")
    if graph is None and config is not None and config.graph == "sparse":
        raise ValueError("from_graph: a sparse config needs its graph (the BigramGraph of its num_edges real "
                         "edges); pass it, or use a config with graph='dense'.")
    if config is None and graph is None:
        config = cls.config_class(graph="dense", **config_kwargs)
    elif config is None:
        if config_kwargs.get("count_prior") and graph.prior is not None:
            config_kwargs["count_prior_bigrams"] = graph.prior.num_bigrams
        config = cls.config_class(vocab_size=graph.vocab_size, graph="sparse", num_edges=graph.num_edges,
                                  **config_kwargs)
    model = cls(config)
    if graph is not None:
        model.set_graph(graph)
    return model


def from_token_sequences(cls, sequences, vocab_size: int, min_count: int = 1, dense: bool = False,
                         ignore_ids=(), **config_kwargs):
    """A fresh model on the bigrams seen `min_count` times (or dense); `count_prior=True`: the prior of all of them."""
    if dense:
        return from_graph(cls, None, vocab_size=vocab_size, **config_kwargs)
    graph = build_sparse_graph(sequences, vocab_size, min_count=min_count, ignore_ids=ignore_ids,
                               with_prior=bool(config_kwargs.get("count_prior")))
    return from_graph(cls, graph, **config_kwargs)


def set_graph(model, graph: BigramGraph):
    """Store a sparse graph's edge list (its size must be the config's)."""
    if model.config.graph != "sparse":
        raise ValueError("set_graph needs a sparse config; a dense graph has every edge.")
    if graph.vocab_size != model.config.vocab_size or graph.num_edges != model.config.num_edges:
        raise ValueError(f"graph has V={graph.vocab_size}, E={graph.num_edges} but the config says "
                         f"V={model.config.vocab_size}, num_edges={model.config.num_edges}.")
    if problem := check_csr(graph.indptr, graph.indices, graph.vocab_size):
        raise ValueError(f"malformed graph: {problem}.")
    with torch.no_grad():
        for name in ("indptr", "indices", "counts"):
            getattr(model.base_model, f"graph_{name}").copy_(getattr(graph, name))
    if model.config.count_prior:
        if graph.prior is None:
            raise ValueError("this config has count_prior=True but the graph carries no count prior: build it "
                             "with build_sparse_graph(..., with_prior=True), or pass count_prior=False.")
        set_count_prior(model, graph.prior)


def set_count_prior(model, prior: CountPrior):
    """Store the count prior (`count_prior.py`); its size must be the config's `count_prior_bigrams`."""
    V, K = model.config.vocab_size, model.config.count_prior_bigrams
    if not model.config.count_prior:
        raise ValueError("set_count_prior needs a config with count_prior=True (the model has no prior buffers).")
    if prior.node.numel() != V or prior.num_bigrams != K:
        raise ValueError(f"the count prior has V={prior.node.numel()}, {prior.num_bigrams} bigrams but the "
                         f"config says V={V}, count_prior_bigrams={K}.")
    if problem := check_csr(prior.indptr, prior.indices, V, "prior"):
        raise ValueError(f"malformed count prior: {problem}.")
    with torch.no_grad():
        for name in ("node", "indptr", "indices", "values"):
            getattr(model.base_model, f"prior_{name}").copy_(getattr(prior, name))


__all__ = ["BigramGraph", "add_edges", "add_edges_from_sequences", "build_sparse_graph", "check_csr", "count_bigrams",
           "count_prior", "edge_keys", "edge_row", "edge_rows_from_keys", "from_graph", "from_token_sequences",
           "graph_from_edges", "merge_edges", "resize_nodes", "set_count_prior", "set_graph"]
