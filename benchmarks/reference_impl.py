"""A straightforward per-candidate implementation of the spec's training math, the baseline of the benchmarks.

Like the released BriLLM0.5 code, it walks the positions of a batch one by one and, at every position, loops in
Python over the candidate targets (all V nodes for the exact objective; the true target and K negatives for the
sampled one), computing each candidate's energy ‖GeLU(x·W[u→v] + b[u→v] + PE)‖ with its own small tensor ops;
autograd differentiates the whole thing and `torch.optim.AdamW` steps the dense parameters. It is batched over
the sequences of the batch (one op per candidate covers all B sequences), which is more generous to it than a
loop over sequences too. Nothing here is used by the package; it exists to measure the speed-up.
"""

import torch
import torch.nn.functional as F


class PerCandidateReference:
    """Owns a copy of a model's four parameters and trains them with the per-candidate loop."""

    def __init__(self, model, lr=1e-3):
        self.cfg = model.config
        self.model = model  # only for edge_rows / graph lookups and the PE table
        self.params = {
            name: getattr(model.base_model, name).detach().clone().requires_grad_()
            for name in ("node_bias", "weights", "biases", "positions")
        }
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr)

    def _pe(self, positions):
        from modeling_brillm import positional_encoding

        return positional_encoding(positions, self.cfg.node_size, self.cfg.position_encoding)

    def candidates(self, sources, targets):
        """(B, C) candidate nodes per position, true target first for the sampled objective."""
        V = self.cfg.vocab_size
        B = sources.shape[0]
        if self.cfg.loss_type == "exact":
            return torch.arange(V).expand(B, V)
        K = self.cfg.num_negatives
        if self.cfg.negative_sampling == "uniform":
            noise = torch.rand(B, V)
            noise.scatter_(1, targets[:, None], -1.0)
            negatives = noise.topk(K, dim=1).indices
        else:
            table = self.model.base_model.frequency_table(K + 1)[sources]  # (B, K+1), -1 = none left
            drop = table == targets[:, None]
            drop[:, -1] |= ~drop.any(1)
            negatives = table.gather(1, torch.argsort(drop.to(torch.int8), dim=1, stable=True)[:, :K])
            # fewer real successors than K: fill with non-successors (they all use the shared edge)
            fill = torch.rand(B, V)
            fill.scatter_(1, targets[:, None], -1.0)
            real = torch.zeros(B, V, dtype=torch.bool)
            real.scatter_(1, negatives.clamp_min(0), negatives >= 0)
            fill[real] = -1.0
            order = fill.topk(K, dim=1).indices
            missing = negatives < 0
            negatives = torch.where(missing, order.gather(1, (torch.cumsum(missing, 1) - 1).clamp_min(0)), negatives)
        return torch.cat([targets[:, None], negatives], 1)

    def loss(self, tokens):
        """Mean cross-entropy over all predicted positions of `tokens` (B, L), candidate by candidate."""
        p = self.params
        d = self.cfg.node_size
        B, L = tokens.shape
        pe = self._pe(torch.arange(L + 1))
        s0 = F.gelu(torch.ones(d) / d + p["node_bias"][tokens[:, 0], 0] + pe[0])
        outputs, losses = [], []
        for i in range(L - 1):
            if i == 0:
                x = s0
            else:
                a = torch.softmax(p["positions"][0, :i, 0], dim=0)
                x = sum(a[k] * outputs[k] for k in range(i))
            u, target = tokens[:, i], tokens[:, i + 1]
            cand = self.candidates(u, target)  # (B, C)
            rows = self.model.edge_rows(u[:, None].expand_as(cand), cand)
            w_rows = p["weights"][rows].unbind(1)  # C tensors (B, d, d)
            b_rows = p["biases"][rows, 0].unbind(1)
            energies = []
            for c in range(cand.shape[1]):  # every candidate on its own, as the release does
                y = F.gelu(torch.bmm(x.unsqueeze(1), w_rows[c]).squeeze(1) + b_rows[c] + pe[i + 1])
                energies.append(torch.linalg.vector_norm(y, dim=-1))
            logits = torch.stack(energies, 1)
            if self.cfg.loss_type == "exact":
                losses.append(F.cross_entropy(logits, target, reduction="none"))
            else:
                losses.append(torch.logsumexp(logits, 1) - logits[:, 0])
            true_row = self.model.edge_rows(u, target)
            outputs.append(F.gelu(torch.bmm(x.unsqueeze(1), p["weights"][true_row]).squeeze(1)
                                  + p["biases"][true_row, 0] + pe[i + 1]))
        return torch.stack(losses, 1).mean()

    def train_step(self, tokens):
        loss = self.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
