"""A literal, slow implementation of the released model's math (docs/model.md), written independently of
`modeling_brillm`.

It reads the four released tensors (`node_bias` (V,1,d), `weights` (P,d,d), `biases` (P,1,d), `positions`
(1,512,1)) and an edge-row map the way the release indexes its checkpoint, and computes the training forward
with a Python loop over positions and over every candidate node, as the release does.
"""

import torch
import torch.nn.functional as F


def released_edge_rows(vocab_size, zero_count_pairs=None):
    """Row of every pair (u, v), walking u then v: a pair listed with count 0 maps to row 0 (shared), every
    other pair gets the next row from 1 (the spec's "Edge indexing")."""
    zero = zero_count_pairs or set()
    rows, nxt = {}, 1
    for u in range(vocab_size):
        for v in range(vocab_size):
            if (u, v) in zero:
                rows[(u, v)] = 0
            else:
                rows[(u, v)] = nxt
                nxt += 1
    return rows, nxt


def spec_positional_encoding(num_positions, d, released=True):
    """The spec's steps, literally: freq = 10000.0 ** (int arange / int d) in float32, int64 positions times
    (textbook: divided by) freq, sin to the even and cos to the odd columns."""
    freq = 10000.0 ** (torch.arange(0, d, 2) / d)
    position = torch.arange(num_positions).reshape(-1, 1)
    angle = position * freq if released else position / freq
    pe = torch.zeros(num_positions, d)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)[:, : d // 2]
    return pe


def spec_forward(state, rows, tokens, released_pe=True):
    """Energies (T, V) of one sequence `tokens` (list of ids): row t = energies of every candidate after token t."""
    node_bias, weights, biases, positions = state["node_bias"], state["weights"], state["biases"], state["positions"]
    V, _, d = node_bias.shape
    pe = spec_positional_encoding(len(tokens) + 2, d, released_pe)
    s0 = F.gelu(torch.ones(d) / d + node_bias[tokens[0], 0] + pe[0])
    outputs = []  # c_k: output of the true edge k
    energies = torch.zeros(len(tokens), V)
    for i in range(len(tokens)):
        if i == 0:
            x = s0
        else:
            a = torch.softmax(positions[0, :i, 0], dim=0)
            x = sum(a[k] * outputs[k] for k in range(i))
        for v in range(V):  # every candidate, one at a time
            r = rows[(tokens[i], v)]
            y = F.gelu(x @ weights[r] + biases[r, 0] + pe[i + 1])
            energies[i, v] = torch.linalg.vector_norm(y)
        if i + 1 < len(tokens):
            r = rows[(tokens[i], tokens[i + 1])]
            outputs.append(F.gelu(x @ weights[r] + biases[r, 0] + pe[i + 1]))
    return energies


def spec_loss(state, rows, tokens):
    """Exact objective: mean cross-entropy of the true next token over all V nodes."""
    e = spec_forward(state, rows, tokens)
    return F.cross_entropy(e[:-1], torch.tensor(tokens[1:]))


def spec_sampled_loss(state, rows, tokens, negatives):
    """The release's objective: CE over [true, K negatives] per step; `negatives[i]` lists step i's negatives."""
    e = spec_forward(state, rows, tokens)
    losses = []
    for i in range(len(tokens) - 1):
        scores = torch.stack([e[i, tokens[i + 1]]] + [e[i, v] for v in negatives[i]])
        losses.append(torch.logsumexp(scores, 0) - scores[0])
    return torch.stack(losses).mean()
