"""Look inside a BriLLM: the energy each step of a text's path delivers, and a picture of the path.

BriLLM reads a text as a path through its token graph: the signal sits on token t and every edge t→v delivers an
energy E_v (the L2 norm of the edge's output, which is also the logit); the model "predicts" the node receiving the
most energy. `energy_trace(model, text_or_ids)` records, for every position t of the text:

    the current node (token t), the true next node (token t+1), the energy its edge delivers, its rank among all V
    nodes (1 = the strongest), its probability (softmax over all V energies), the node the model would have picked
    (argmax), whether the edge t→t+1 is a real edge of the graph or the shared one, and the strongest other nodes
    with their energies.

The result is an `EnergyTrace`: tensors (`to_dict()`), a list of `TraceStep` dataclasses (`steps()`), or JSON-ready
records (`to_records()`). `plot_energy_path(trace, "path.png")` draws the signal's path with its energies (PNG, SVG
or PDF, chosen by the file extension; needs matplotlib, imported only there).

This module imports nothing beyond torch (the model is used duck-typed), so it may ship with saved models.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

__all__ = ["EnergyTrace", "TraceStep", "energy_trace", "plot_energy_path"]


@dataclass
class TraceStep:
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

    def to_record(self) -> dict:
        record = {
            "position": self.position, "source": self.source, "target": self.target, "energy": self.energy,
            "rank": self.rank, "probability": self.probability, "predicted": self.predicted,
            "predicted_energy": self.predicted_energy, "real_edge": self.real_edge,
            "alternatives": [{"token": t, "energy": e} for t, e in self.alternatives],
        }
        if self.source_text is not None:
            record.update(source_text=self.source_text, target_text=self.target_text,
                          predicted_text=self.predicted_text)
            for alt, text in zip(record["alternatives"], self.alternative_texts or []):
                alt["text"] = text
        return record


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
        """Mean negative log-likelihood of the path's next tokens (nats per token)."""
        if len(self) == 0:
            return float("nan")
        return float(-self.probabilities.double().clamp_min(1e-300).log().mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll) if len(self) else float("nan")

    @property
    def accuracy(self) -> float:
        """Share of steps where the true next node received the most energy (rank 1)."""
        return float((self.ranks == 1).float().mean()) if len(self) else float("nan")

    def steps(self) -> list[TraceStep]:
        out = []
        for t in range(len(self)):
            step = TraceStep(
                position=t, source=int(self.tokens[t]), target=int(self.tokens[t + 1]),
                energy=float(self.energies[t]), rank=int(self.ranks[t]), probability=float(self.probabilities[t]),
                predicted=int(self.predicted[t]), predicted_energy=float(self.predicted_energies[t]),
                real_edge=bool(self.real_edges[t]),
                alternatives=list(zip(self.alternative_tokens[t].tolist(), self.alternative_energies[t].tolist())),
            )
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
        d = {name: getattr(self, name) for name in (
            "tokens", "energies", "ranks", "probabilities", "predicted", "predicted_energies", "real_edges",
            "alternative_tokens", "alternative_energies")}
        d["vocab_size"] = self.vocab_size
        if self.token_texts is not None:
            d["token_texts"] = self.token_texts
            d["alternative_texts"] = self.alternative_texts
            d["predicted_texts"] = self.predicted_texts
        return d

    def summary(self) -> dict:
        return {"tokens": int(self.tokens.numel()), "steps": len(self), "perplexity": self.perplexity,
                "nll": self.nll, "top1_accuracy": self.accuracy,
                "mean_rank": float(self.ranks.float().mean()) if len(self) else float("nan")}


def _token_texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(i)], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]


