"""Look inside a BriLLM: `energy_trace` records the energy each step of a text's path delivers to the true next
node (rank, probability, the model's pick, the runner-ups), `plot_energy_path` draws it (docs/explorer.md)."""

import math
import os
from dataclasses import dataclass, field, fields

import torch

from .decoding import PathStep, path_fields, token_text


@dataclass
class TraceStep(PathStep):
    """Edge `position` → `position + 1` of the text: from node `source` to the true next node `target`."""

    position: int
    source: int
    target: int
    energy: float  # energy delivered to `target` (its logit)
    rank: int  # 1 + number of nodes receiving strictly more energy (1 = strongest of all V)
    probability: float  # softmax over all V energies
    predicted: int  # node receiving the most energy
    predicted_energy: float
    real_edge: bool  # source→target is a real edge (False: the shared edge of a sparse graph)
    alternatives: list[tuple[int, float]]  # strongest nodes other than `target`, strongest first
    source_text: str | None = None
    target_text: str | None = None
    predicted_text: str | None = None
    alternative_texts: list[str] | None = None


@dataclass
class EnergyTrace:
    """The energy trace of one sequence of T tokens (T − 1 steps). Tensors are on the CPU."""

    tokens: torch.LongTensor  # (T,) the path
    energies: torch.FloatTensor  # (T-1,) energy delivered to the true next node
    ranks: torch.LongTensor  # (T-1,) its rank among all V nodes (1 = strongest)
    probabilities: torch.FloatTensor  # (T-1,) its probability (softmax over all V energies)
    predicted: torch.LongTensor  # (T-1,) most energetic node
    predicted_energies: torch.FloatTensor  # (T-1,)
    real_edges: torch.BoolTensor  # (T-1,) the edge to the true next node is real (not the shared edge)
    alternative_tokens: torch.LongTensor  # (T-1, k) strongest nodes other than the true next one
    alternative_energies: torch.FloatTensor  # (T-1, k)
    vocab_size: int
    token_texts: list[str] | None = None  # text of every token of the path, when a tokenizer was given
    alternative_texts: list[list[str]] | None = None
    predicted_texts: list[str] | None = None
    text: str | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.energies.numel()

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood of the path's next tokens (nats per token; NaN without steps, as the rest)."""
        return float(-self.probabilities.double().clamp_min(1e-300).log().mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def accuracy(self) -> float:
        """Share of steps where the true next node received the most energy (rank 1)."""
        return float((self.ranks == 1).float().mean())

    def steps(self) -> list[TraceStep]:
        out = []
        for t in range(len(self)):
            step = TraceStep(t, int(self.tokens[t]), int(self.tokens[t + 1]), float(self.energies[t]),
                             int(self.ranks[t]), float(self.probabilities[t]), int(self.predicted[t]),
                             float(self.predicted_energies[t]), bool(self.real_edges[t]),
                             list(zip(self.alternative_tokens[t].tolist(), self.alternative_energies[t].tolist())))
            if self.token_texts is not None:
                step.source_text, step.target_text = self.token_texts[t], self.token_texts[t + 1]
                step.predicted_text = self.predicted_texts[t] if self.predicted_texts else None
                step.alternative_texts = self.alternative_texts[t] if self.alternative_texts else None
            out.append(step)
        return out

    def to_records(self) -> list[dict]:
        """JSON-ready list of per-step dicts."""
        return [s.to_record() for s in self.steps()]

    def to_dict(self) -> dict:
        """The trace as a dict of tensors (and token texts when known)."""
        texts = ("token_texts", "alternative_texts", "predicted_texts") if self.token_texts is None else ()
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("text", *texts)}

    def summary(self) -> dict:
        return {"tokens": int(self.tokens.numel()), "steps": len(self), "perplexity": self.perplexity, "nll": self.nll,
                "top1_accuracy": self.accuracy, "mean_rank": float(self.ranks.float().mean())}


