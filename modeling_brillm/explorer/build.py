"""The page of a text through one model (`explore`) or through two (`compare`): the checks on the input, the paths,
the nodes and every token's text, gathered into the `Explorer` that writes the page."""

from __future__ import annotations

import math

import torch

from .. import energy_generate, energy_trace
from .edges import neighbourhoods
from .loading import display_name, quiet
from .page import Explorer
from .paths import generation_path, position_logits, trace_path
from .text import TokenText, label, prose

FOLLOW = 400  # nodes the Node view's tables lead to whose own edges the page also holds (each one short forward)
CHANGED = 10  # steps listed in the diff view as those whose rank changed most
PYTHON_FIX = ('; load the model with load_model(name, extend=True), or set model.config.position_overflow = '
              '"extend", to read past them.')


class TooLong(ValueError):
    """A text, or a prompt and its continuation, past the positions the model was trained on. `problem` says what;
    the message adds the fix for Python; the command line and the app give their own (a flag, a checkbox)."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(problem + PYTHON_FIX)


def _check_model(model, which: str = "this") -> None:
    kind = getattr(model.config, "model_type", None)
    if kind != "brillm":
        raise ValueError(f"{which} is a {kind or type(model).__name__!r} model, not a BriLLM: the explorer reads "
                         "BriLLM's energies.")


def _limit(model) -> int | None:
    config = model.config
    return None if getattr(config, "position_overflow", "error") == "extend" else int(config.max_position_embeddings)


def _text_ids(text, tokenizer) -> list[int]:
    """The token ids energy_trace reads for `text` (a string with its tokenizer, or ids), checked: not empty, at
    least one edge."""
    if isinstance(text, str):
        if text == "":
            raise ValueError("the text is empty: give at least one token of text.")
        if tokenizer is None:
            raise ValueError("a text needs its tokenizer: explore(model, text, tokenizer).")
        with quiet():
            ids = list(tokenizer(text)["input_ids"])
    else:
        ids = torch.as_tensor(text).reshape(-1).tolist()
    if len(ids) < 2:
        raise ValueError(f"the text makes {len(ids)} token{'s' if len(ids) != 1 else ''} and a trace needs two (one "
                         "edge of the path): give a longer text.")
    return ids


def _check_trace_length(model, ids: list[int], what: str = "the text") -> None:
    limit = _limit(model)
    if limit is not None and len(ids) > limit:
        raise TooLong(f"{what} holds {len(ids)} tokens, more than the {limit} positions this model was trained on")


def check_text(model, text, tokenizer=None) -> list[int]:
    """The token ids `energy_trace` reads for `text` (a string with its tokenizer, or ids), or a one-line
    ValueError: an empty text, a single token, a text past the trained positions (`TooLong`)."""
    _check_model(model)
    ids = _text_ids(text, tokenizer)
    _check_trace_length(model, ids)
    return ids


def _prompt_ids(prompt, tokenizer, model, max_new_tokens) -> torch.Tensor:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"the number of new tokens must be 0 or more, got {max_new_tokens!r}.")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs its tokenizer: explore(model, tokenizer=tokenizer, prompt=...).")
        with quiet():
            ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer adds no BOS token: give at least one token.")
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(-1).tolist()
    limit = _limit(model)
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise TooLong(f"the prompt of {len(ids)} tokens and {max_new_tokens} new tokens reach position "
                      f"{len(ids) + max_new_tokens}, past the {limit} positions this model was trained on")
    return torch.tensor([ids], dtype=torch.long)


def _node_id(node, tokenizer) -> int:
    """A node given as an id, or as one token's text with the tokenizer."""
    if not isinstance(node, str):
        return int(node)
    if tokenizer is None:
        raise ValueError(f"the node {node!r} is a token text: pass the tokenizer, or give its id.")
    token = tokenizer.convert_tokens_to_ids(node)
    if token is None or (token == tokenizer.unk_token_id and node != tokenizer.unk_token):
        with quiet():
            ids = tokenizer(node, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"{node!r} is not one token of this tokenizer (it reads as {len(ids)} tokens): give a "
                             "single token, or its id.")
        token = ids[0]
    if token == tokenizer.unk_token_id and node != tokenizer.unk_token:
        raise ValueError(f"{node!r} is not in the vocabulary of this tokenizer: give one of its tokens, or an id.")
    return int(token)


def _model_facts(model) -> dict:
    config = model.config
    return {"name": display_name(getattr(config, "_name_or_path", "")), "vocab_size": int(config.vocab_size),
            "max_positions": int(config.max_position_embeddings), "graph": str(config.graph),
            "edges": int(config.num_edges) if getattr(config, "num_edges", None) else None,
            "extend": getattr(config, "position_overflow", "error") == "extend"}


def _used(paths: list[dict], hoods: dict) -> set[int]:
    used = {t for p in paths for t in p["tokens"]} | set(hoods)
    for p in paths:
        for s in p["steps"]:
            used |= {s["tgt"], s.get("pred", s["tgt"])} | {a for a, _ in s["alts"]}
    for h in hoods.values():
        used |= {v for v, _, _ in h["real"]} | {v for row in h["shared"] for v in row[3]}
    return used