@torch.no_grad()
def energy_trace(model, text_or_ids, tokenizer=None, top_k: int = 5, add_special_tokens: bool = True) -> EnergyTrace:
    """Energy trace of one sequence: a string (needs `tokenizer`; its BOS is prepended when the tokenizer adds one),
    or token ids (list of ints, 1-D tensor, or a (1, T) tensor). Needs at least two tokens (one edge).

    `top_k` alternatives per step: the strongest nodes other than the true next one.
    """
    config = model.config
    V = int(config.vocab_size)
    text = None
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("a text needs its tokenizer: energy_trace(model, text, tokenizer=tokenizer).")
        text = text_or_ids
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        ids = torch.tensor(ids, dtype=torch.long)
    else:
        ids = torch.as_tensor(text_or_ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got dtype {ids.dtype}.")
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"energy_trace reads one sequence; got a batch of {ids.shape[0]} (loop over rows).")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D (or (1, T)), got shape {tuple(ids.shape)}.")
        ids = ids.long().cpu()  # the trace is built on the CPU whatever device the ids (or the model) are on
    if ids.numel() < 2:
        raise ValueError(
            f"the sequence holds {ids.numel()} token(s); a trace needs at least two (one edge of the path)."
        )
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {V}) of this model.")
    if ids.numel() > config.max_position_embeddings and getattr(config, "position_overflow", "error") != "extend":
        raise ValueError(
            f"the sequence holds {ids.numel()} tokens, more than max_position_embeddings="
            f"{config.max_position_embeddings}; trace a shorter text (or split it into blocks), or set "
            'model.config.position_overflow="extend" to read past the trained range.'
        )
    device = getattr(model, "device", torch.device("cpu"))
    logits = model(ids.unsqueeze(0).to(device), use_cache=False).logits[0, :-1].float().cpu()  # (T-1, V)
    target = ids[1:]
    energy = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    ranks = 1 + (logits > energy.unsqueeze(1)).sum(1)
    probs = torch.softmax(logits, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
    predicted_energy, predicted = logits.max(dim=1)
    k = max(0, min(int(top_k), V - 1))
    others = logits.scatter(1, target.unsqueeze(1), float("-inf"))
    top = torch.topk(others, k, dim=1)
    if hasattr(model, "edge_rows"):
        real = (model.edge_rows(ids[:-1].to(device), target.to(device)) != 0).cpu()
    else:
        real = torch.ones_like(target, dtype=torch.bool)
    trace = EnergyTrace(
        tokens=ids, energies=energy, ranks=ranks, probabilities=probs, predicted=predicted,
        predicted_energies=predicted_energy, real_edges=real, alternative_tokens=top.indices,
        alternative_energies=top.values, vocab_size=V, text=text,
    )
    if tokenizer is not None:
        trace.token_texts = _token_texts(tokenizer, ids.tolist())
        vocab_texts = {}

        def text_of(i):
            if i not in vocab_texts:
                vocab_texts[i] = _token_texts(tokenizer, [i])[0]
            return vocab_texts[i]

        trace.alternative_texts = [[text_of(i) for i in row] for row in top.indices.tolist()]
        trace.predicted_texts = [text_of(i) for i in predicted.tolist()]
    return trace


def _label(text: str | None, token: int) -> str:
    if text is None:
        return str(token)
    shown = text.replace("\n", "\\n")
    if shown.strip() == "":
        shown = repr(shown)[1:-1] if shown else "''"
        shown = shown.replace(" ", "\u2423")  # visible space
    return shown if len(shown) <= 12 else shown[:11] + "\u2026"


def plot_energy_path(trace: EnergyTrace, path, top_k: int | None = 3, title: str | None = None,
                     max_steps: int = 80, dpi: int = 120):
    """Draw the signal's path through the graph: the text's tokens along the bottom row, each edge t→t+1 coloured
    by the energy it delivers and labelled with that energy and its rank; above every step, the `top_k` strongest
    other nodes with thinner, fainter edges. The format follows `path`'s extension (.png, .svg, .pdf, ...); long
    traces are cut to their first `max_steps` steps. Returns the path written."""
    try:
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
    k = (trace.alternative_tokens.shape[1] if top_k is None
         else max(0, min(int(top_k), trace.alternative_tokens.shape[1])))
    alt_e = trace.alternative_energies[:n, :k]
    finite = torch.cat([trace.energies[:n], alt_e.flatten()])
    finite = finite[torch.isfinite(finite)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    norm = colors.Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1.0)
    cmap = cm.get_cmap("viridis") if hasattr(cm, "get_cmap") else __import__("matplotlib").colormaps["viridis"]
    fig = Figure(figsize=(min(2.0 + 1.15 * (n + 1), 60.0), 2.2 + 0.9 * (k + 1)), dpi=dpi)
    ax = fig.add_subplot(1, 1, 1)
    for t in range(n):
        _draw_step(ax, trace, t, alt_e[t], norm, cmap)
    for t in range(n + 1):
        token = int(trace.tokens[t])
        ax.scatter([t], [0], s=420, color="white", edgecolors="black", linewidths=1.2, zorder=4)
        ax.text(t, 0, _label(trace.token_texts[t] if trace.token_texts else None, token), ha="center", va="center",
                fontsize=8, fontweight="bold", zorder=5)
    _frame(ax, trace, n, k, title)
    mappable = cm.ScalarMappable(norm=norm, cmap=cmap)
    mappable.set_array([])
    fig.colorbar(mappable, ax=ax, fraction=0.025, pad=0.01).set_label("logit (edge energy + node offsets)", fontsize=8)
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


def _frame(ax, trace, n: int, k: int, title):
    """The axes, their labels and the title."""
    ax.set_xlim(-0.7, n + 0.7)
    ax.set_ylim(-1.0, k + 0.7)
    ax.set_yticks([0] + list(range(1, k + 1)))
    ax.set_yticklabels(["path"] + [f"alt {j}" for j in range(1, k + 1)], fontsize=7)
    ax.set_xticks(range(n + 1))
    ax.set_xticklabels([str(t) for t in range(n + 1)], fontsize=6)
    ax.set_xlabel("position (edge labels: energy delivered to the true next node, #rank among all nodes)", fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    summary = trace.summary()
    ax.set_title(title or (f"BriLLM energy path: {summary['steps']} steps, perplexity {summary['perplexity']:.2f}, "
                           f"top-1 {summary['top1_accuracy']:.0%}"
                           + (f" (first {n} steps shown)" if n < len(trace) else "")), fontsize=9)
