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
    """A text past the trained positions: `problem` says what, the message adds Python's fix (the command line and
    the app add their own: a flag, a checkbox)."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(problem + PYTHON_FIX)


def _check_model(model, which: str = "this") -> None:
    if (kind := getattr(model.config, "model_type", None)) != "brillm":
        raise ValueError(f"{which} is a {kind or type(model).__name__!r} model, not a BriLLM: the explorer reads "
                         "BriLLM's energies.")


def _check_length(model, length: int, what: str) -> None:
    """A TooLong, `what` beginning its message, when `length` positions pass a model's trained range."""
    limit = int(model.config.max_position_embeddings)
    if getattr(model.config, "position_overflow", "error") != "extend" and length > limit:
        raise TooLong(f"{what} the {limit} positions this model was trained on")


def _ids(text, tokenizer, missing: str) -> list[int]:
    """The token ids of `text` (a string, read by its tokenizer, or ids); `missing`: the message without one."""
    if not isinstance(text, str):
        return torch.as_tensor(text, dtype=torch.long).reshape(-1).tolist()
    if tokenizer is None:
        raise ValueError(missing)
    with quiet():
        return list(tokenizer(text)["input_ids"])


def _text_ids(text, tokenizer) -> list[int]:
    """The ids energy_trace reads for `text`, checked: not empty, at least one edge."""
    if isinstance(text, str) and text == "":
        raise ValueError("the text is empty: give at least one token of text.")
    ids = _ids(text, tokenizer, "a text needs its tokenizer: explore(model, text, tokenizer).")
    if len(ids) < 2:
        raise ValueError(f"the text makes {len(ids)} token{'s' if len(ids) != 1 else ''} and a trace needs two (one "
                         "edge of the path): give a longer text.")
    return ids


def check_text(model, text, tokenizer=None) -> list[int]:
    """The token ids `energy_trace` reads for `text` (a string with its tokenizer, or ids), or a one-line ValueError:
    an empty text, a single token, a text past the trained positions (`TooLong`)."""
    _check_model(model)
    ids = _text_ids(text, tokenizer)
    _check_length(model, len(ids), f"the text holds {len(ids)} tokens, more than")
    return ids


def _prompt_ids(prompt, tokenizer, model, max_new_tokens) -> torch.Tensor:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"the number of new tokens must be 0 or more, got {max_new_tokens!r}.")
    ids = _ids(prompt, tokenizer, "a text prompt needs its tokenizer: explore(model, tokenizer=tokenizer, prompt=...).")
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer adds no BOS token: give at least one token.")
    _check_length(model, len(ids) + max_new_tokens, f"the prompt of {len(ids)} tokens and {max_new_tokens} new "
                  f"tokens reach position {len(ids) + max_new_tokens}, past")
    return torch.tensor([ids], dtype=torch.long)


def _node_id(node, tokenizer) -> int:
    """A node given as an id, or by the text of one token (a vocabulary entry, or a text that reads as one token)."""
    if not isinstance(node, str):
        return int(node)
    if tokenizer is None:
        raise ValueError(f"the node {node!r} is a token text: pass the tokenizer, or give its id.")
    unk, entry = tokenizer.unk_token_id if node != tokenizer.unk_token else None, tokenizer.convert_tokens_to_ids(node)
    with quiet():
        ids = [entry] if entry not in (None, unk) else tokenizer(node, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{node!r} is not one token of this tokenizer (it reads as {len(ids)} tokens): give a single "
                         "token, or its id.")
    if ids[0] == unk:
        raise ValueError(f"{node!r} is not in the vocabulary of this tokenizer: give one of its tokens, or an id.")
    return int(ids[0])


def _model_facts(model) -> dict:
    config = model.config
    return {"name": display_name(getattr(config, "_name_or_path", "")), "vocab_size": int(config.vocab_size),
            "max_positions": int(config.max_position_embeddings), "graph": str(config.graph),
            "edges": int(config.num_edges) if getattr(config, "num_edges", None) else None,
            "extend": getattr(config, "position_overflow", "error") == "extend"}


def _token_data(texts: TokenText, paths: list[dict], hoods: dict) -> dict:
    """Every token on the page as a chip shows it (labels), the paths' tokens as prose shows them, the bytes (hex) of
    those that are pieces of a character, and the special tokens."""
    in_paths = sorted({t for p in paths for t in p["tokens"]})
    used = set(in_paths) | set(hoods) | {v for p in paths for s in p["steps"] for v in
                                         [s["tgt"], s.get("pred", s["tgt"])] + [a for a, _ in s["alts"]]}
    used |= {v for h in hoods.values() for v in [e[0] for e in h["real"]] + [x for r in h["shared"] for x in r[3]]}
    if texts.tokenizer is None:
        return {"labels": {str(i): label(None, i) for i in sorted(used)}, "prose": {}, "bytes": {}, "specials": []}
    pieces = {t: texts.bytes(t) for t in in_paths if not texts.whole(t)}
    return {"labels": {str(i): label(texts.text(i)) for i in sorted(used)},
            "prose": {str(t): prose(texts.text(t)) for t in in_paths},
            "bytes": {str(t): data.hex(" ") for t, data in pieces.items()},
            "specials": sorted(i for i in used if i in texts.special)}


