"""An interactive, self-contained view of BriLLM's energy paths: one HTML page, no server, no network.

`explore(model, text, tokenizer)` traces `text` (`interpretability.energy_trace`); with `prompt=` it also generates a
continuation (`decoding.energy_generate`). The result, an `Explorer`, holds the page's data (`.data`, JSON-ready),
writes the page (`.save("path.html")`, `.to_html()`) and shows itself in a notebook cell (`_repr_html_`: the page in
a sandboxed iframe, so `IPython.display.display(explorer)` or a cell ending in it works; IPython is not imported).

The page has three views:
  * Text: every step of the path (the node the signal sits on, the true next token, the energy its edge delivers,
    its rank among all V nodes, the strongest alternatives) and the signal's mix: the weight softmax_k(p_k) of
    every earlier edge in x_i = sum_k softmax_k(p_k) c_k (`mix_weights`), computed in the page from the model's
    position weight logits p. Hovering a step shows it; clicking pins it. Long texts are paged.
  * Generation: the generated continuation's energy path and runner-ups.
  * Node: a node's neighbourhood: its strongest outgoing edges by the mean energy each edge u->v delivered over the
    steps where the signal sat on u in the page's texts (`neighbourhoods`), or, for a node the texts never visit,
    for the signal of the two-token path <BOS> u.

Every token text is shown through `label` (visible whitespace and control characters) and inserted as text, never
as markup; the data is embedded as JSON with '<', '>' and '&' escaped, so no token can end the script that holds it.
"""

from __future__ import annotations

import html
import json
import math
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decoding import energy_generate
from .interpretability import energy_trace

__all__ = ["Explorer", "explore", "label", "load_model", "mix_weights", "neighbourhoods"]

_HERE = Path(__file__).resolve().parent
_WHITESPACE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}


def label(text: str | None, token: int | None = None) -> str:
    """A token's text as the page shows it: every control or format character visible (newline ↵, tab ⇥, other
    C0 controls as their control pictures, the rest as \\uXXXX), spaces visible when the token is only whitespace,
    "∅" for an empty text and "#id" when no tokenizer gave a text."""
    if text is None:
        return f"#{token}"
    if text == "":
        return "\u2205"
    blank = text.isspace()
    out = []
    for ch in text:
        if ch in _WHITESPACE and (blank or ch != " "):
            out.append(_WHITESPACE[ch])
        elif ord(ch) < 0x20:
            out.append(chr(0x2400 + ord(ch)))
        elif ch == "\x7f":
            out.append("\u2421")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):  # bidi overrides, zero widths, ...
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def _round(x: float, digits: int = 6) -> float | None:
    """Six significant digits keep a 2,000-step page small; non-finite values become null (JSON has no NaN)."""
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def _base(model):
    return getattr(model, "base_model", model)


def mix_weights(model, position: int) -> torch.Tensor:
    """Weights of the signal's mix at `position` (the signal x_i leaving token i): (i,) float32, entry k-1 the weight
    softmax_k(p_k) of the edge entering token k (k = 1..i); empty at position 0, where the signal is the start signal.
    Past the trained positions every edge uses the last weight logit, as the model does."""
    index = torch.arange(1, position + 1)
    logits = _base(model).mix_weights(index.to(_base(model).positions.device)).detach().cpu()
    return torch.softmax(logits, 0) if position > 0 else logits


def _position_logits(model) -> list[float]:
    return [_round(p) for p in _base(model).positions.detach().float().reshape(-1).cpu().tolist()]


def _texts(tokenizer, ids) -> dict[int, str]:
    ids = sorted({int(i) for i in ids if int(i) >= 0})
    if tokenizer is None:
        return {i: label(None, i) for i in ids}
    return {i: label(tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False))
            for i in ids}