def _token_data(texts: TokenText, paths: list[dict], used: set[int]) -> dict:
    """labels (every token on the page, as a chip shows it), prose (the paths' tokens as running text shows them),
    bytes (hex, for the paths' tokens that are pieces of a character) and the special tokens."""
    if texts.tokenizer is None:
        return {"labels": {str(i): label(None, i) for i in sorted(used)}, "prose": {}, "bytes": {}, "specials": []}
    in_paths = sorted({t for p in paths for t in p["tokens"]})
    pieces = {t: texts.bytes(t) for t in in_paths}
    return {"labels": {str(i): label(texts.text(i)) for i in sorted(used)},
            "prose": {str(t): prose(texts.text(t)) for t in in_paths},
            "bytes": {str(t): data.hex(" ") for t, data in pieces.items() if data is not None and not texts.whole(t)},
            "specials": sorted(i for i in used if i in texts.special)}


def explore(model, text=None, tokenizer=None, *, prompt=None, max_new_tokens: int = 20, top_k: int = 5,
            neighbours: int = 10, nodes=(), title: str | None = None, **generate_kwargs) -> Explorer:
    """The explorer page of `text` (a string with `tokenizer`, or token ids) and, with `prompt` (a string or ids),
    of the continuation `energy_generate` writes after it (`max_new_tokens`, greedy unless `generate_kwargs` say
    otherwise). `top_k` alternatives per step; `neighbours` real edges per node; `nodes` (ids, or token strings with
    a tokenizer) are added to the Node view. Raises ValueError with a one-line message on bad input (`TooLong` for
    a text past the trained positions)."""
    if text is None and prompt is None:
        raise ValueError("nothing to show: give a text to trace, a prompt to continue, or both.")
    _check_model(model)
    texts, paths = TokenText(tokenizer), []
    if text is not None:
        ids = check_text(model, text, tokenizer)
        with quiet():
            trace = energy_trace(model, text if isinstance(text, str) else ids, tokenizer, top_k=top_k)
        paths.append(trace_path(trace, texts))
    if prompt is not None:
        ids = _prompt_ids(prompt, tokenizer, model, max_new_tokens)
        with quiet():
            out = energy_generate(model, ids, max_new_tokens=max_new_tokens, num_alternatives=top_k,
                                  tokenizer=tokenizer, **generate_kwargs)
        paths.append(generation_path(model, out, texts))
    extra = [_node_id(n, tokenizer) for n in nodes]
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else model.config.bos_token_id
    hoods = neighbourhoods(model, [p["tokens"] for p in paths], extra, neighbours, bos, follow=FOLLOW)
    facts = _model_facts(model)
    data = {"title": title or f"BriLLM explorer: {facts['name']}", "model": facts,
            **_token_data(texts, paths, _used(paths, hoods)), "positions": position_logits(model), "paths": paths,
            "nodes": {str(u): h for u, h in hoods.items()}, "added": extra, "focus": extra[0] if extra else None}
    return Explorer(data)


def _changed(a: dict, b: dict) -> list[int]:
    """The steps whose rank changed most between the two traces, by the factor between the ranks."""
    factor = [abs(math.log(sb["rank"] / sa["rank"])) for sa, sb in zip(a["steps"], b["steps"])]
    order = sorted(range(len(factor)), key=lambda i: (-factor[i], i))
    return [i for i in order[:CHANGED] if factor[i] > 0]


def compare(model_a, model_b, text, tokenizer=None, tokenizer_b=None, *, names=None, top_k: int = 5,
            title: str | None = None) -> Explorer:
    """The diff page of one text through two BriLLM models (say before and after fine-tuning): per step both
    energies and ranks, and the steps whose rank changed most. `tokenizer_b` (default: `tokenizer`) must read the
    text as the same tokens; `names` label the two models (default: their folder or Hub names)."""
    _check_model(model_a, "the first model")
    _check_model(model_b, "the second model")
    tokenizer_b = tokenizer if tokenizer_b is None else tokenizer_b
    ids = _text_ids(text, tokenizer)
    if _text_ids(text, tokenizer_b) != ids:
        raise ValueError("the two tokenizers read the text as different tokens: a diff follows one token path, so "
                         "compare models that share a tokenizer.")
    for model, which in ((model_a, "first"), (model_b, "second")):
        if max(ids) >= int(model.config.vocab_size):
            raise ValueError(f"the text holds token {max(ids)}, past the {model.config.vocab_size} nodes of the "
                             f"{which} model: the two models do not share a vocabulary.")
        _check_trace_length(model, ids, f"the text (for the {which} model)")
    facts = [_model_facts(model_a), _model_facts(model_b)]
    names = list(names) if names is not None else [f["name"] for f in facts]
    if names[0] == names[1]:
        names = [f"{names[0]} (A)", f"{names[1]} (B)"]
    texts, texts_b, paths = TokenText(tokenizer), TokenText(tokenizer_b), []
    source = text if isinstance(text, str) else ids
    for model, tok, tt, name in ((model_a, tokenizer, texts, names[0]), (model_b, tokenizer_b, texts_b, names[1])):
        with quiet():
            path = trace_path(energy_trace(model, source, tok, top_k=top_k), tt)
        paths.append({**path, "name": name, "positions": position_logits(model)})
    tokens = _token_data(texts, paths, _used(paths, {}))
    tokens["labels"] = {**_token_data(texts_b, paths, _used(paths, {}))["labels"], **tokens["labels"]}
    data = {"title": title or f"BriLLM diff: {names[0]} \u2192 {names[1]}", "model": facts[0], **tokens,
            "positions": paths[0]["positions"], "paths": paths, "nodes": {}, "added": [], "focus": None,
            "diff": {"names": names, "models": facts, "changed": _changed(*paths)}}
    return Explorer(data)