def _trace_ids(config, text_or_ids, tokenizer) -> torch.Tensor:
    """The sequence as (T,) CPU ids, checked: at least two tokens, in the vocabulary, within the positions."""
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("a text needs its tokenizer: energy_trace(model, text, tokenizer=tokenizer).")
        ids = torch.tensor(tokenizer(text_or_ids)["input_ids"], dtype=torch.long)
    else:
        ids = torch.as_tensor(text_or_ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got dtype {ids.dtype}.")
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"energy_trace reads one sequence; got a batch of {ids.shape[0]} (loop over rows).")
        ids = ids[0] if ids.dim() == 2 else ids
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D (or (1, T)), got shape {tuple(ids.shape)}.")
        ids = ids.long().cpu()  # the trace is built on the CPU whatever device the ids (or the model) are on
    V, M = int(config.vocab_size), config.max_position_embeddings
    if ids.numel() < 2:
        raise ValueError(f"the sequence holds {ids.numel()} token(s); a trace needs at least two (one edge of the "
                         "path).")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= V:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {V}) of this model.")
    if ids.numel() > M and getattr(config, "position_overflow", "error") != "extend":
        raise ValueError(f"the sequence holds {ids.numel()} tokens, more than max_position_embeddings={M}; trace a "
                         'shorter text (or split it into blocks), or set model.config.position_overflow="extend" to '
                         "read past the trained range.")
    return ids


@torch.no_grad()
def energy_trace(model, text_or_ids, tokenizer=None, top_k: int = 5) -> EnergyTrace:
    """Energy trace of one sequence: a string (needs `tokenizer`; its BOS is prepended when the tokenizer adds one),
    or token ids (list of ints, 1-D tensor, or a (1, T) tensor); at least two tokens. `top_k` alternatives per step:
    the strongest nodes other than the true next one."""
    ids = _trace_ids(model.config, text_or_ids, tokenizer)
    V = int(model.config.vocab_size)
    device = getattr(model, "device", torch.device("cpu"))
    logits = model(ids.unsqueeze(0).to(device), use_cache=False).logits[0, :-1].float().cpu()  # (T-1, V)
    path = path_fields(logits, torch.softmax(logits, dim=-1), ids[:-1], ids[1:], max(0, min(int(top_k), V - 1)))
    predicted_energy, predicted = logits.max(dim=1)
    if hasattr(model, "edge_rows"):
        real = (model.edge_rows(ids[:-1].to(device), ids[1:].to(device)) != 0).cpu()
    else:
        real = torch.ones(len(ids) - 1, dtype=torch.bool)
    alternatives = path["alternative_tokens"]
    trace = EnergyTrace(ids, path["energies"], path["ranks"], path["probabilities"], predicted, predicted_energy, real,
                        alternatives, path["alternative_energies"], V,
                        text=text_or_ids if isinstance(text_or_ids, str) else None)
    if tokenizer is not None:
        trace.token_texts = [token_text(tokenizer, i) for i in ids.tolist()]
        texts = {i: token_text(tokenizer, i) for i in {*alternatives.flatten().tolist(), *predicted.tolist()}}
        trace.alternative_texts = [[texts[i] for i in row] for row in alternatives.tolist()]
        trace.predicted_texts = [texts[i] for i in predicted.tolist()]
    return trace


def _label(text: str | None, token: int) -> str:
    if text is None:
        return str(token)
    shown = text.replace("\n", "\\n")
    if shown.strip() == "":
        shown = (repr(shown)[1:-1] if shown else "''").replace(" ", "\u2423")  # visible space
    return shown if len(shown) <= 12 else shown[:11] + "\u2026"