def _real_edges(model, sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if not hasattr(model, "edge_rows"):
        return torch.ones_like(targets, dtype=torch.bool)
    return (model.edge_rows(sources, targets) != 0).cpu()


def _trace_path(trace) -> dict:
    steps = []
    for s in trace.steps():
        steps.append({"i": s.position, "src": s.source, "tgt": s.target, "e": _round(s.energy), "rank": s.rank,
                      "p": _round(s.probability), "pred": s.predicted, "pe": _round(s.predicted_energy),
                      "real": s.real_edge, "alts": [[t, _round(e)] for t, e in s.alternatives]})
    summary = {k: _round(v) for k, v in trace.summary().items()}
    return {"kind": "trace", "tokens": trace.tokens.tolist(), "prompt_length": 0, "steps": steps, "summary": summary}


def _generation_path(model, out) -> dict:
    steps = out.path(0)
    mask = out.attention_mask[0].bool().cpu() if out.attention_mask is not None else None
    prompt = out.sequences[0, :out.prompt_length].cpu()
    prompt = prompt[mask[:out.prompt_length]] if mask is not None else prompt
    tokens = prompt.tolist() + [s.token for s in steps]
    real = _real_edges(model, torch.tensor([s.source for s in steps], dtype=torch.long),
                       torch.tensor([s.token for s in steps], dtype=torch.long)) if steps else []
    records = [{"i": s.position - 1, "src": s.source, "tgt": s.token, "e": _round(s.energy), "rank": s.rank,
                "p": _round(s.probability), "real": bool(r), "alts": [[t, _round(e)] for t, e in s.alternatives]}
               for s, r in zip(steps, real)]
    return {"kind": "generation", "tokens": tokens, "prompt_length": len(prompt), "steps": records}


@torch.no_grad()
def neighbourhoods(model, paths: list[list[int]], extra_nodes=(), top_k: int = 10, bos_token_id=None) -> dict:
    """Every node's strongest outgoing edges: for each node u visited by the token paths `paths`, the mean over
    the positions where the signal sat on u of the energy every edge u->v delivered, its `top_k` strongest edges;
    for each node of `extra_nodes`, the energies after the path <BOS> u (u alone when there is no BOS).
    Returns {u: {"edges": [[v, energy, real], ...], "count": visits, "measure": ..., "degree": real out-degree}}."""
    V = int(model.config.vocab_size)
    k = max(1, min(int(top_k), V))
    device = getattr(model, "device", torch.device("cpu"))
    nodes, sums = torch.zeros(0, dtype=torch.long), torch.zeros(0, V)
    for path in (p for p in paths if len(p)):
        ids = torch.as_tensor(path, dtype=torch.long)
        logits = model(ids.unsqueeze(0).to(device), use_cache=False).logits[0].float().cpu()  # (T, V)
        nodes, sums = torch.cat([nodes, ids]), torch.cat([sums, logits])
    nodes, where = torch.unique(nodes, return_inverse=True)
    counts = torch.bincount(where, minlength=len(nodes))
    means = torch.zeros(len(nodes), V).index_add_(0, where, sums) / counts.clamp_min(1).unsqueeze(1)
    visited = set(nodes.tolist())
    extra = list(dict.fromkeys(int(u) for u in extra_nodes if int(u) not in visited))
    for u in extra:
        if not 0 <= u < V:
            raise ValueError(f"node {u} is outside the vocabulary [0, {V}) of this model.")
    if extra:  # one batch: <BOS> u per row, or u alone (the start signal) without a BOS
        starts = torch.tensor([[bos_token_id, u] if bos_token_id is not None else [u] for u in extra])
        means = torch.cat([means, model(starts.to(device), use_cache=False).logits[:, -1].float().cpu()])
        nodes, counts = torch.cat([nodes, torch.tensor(extra)]), torch.cat([counts, torch.zeros(len(extra))])
    top = torch.topk(means, k, dim=1)
    real = _real_edges(model, nodes.repeat_interleave(k), top.indices.reshape(-1)).view(-1, k)
    degree = _out_degrees(model)
    after = "after the path <BOS> u" if bos_token_id is not None else "from the start signal"
    out = {}
    for row, u in enumerate(nodes.tolist()):
        n = int(counts[row])
        out[u] = {"edges": [[v, _round(e), r] for v, e, r in zip(top.indices[row].tolist(), top.values[row].tolist(),
                                                                 real[row].tolist())],
                  "count": n, "measure": f"mean over {n} step{'s' if n != 1 else ''} in the text(s)" if n else after,
                  "degree": None if degree is None else int(degree[u])}
    return out


def _out_degrees(model) -> torch.Tensor | None:
    if not hasattr(model, "csr"):
        return None
    indptr, indices = model.csr()
    return (indptr[1:] - indptr[:-1]).cpu()


@dataclass
class Explorer:
    """The page's data (`data`, JSON-ready) and its renderings: `to_html()`, `save(path)`, `_repr_html_()`."""

    data: dict = field(default_factory=dict)
    height: int = 720  # the notebook iframe's height in pixels

    @classmethod
    def error(cls, message: str, title: str = "BriLLM explorer") -> Explorer:
        """A page that shows `message` in place of the views (bad input, a model that would not load, ...)."""
        return cls({"title": title, "error": str(message)})

    def to_html(self) -> str:
        payload = json.dumps(self.data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        style = (_HERE / "explorer.css").read_text(encoding="utf-8")
        script = (_HERE / "explorer.js").read_text(encoding="utf-8")
        title = html.escape(str(self.data.get("title", "BriLLM explorer")))
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                f"<style>\n{style}</style></head>\n<body>\n<div id=\"app\"></div>\n"
                f'<script type="application/json" id="brillm-data">{payload}</script>\n'
                f"<script>\n{script}</script>\n</body></html>\n")

    def save(self, path) -> str:
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())
        return path

    def iframe(self, height: int | None = None) -> str:
        """The page inside a sandboxed iframe (scripts run, nothing else is allowed): for notebooks and Gradio."""
        return (f'<iframe class="brillm-explorer" sandbox="allow-scripts" style="width:100%;height:'
                f'{int(height or self.height)}px;border:1px solid #ddd;border-radius:6px" '
                f'srcdoc="{html.escape(self.to_html(), quote=True)}"></iframe>')

    def _repr_html_(self) -> str:
        return self.iframe()