def explore(model, text=None, tokenizer=None, *, prompt=None, max_new_tokens: int = 20, top_k: int = 5,
            neighbours: int = 10, nodes=(), title: str | None = None, **generate_kwargs) -> Explorer:
    """The page of `text` (a string with `tokenizer`, or token ids) and, with `prompt` (a string or ids), of the
    continuation `energy_generate` writes (`generate_kwargs`: greedy unless they say otherwise); `top_k` alternatives
    a step, `neighbours` real edges a node, `nodes` (ids or token texts) added to the Node view. Bad input: a one-line
    ValueError (`TooLong` past the trained positions)."""
    if text is None and prompt is None:
        raise ValueError("nothing to show: give a text to trace, a prompt to continue, or both.")
    _check_model(model)
    texts, paths = TokenText(tokenizer), []
    with quiet():
        if text is not None:
            ids = check_text(model, text, tokenizer)
            trace = energy_trace(model, text if isinstance(text, str) else ids, tokenizer, top_k=top_k)
            paths.append(trace_path(trace, texts))
        if prompt is not None:
            out = energy_generate(model, _prompt_ids(prompt, tokenizer, model, max_new_tokens), tokenizer=tokenizer,
                                  max_new_tokens=max_new_tokens, num_alternatives=top_k, **generate_kwargs)
            paths.append(generation_path(model, out, texts))
    extra = [_node_id(n, tokenizer) for n in nodes]
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else model.config.bos_token_id
    hoods = neighbourhoods(model, [p["tokens"] for p in paths], extra, neighbours, bos, follow=FOLLOW)
    facts = _model_facts(model)
    data = {"title": title or f"BriLLM explorer: {facts['name']}", "model": facts,
            **_token_data(texts, paths, hoods), "positions": position_logits(model), "paths": paths,
            "nodes": {str(u): h for u, h in hoods.items()}, "added": extra, "focus": extra[0] if extra else None}
    return Explorer(data)


def _changed(a: dict, b: dict) -> list[int]:
    """The steps whose rank changed most between the two traces, by the factor between the ranks."""
    factor = [abs(math.log(sb["rank"] / sa["rank"])) for sa, sb in zip(a["steps"], b["steps"])]
    order = sorted(range(len(factor)), key=lambda i: (-factor[i], i))
    return [i for i in order[:CHANGED] if factor[i] > 0]


def _check_pair(model_a, model_b, text, tokenizer, tokenizer_b) -> list[int]:
    """The text's ids, the same for both models: both BriLLMs, one token path, within both vocabularies and ranges."""
    _check_model(model_a, "the first model")
    _check_model(model_b, "the second model")
    ids = _text_ids(text, tokenizer)
    if _text_ids(text, tokenizer_b) != ids:
        raise ValueError("the two tokenizers read the text as different tokens: a diff follows one token path, so "
                         "compare models that share a tokenizer.")
    for model, which in ((model_a, "first"), (model_b, "second")):
        if max(ids) >= int(model.config.vocab_size):
            raise ValueError(f"the text holds token {max(ids)}, past the {model.config.vocab_size} nodes of the "
                             f"{which} model: the two models do not share a vocabulary.")
        _check_length(model, len(ids), f"the text (for the {which} model) holds {len(ids)} tokens, more than")
    return ids


def compare(model_a, model_b, text, tokenizer=None, tokenizer_b=None, *, names=None, top_k: int = 5,
            title: str | None = None) -> Explorer:
    """The diff page of one text through two BriLLMs (say before and after fine-tuning): both energies and ranks a
    step, and the steps whose rank changed most. `tokenizer_b` (default `tokenizer`) must read the same tokens;
    `names` label the models (default: their folder or Hub names)."""
    tokenizer_b = tokenizer if tokenizer_b is None else tokenizer_b
    ids = _check_pair(model_a, model_b, text, tokenizer, tokenizer_b)
    facts = [_model_facts(model_a), _model_facts(model_b)]
    names = list(names) if names is not None else [f["name"] for f in facts]
    if names[0] == names[1]:
        names = [f"{names[0]} (A)", f"{names[1]} (B)"]
    texts, source, paths = [TokenText(tokenizer), TokenText(tokenizer_b)], text if isinstance(text, str) else ids, []
    with quiet():
        for model, tt, name in zip((model_a, model_b), texts, names):
            path = trace_path(energy_trace(model, source, tt.tokenizer, top_k=top_k), tt)
            paths.append({**path, "name": name, "positions": position_logits(model)})
    tokens = _token_data(texts[0], paths, {})
    tokens["labels"] = {**_token_data(texts[1], paths, {})["labels"], **tokens["labels"]}
    data = {"title": title or f"BriLLM diff: {names[0]} \u2192 {names[1]}", "model": facts[0], **tokens,
            "positions": paths[0]["positions"], "paths": paths, "nodes": {}, "added": [], "focus": None,
            "diff": {"names": names, "models": facts, "changed": _changed(*paths)}}
    return Explorer(data)
