"""Low-rank edges (`config.edge_rank` = r > 0): W[u→v] = edge_base + A[u→v]·B[u→v]ᵀ with d×r factors, 2·d·r numbers an
edge instead of d². An edge kind (`modeling_brillm.EDGE_KINDS`): no kernel reads it in place; the model materialises
the rows a call reads and runs the same torch and Triton paths on them."""

import torch
from torch import nn
from transformers import initialization as init


class LowRankEdges:
    fused = False  # the paths read materialised rows (modeling_brillm.FullEdges: the tables in place)
    row_parameters = ("edge_a", "edge_b", "biases")
    uses = staticmethod(lambda config: bool(config.edge_rank))

    @staticmethod
    def create(model, config):
        P, d, r = config.num_edge_rows, config.node_size, config.edge_rank
        model.edge_a = nn.Parameter(torch.empty(P, d, r))
        model.edge_b = nn.Parameter(torch.empty(P, d, r))
        model.biases = nn.Parameter(torch.empty(P, 1, d))

    @staticmethod
    def init(model, scale: float):
        """Factors uniform in [−c, c] with c⁴ = 3·scale²/r: A·Bᵀ's entries have a full edge's variance, scale²/3."""
        bound = (3 * scale ** 2 / model.config.edge_rank) ** 0.25
        init.uniform_(model.edge_a, -bound, bound)
        init.uniform_(model.edge_b, -bound, bound)
        init.uniform_(model.biases, -scale, scale)

    @staticmethod
    def compose(a, b, biases):
        """The edges' own matrices A·Bᵀ (…, d, d) and their biases, from their rows of the row parameters."""
        return a @ b.transpose(-1, -2), biases