def _check_text(text, what: str):
    if isinstance(text, str) and text == "":
        raise ValueError(f"the {what} is empty: give at least one token of text.")


def explore(model, text=None, tokenizer=None, *, prompt=None, max_new_tokens: int = 20, top_k: int = 5,
            neighbours: int = 10, nodes=(), title: str | None = None, **generate_kwargs) -> Explorer:
    """The explorer page of `text` (a string with `tokenizer`, or token ids) and, with `prompt` (a string or ids),
    of the continuation `energy_generate` writes after it (`max_new_tokens`, greedy unless `generate_kwargs` say
    otherwise). `top_k` alternatives per step; `neighbours` edges per node; `nodes` (ids, or token strings with a
    tokenizer) are added to the Node view. Raises ValueError with a one-line message on bad input."""
    if text is None and prompt is None:
        raise ValueError("nothing to show: give a text to trace, a prompt to continue, or both.")
    if getattr(model.config, "model_type", None) != "brillm":
        raise ValueError(f"this is a {getattr(model.config, 'model_type', type(model).__name__)!r} model, not a "
                         "BriLLM: the explorer reads BriLLM's energies.")
    paths = []
    if text is not None:
        _check_text(text, "text")
        paths.append(_trace_path(energy_trace(model, text, tokenizer, top_k=top_k)))
    if prompt is not None:
        ids = _prompt_ids(prompt, tokenizer)
        out = energy_generate(model, ids, max_new_tokens=max_new_tokens, num_alternatives=top_k,
                              tokenizer=tokenizer, **generate_kwargs)
        paths.append(_generation_path(model, out))
    extra = [_node_id(n, tokenizer) for n in nodes]
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else model.config.bos_token_id
    hoods = neighbourhoods(model, [p["tokens"] for p in paths], extra, neighbours, bos)
    used = {t for p in paths for t in p["tokens"]} | set(hoods)
    used |= {a for p in paths for s in p["steps"] for a in [s.get("pred", s["tgt"])] + [x[0] for x in s["alts"]]}
    used |= {v for h in hoods.values() for v, _, _ in h["edges"]}
    config = model.config
    data = {
        "title": title or "BriLLM explorer",
        "model": {"name": str(getattr(config, "_name_or_path", "") or "BriLLM"), "vocab_size": int(config.vocab_size),
                  "max_positions": int(config.max_position_embeddings), "graph": str(config.graph),
                  "extend": getattr(config, "position_overflow", "error") == "extend"},
        "labels": {str(i): t for i, t in _texts(tokenizer, used).items()},
        "positions": _position_logits(model),
        "paths": paths,
        "nodes": {str(u): h for u, h in hoods.items()},
        "focus": extra[0] if extra else None,
    }
    return Explorer(data)


def _prompt_ids(prompt, tokenizer) -> torch.Tensor:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs its tokenizer: explore(model, tokenizer=tokenizer, prompt=...).")
        ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer adds no BOS token: give at least one token.")
        return torch.tensor([ids], dtype=torch.long)
    ids = torch.as_tensor(prompt, dtype=torch.long)
    return ids.reshape(1, -1)


def _node_id(node, tokenizer) -> int:
    if isinstance(node, str):
        if tokenizer is None:
            raise ValueError(f"the node {node!r} is a token text: pass the tokenizer, or give its id.")
        token = tokenizer.convert_tokens_to_ids(node)
        if token is None or (token == tokenizer.unk_token_id and node != tokenizer.unk_token):
            ids = tokenizer(node, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"{node!r} is not one token of this tokenizer (it reads as {len(ids)} tokens); "
                                 "give a single token or its id.")
            token = ids[0]
        if token == tokenizer.unk_token_id and node != tokenizer.unk_token:
            raise ValueError(f"{node!r} is not in the vocabulary of this tokenizer: give one of its tokens or an id.")
        return int(token)
    return int(node)


def load_model(name_or_path: str, extend: bool = False):
    """(model, tokenizer) of a saved BriLLM folder or Hub id, in eval mode; with `extend` the model reads past its
    trained positions. Raises ValueError with a one-line message when it is not a BriLLM model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path).strip()
    if not name:
        raise ValueError("no model given: name a saved BriLLM folder or a Hub id.")
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{name!r} is not a BriLLM model folder or Hub id ({first})") from None
    if getattr(config, "model_type", None) != "brillm":
        raise ValueError(f"{name!r} holds a {config.model_type!r} model, not a BriLLM: give a folder saved by "
                         "BriLLM's save_pretrained.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name).eval()
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0]
        raise ValueError(f"cannot load the BriLLM model {name!r}: {first}") from None
    if extend:
        model.config.position_overflow = "extend"
        tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
    return model, tokenizer
