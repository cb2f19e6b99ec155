"""BriLLM, the definition: the model's equations in plain torch, one sequence, one step and one candidate at a time.

Every backend (the grouped torch path, the Triton kernels, the decode step) is tested against these functions; they
are the model, the rest is speed. A sequence u_0, u_1, ... is a path through the graph:

    e_0    = GeLU(s + node_bias[u_0] + PE_0)                        start:  s = 1/d (the release) or learned
    c_i    = GeLU(x_{i-1} · W[u_{i-1}→u_i] + b[u_{i-1}→u_i] + PE_i)  step:   the signal crosses the edge into u_i
    x_i    = Σ_{k≤i} softmax(p_1 … p_i)_k · c_k                      mix:    learned position weights p (x_0 = e_0)
    E_i(v) = ‖GeLU(x_i · W[u_i→v] + b[u_i→v] + PE_{i+1})‖₂           energy: every candidate v; the logits

A pair u→v that is not a real edge of a sparse graph uses edge row 0, the shared edge. The loss is the
cross-entropy of softmax(E). Each extension (`BriLLMConfig`) is a marked line; with every extension off this is the
authors' released model (their defects fixed as docs/model.md says). `model` is a `BriLLMModel` (or the
`BriLLMForCausalLM` around it), read, never changed; everything is computed in float32.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def positional_encoding(position: int, d: int, variant: str = "released") -> torch.Tensor:
    """PE_position (d,): sin to the even, cos to the odd neurons. The release multiplies by 10000^(2j/d) where the
    textbook ("sinusoidal") divides; computed in float32 with the release's own steps, which checkpoints need."""
    freq = 10000.0 ** (torch.arange(0, d, 2) / d)
    angle = torch.tensor(position) * freq if variant == "released" else torch.tensor(position) / freq
    pe = torch.empty(d)
    pe[0::2], pe[1::2] = torch.sin(angle), torch.cos(angle[: d // 2])
    return pe


def edge_row(m, u: int, v: int) -> int:
    """The edge table's row of u→v: 1 + u·V + v in a dense graph; in a sparse one, 1 + the real edge's place in the
    CSR (edges sorted by source, then target), or 0, the shared edge, when u→v is not real."""
    if m.config.graph == "dense":
        return 1 + u * m.config.vocab_size + v
    first, last = int(m.graph_indptr[u]), int(m.graph_indptr[u + 1])
    found = (m.graph_indices[first:last] == v).nonzero()
    return first + 1 + int(found[0]) if len(found) else 0


def edge(m, rows: torch.Tensor):
    """W (…, d, d) and b (…, d) of the edges in `rows`: each edge's own parameters, `weights[rows]` and
    `biases[rows]` (a variant's: `BriLLMModel.edge_parameters`, low-rank edges A·Bᵀ with config.edge_rank)."""
    W, b = m.edge_parameters(rows)
    if m.edge_base is not None:  # extension edge_backoff: every edge adds one shared matrix
        W = W + m.edge_base
    return W.float(), b[..., 0, :].float()


def pe(m, position: int) -> torch.Tensor:
    return positional_encoding(position, m.config.node_size, m.config.position_encoding)


@dataclass
class Signal:
    """Where a sequence stands: the node the signal sits on, its position, the signal x leaving it, and every edge
    output so far (the mix is recomputed from them at every step, as the equations write it)."""

    node: int
    position: int
    x: torch.Tensor
    outputs: list


def start(m, u0: int, signal_id: int = 0) -> Signal:
    """e_0, the signal the first node emits."""
    d = m.config.node_size
    s = torch.full((d,), 1.0 / d)
    if m.start_signals is not None:  # extension start_signal="learned": a trainable start per task
        s = m.start_signals[signal_id].float()
    return Signal(u0, 0, F.gelu(s + m.node_bias[u0, 0].float() + pe(m, 0)), [])


def step(m, signal: Signal, v: int, keep=None) -> Signal:
    """Cross the edge u→v: its output c joins the mix, x becomes the softmax(p)-weighted mean of every output."""
    x = signal.x if keep is None else signal.x * keep  # extension signal_dropout: the signal that enters the edge
    W, b = edge(m, torch.tensor(edge_row(m, signal.node, v)))
    c = F.gelu(x @ W + b + pe(m, signal.position + 1))
    if m.node_embedding is not None:  # extension node_embedding: the node adds its own vector to what it passes on
        c = c + m.node_embedding[v].float()
    outputs = signal.outputs + [c]
    M = m.config.max_position_embeddings  # past the trained range (position_overflow="extend"): the last weight
    p = m.positions.view(-1).float()[[min(k, M - 1) for k in range(len(outputs))]]
    mixed = (torch.softmax(p, 0).unsqueeze(1) * torch.stack(outputs)).sum(0)
    return Signal(v, signal.position + 1, mixed, outputs)


def logits(m, signal: Signal, keep=None) -> torch.Tensor:
    """(V,) the energy every node v receives from the node the signal sits on, E(v) = ‖GeLU(x·W[u→v] + b + PE)‖."""
    V, u = m.config.vocab_size, signal.node
    x = signal.x if keep is None else signal.x * keep  # extension signal_dropout
    rows = torch.tensor([edge_row(m, u, v) for v in range(V)])
    W, b = edge(m, rows)
    energy = torch.linalg.vector_norm(F.gelu(x @ W + b + pe(m, signal.position + 1)), dim=-1)
    if m.non_edge_bias is not None:  # extension non_edge_bias: a non-successor adds its own offset
        energy = energy + torch.where(rows == 0, m.non_edge_bias.float(), 0.0)
    if m.node_readout is not None:  # extension node_readout: every node also reads the signal directly
        energy = energy + m.node_readout.float() @ x
    if m.config.count_prior:  # extension count_prior: + log p(v | u) of the training text's bigram model
        energy = energy + m.prior_table()[u]
    return energy


def forward(model, tokens: list[int], signal_id: int = 0, keep=None) -> torch.Tensor:
    """(T, V) logits of one sequence: row t holds the energies after token t (they predict token t + 1). `keep`
    (T, d), optional: the signal dropout's mask, row t on the signal leaving token t."""
    m = model.base_model
    mask = (lambda t: None) if keep is None else (lambda t: keep[t])
    signal = start(m, tokens[0], signal_id)
    out = [logits(m, signal, mask(0))]
    for t, v in enumerate(tokens[1:], 1):
        signal = step(m, signal, v, mask(t - 1))
        out.append(logits(m, signal, mask(t)))
    return torch.stack(out)


def loss(model, tokens: list[int], signal_id: int = 0) -> torch.Tensor:
    """The exact objective: the mean cross-entropy of every next token over all V nodes."""
    return F.cross_entropy(forward(model, tokens, signal_id)[:-1], torch.tensor(tokens[1:]))


def sampled_loss(model, tokens: list[int], negatives: list[list[int]]) -> torch.Tensor:
    """The release's objective (loss_type="sampled"): the cross-entropy of each next token against its K negatives
    `negatives[t]` (the true token first)."""
    energy = forward(model, tokens)
    scores = [energy[t, [tokens[t + 1]] + list(negatives[t])] for t in range(len(tokens) - 1)]
    return torch.stack([torch.logsumexp(s, 0) - s[0] for s in scores]).mean()


def decode_step(model, signal: Signal, v: int) -> tuple[torch.Tensor, Signal]:
    """One decoding step: the signal moves to the chosen node v; (V,) logits of what follows v, and the new signal."""
    signal = step(model.base_model, signal, v)
    return logits(model.base_model, signal), signal
