"""The page's record of a path: a traced text (`energy_trace`) or a generated continuation (`energy_generate`), with
the characters its tokens make together and the signal's mix weights."""

from __future__ import annotations

import codecs

import torch

from .edges import rounded, successors
from .text import TokenText, char_groups, decode, label, pending, prose


def _positions(model) -> torch.Tensor:
    return getattr(model, "base_model", model).positions.detach().float().reshape(-1).cpu()


def mix_weights(model, position: int) -> torch.Tensor:
    """Weights of the signal's mix at `position` (the signal x_i leaving token i): (i,) float32, entry k-1 the weight
    softmax_k(p_k) of the edge entering token k (k = 1..i); empty at position 0, where the signal is the start signal.
    Past the trained positions every edge uses the last weight logit, as the model does."""
    logits = _positions(model)
    return torch.softmax(logits[torch.arange(position).clamp_max(len(logits) - 1)], 0)


def position_logits(model) -> list[float]:
    return [rounded(p) for p in _positions(model).tolist()]


def _after(waiting: bytes, data: bytes | None) -> str:
    """What a token's bytes make after a character's unfinished bytes: what it completes, "goes on", "cannot follow"."""
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


def _path(kind: str, tokens: list[int], prompt_length: int, steps: list[tuple], texts: TokenText) -> dict:
    """The path's record: its `steps` (i, source, target, energy, rank, probability, real, alternatives, more), each
    with what its candidates make after a character left unfinished ("ctx"), and its character groups."""
    pieces = [texts.bytes(t) for t in tokens]
    waiting = pending(pieces)
    groups = [[first, last, label(joined), prose(joined)] for first, last in char_groups(pieces)
              for joined in [decode(b"".join(pieces[first:last + 1]))]]
    records = []
    for i, src, tgt, e, rank, p, real, alts, more in steps:
        record = {"i": i, "src": src, "tgt": tgt, "e": rounded(e), "rank": rank, "p": rounded(p), **more,
                  "real": real, "alts": [[t, rounded(a)] for t, a in alts]}
        if waiting[i]:
            candidates = [tgt, more.get("pred", tgt)] + [t for t, _ in alts]
            record["ctx"] = {str(int(t)): _after(waiting[i], texts.bytes(t)) for t in candidates}
        records.append(record)
    return {"kind": kind, "tokens": tokens, "prompt_length": prompt_length, "steps": records, "groups": groups}


def trace_path(trace, texts: TokenText) -> dict:
    steps = [(s.position, s.source, s.target, s.energy, s.rank, s.probability, s.real_edge, s.alternatives,
              {"pred": s.predicted, "pe": rounded(s.predicted_energy)}) for s in trace.steps()]
    path = _path("trace", trace.tokens.tolist(), 0, steps, texts)
    return {**path, "summary": {k: rounded(v) for k, v in trace.summary().items()}}


def generation_path(model, out, texts: TokenText) -> dict:
    generated = out.path(0)
    prompt = out.sequences[0, :out.prompt_length].cpu()
    if out.attention_mask is not None:
        prompt = prompt[out.attention_mask[0, :out.prompt_length].bool().cpu()]
    real = successors(model)
    steps = [(s.position - 1, s.source, s.token, s.energy, s.rank, s.probability,
              real is None or bool(real(s.source)[s.token]), s.alternatives, {}) for s in generated]
    return _path("generation", prompt.tolist() + [s.token for s in generated], len(prompt), steps, texts)
