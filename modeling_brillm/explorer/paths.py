"""The page's record of a path: a traced text (`energy_trace`) or a generated continuation (`energy_generate`), with
the characters its tokens make together and the signal's mix weights."""

from __future__ import annotations

import codecs
import math

import torch

from .edges import Successors
from .text import TokenText, char_groups, decode, label, pending, prose


def rounded(x: float, digits: int = 6) -> float | None:
    """Six significant digits keep a 2,000-step page small; non-finite values become null (JSON has no NaN)."""
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def _positions(model) -> torch.Tensor:
    return getattr(model, "base_model", model).positions.detach().float().reshape(-1).cpu()


def mix_weights(model, position: int) -> torch.Tensor:
    """Weights of the signal's mix at `position` (the signal x_i leaving token i): (i,) float32, entry k-1 the weight
    softmax_k(p_k) of the edge entering token k (k = 1..i); empty at position 0, where the signal is the start signal.
    Past the trained positions every edge uses the last weight logit, as the model does."""
    logits = _positions(model)
    index = torch.arange(position).clamp_max(len(logits) - 1)
    return torch.softmax(logits[index], 0)


def position_logits(model) -> list[float]:
    return [rounded(p) for p in _positions(model).tolist()]


def _text_parts(tokens: list[int], texts: TokenText) -> tuple[dict, list[bytes]]:
    """The path's character groups ([first, last, label, prose]) and the bytes each position leaves unfinished."""
    pieces = [texts.bytes(t) for t in tokens]
    groups = []
    for first, last in char_groups(pieces):
        joined = decode(b"".join(pieces[first:last + 1]))
        groups.append([first, last, label(joined), prose(joined)])
    return groups, pending(pieces)


def _after(waiting: bytes, data: bytes | None) -> str:
    """What a token's bytes make after the unfinished bytes of a character: the character(s) it completes, that the
    character goes on (still unfinished), or that those bytes cannot follow."""
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


def _in_context(waiting: bytes, candidates, texts: TokenText) -> dict:
    """What each candidate token would make after the unfinished bytes `waiting` of the path's last character."""
    if not waiting:
        return {}
    return {str(int(t)): _after(waiting, texts.bytes(t)) for t in candidates}


def trace_path(trace, texts: TokenText) -> dict:
    tokens = trace.tokens.tolist()
    groups, waiting = _text_parts(tokens, texts)
    steps = []
    for s in trace.steps():
        record = {"i": s.position, "src": s.source, "tgt": s.target, "e": rounded(s.energy), "rank": s.rank,
                  "p": rounded(s.probability), "pred": s.predicted, "pe": rounded(s.predicted_energy),
                  "real": s.real_edge, "alts": [[t, rounded(e)] for t, e in s.alternatives]}
        context = _in_context(waiting[s.position], [s.target, s.predicted] + [t for t, _ in s.alternatives], texts)
        if context:
            record["ctx"] = context
        steps.append(record)
    summary = {k: rounded(v) for k, v in trace.summary().items()}
    return {"kind": "trace", "tokens": tokens, "prompt_length": 0, "steps": steps, "summary": summary,
            "groups": groups}


def generation_path(model, out, texts: TokenText) -> dict:
    steps = out.path(0)
    mask = out.attention_mask[0].bool().cpu() if out.attention_mask is not None else None
    prompt = out.sequences[0, :out.prompt_length].cpu()
    prompt = prompt[mask[:out.prompt_length]] if mask is not None else prompt
    tokens = prompt.tolist() + [s.token for s in steps]
    groups, waiting = _text_parts(tokens, texts)
    real = Successors(model).real([s.source for s in steps], [s.token for s in steps])
    records = []
    for s, r in zip(steps, real):
        record = {"i": s.position - 1, "src": s.source, "tgt": s.token, "e": rounded(s.energy), "rank": s.rank,
                  "p": rounded(s.probability), "real": r, "alts": [[t, rounded(e)] for t, e in s.alternatives]}
        context = _in_context(waiting[s.position - 1], [s.token] + [t for t, _ in s.alternatives], texts)
        if context:
            record["ctx"] = context
        records.append(record)
    return {"kind": "generation", "tokens": tokens, "prompt_length": len(prompt), "steps": records,
            "groups": groups}