def plot_energy_path(trace: EnergyTrace, path, top_k: int | None = 3, max_steps: int = 80):
    """Draw the signal's path: the text's tokens along the bottom row, each edge t→t+1 coloured by the energy it
    delivers and labelled with it and its rank; above every step the `top_k` strongest other nodes, fainter. The
    format follows `path`'s extension (.png, .svg, .pdf, ...); the first `max_steps` steps. Returns the path."""
    try:
        import matplotlib
        from matplotlib import cm, colors
        from matplotlib.figure import Figure
    except ImportError as error:  # optional dependency: keep it out of the module's import list
        raise ImportError("plot_energy_path needs matplotlib: pip install matplotlib") from error
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        raise ValueError(f"cannot tell the image format of {path!r}: give the file an extension such as .png or .svg.")
    n = min(len(trace), max_steps)
    if n == 0:
        raise ValueError("the trace has no steps to draw (it needs at least two tokens).")
    k = trace.alternative_tokens.shape[1]
    k = k if top_k is None else max(0, min(int(top_k), k))
    alt_e = trace.alternative_energies[:n, :k]
    finite = torch.cat([trace.energies[:n], alt_e.flatten()])
    finite = finite[torch.isfinite(finite)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    norm = colors.Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1.0)
    cmap = matplotlib.colormaps["viridis"]
    fig = Figure(figsize=(min(2.0 + 1.15 * (n + 1), 60.0), 2.2 + 0.9 * (k + 1)), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    for t in range(n):
        _draw_step(ax, trace, t, alt_e[t], norm, cmap)
    for t in range(n + 1):
        ax.scatter([t], [0], s=420, color="white", edgecolors="black", linewidths=1.2, zorder=4)
        ax.text(t, 0, _label(trace.token_texts[t] if trace.token_texts else None, int(trace.tokens[t])), ha="center",
                va="center", fontsize=8, fontweight="bold", zorder=5)
    _frame(ax, trace, n, k)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.025, pad=0.01).set_label(
        "logit (edge energy + node offsets)", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format=ext)
    return path


def _draw_step(ax, trace, t: int, alt_e, norm, cmap):
    """Step t: the path's edge t→t+1 with its energy and rank, and the alternatives' fainter edges and nodes."""
    e, rank = float(trace.energies[t]), int(trace.ranks[t])
    ax.annotate("", xy=(t + 1, 0), xytext=(t, 0),
                arrowprops=dict(arrowstyle="-|>", color=cmap(norm(e)), lw=0.6 + 3.4 * norm(e), shrinkA=14, shrinkB=14))
    ax.text(t + 0.5, -0.32, f"{e:.2f}\n#{rank}", ha="center", va="top", fontsize=7,
            color="black" if rank == 1 else "firebrick")
    for j, ae in enumerate(alt_e.tolist()):
        if not math.isfinite(ae):
            continue
        ax.annotate("", xy=(t + 1, j + 1), xytext=(t, 0),
                    arrowprops=dict(arrowstyle="-", color=cmap(norm(ae)), lw=0.4 + 1.6 * norm(ae), alpha=0.45,
                                    shrinkA=14, shrinkB=10))
        alt_text = trace.alternative_texts[t][j] if trace.alternative_texts else None
        ax.scatter([t + 1], [j + 1], s=260, color=cmap(norm(ae)), alpha=0.35, zorder=2, edgecolors="none")
        ax.text(t + 1, j + 1, _label(alt_text, int(trace.alternative_tokens[t, j])), ha="center", va="center",
                fontsize=7, zorder=3, alpha=0.8)


def _frame(ax, trace, n: int, k: int):
    """The axes, their labels and the title."""
    ax.set(xlim=(-0.7, n + 0.7), ylim=(-1.0, k + 0.7))
    ax.set_yticks(range(k + 1), ["path"] + [f"alt {j}" for j in range(1, k + 1)], fontsize=7)
    ax.set_xticks(range(n + 1), [str(t) for t in range(n + 1)], fontsize=6)
    ax.set_xlabel("position (edge labels: energy delivered to the true next node, #rank among all nodes)", fontsize=8)
    ax.spines[["top", "right", "left"]].set_visible(False)
    shown = f" (first {n} steps shown)" if n < len(trace) else ""
    ax.set_title(f"BriLLM energy path: {len(trace)} steps, perplexity {trace.perplexity:.2f}, top-1 "
                 f"{trace.accuracy:.0%}{shown}", fontsize=9)
