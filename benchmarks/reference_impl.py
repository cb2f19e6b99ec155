"""A per-candidate implementation of the spec's training math, the baseline of train_throughput.py --reference.

As the released BriLLM0.5 code does, it walks a batch's positions one by one and, at each, loops in Python over the
candidate targets (all V nodes for the exact objective; the true target and K negatives for the sampled one), each
candidate's energy ‖GeLU(x·W[u→v] + b[u→v] + PE)‖ its own small ops; autograd differentiates it and
`torch.optim.AdamW` steps the dense parameters. It is batched over the sequences (one op per candidate covers all B),
which is more generous to it than the release. Nothing here is used by the package.
"""

import torch
import torch.nn.functional as F


class PerCandidateReference:
    """A copy of a model's four parameters, trained with the per-candidate loop."""

    def __init__(self, model, lr=1e-3):
        self.cfg, self.model = model.config, model  # the model: edge_rows, the frequency table, the PE
        self.params = {name: getattr(model.base_model, name).detach().clone().requires_grad_()
                       for name in ("node_bias", "weights", "biases", "positions")}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr)

    def candidates(self, sources, targets):
        """(B, C) candidate nodes per position, the true target first for the sampled objective."""
        V, B, K = self.cfg.vocab_size, sources.shape[0], self.cfg.num_negatives
        if self.cfg.loss_type == "exact":
            return torch.arange(V).expand(B, V)
        fill = torch.rand(B, V)  # uniform: the K largest; frequency: fills where a node has fewer than K successors
        fill.scatter_(1, targets[:, None], -1.0)
        if self.cfg.negative_sampling == "uniform":
            return torch.cat([targets[:, None], fill.topk(K, dim=1).indices], 1)
        table = self.model.base_model.frequency_table(K + 1)[sources]  # (B, K+1), -1 = none left
        drop = table == targets[:, None]
        drop[:, -1] |= ~drop.any(1)
        negatives = table.gather(1, torch.argsort(drop.to(torch.int8), dim=1, stable=True)[:, :K])
        real = torch.zeros(B, V, dtype=torch.bool)
        real.scatter_(1, negatives.clamp_min(0), negatives >= 0)
        fill[real] = -1.0
        order, missing = fill.topk(K, dim=1).indices, negatives < 0
        negatives = torch.where(missing, order.gather(1, (torch.cumsum(missing, 1) - 1).clamp_min(0)), negatives)
        return torch.cat([targets[:, None], negatives], 1)

    def loss(self, tokens):
        """Mean cross-entropy over the predicted positions of `tokens` (B, L), candidate by candidate."""
        from modeling_brillm import positional_encoding

        p, d, L = self.params, self.cfg.node_size, tokens.shape[1]
        pe = positional_encoding(torch.arange(L + 1), d, self.cfg.position_encoding)
        outputs, losses = [], []
        for i in range(L - 1):
            if i == 0:
                x = F.gelu(torch.ones(d) / d + p["node_bias"][tokens[:, 0], 0] + pe[0])
            else:
                a = torch.softmax(p["positions"][0, :i, 0], dim=0)
                x = sum(a[k] * outputs[k] for k in range(i))
            u, target = tokens[:, i], tokens[:, i + 1]
            cand = self.candidates(u, target)
            rows = self.model.edge_rows(u[:, None].expand_as(cand), cand)
            w_rows, b_rows = p["weights"][rows].unbind(1), p["biases"][rows, 0].unbind(1)  # C tensors (B, d, d), (B, d)
            logits = torch.stack([torch.linalg.vector_norm(F.gelu(torch.bmm(x.unsqueeze(1), w_rows[c]).squeeze(1)
                                                                  + b_rows[c] + pe[i + 1]), dim=-1)
                                  for c in range(cand.shape[1])], 1)  # every candidate on its own, as the release
            losses.append(F.cross_entropy(logits, target, reduction="none") if self.cfg.loss_type == "exact"
                          else torch.logsumexp(logits, 1) - logits[:, 0])
            true = self.model.edge_rows(u, target)
            outputs.append(F.gelu(torch.bmm(x.unsqueeze(1), p["weights"][true]).squeeze(1) + p["biases"][true, 0]
                                  + pe[i + 1]))
        return torch.stack(losses, 1).mean()

    def train_step(self, tokens):
        loss = self.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
