"""A saved BriLLM loaded quietly by this package's code (never the folder's own), and the page of a text through one
model (`explore`) or two (`compare`) as one self-contained HTML file (docs/explorer.md). Every mistake: one line."""

import html
import json
import math
import os
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.utils import logging as hub_logging
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .. import energy_generate, energy_trace
from .records import generation_path, neighbourhoods, position_logits, trace_path
from .text import TokenText, label, prose

FOLLOW = 400  # nodes the Node view's tables lead to whose own edges the page also holds (each one short forward)
CHANGED = 10  # steps listed in the diff view as those whose rank changed most
PYTHON_FIX = ('; load the model with load_model(name, extend=True), or set model.config.position_overflow = '
              '"extend", to read past them.')
_STATIC = Path(__file__).resolve().parent / "static"
SCRIPTS = ("base.js", "chart.js", "path.js", "node.js", "diff.js", "main.js")  # the page's script, in the order it runs
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # a Hub id: a name, or a namespace and a name
SAVED = "give the folder save_pretrained wrote."


@contextmanager
def quiet():
    """transformers' and the Hub's warnings and progress bars off for the block (lengths are checked here)."""
    with ExitStack() as restore:  # each change registers its undo
        for log in (hf_logging, hub_logging):
            restore.callback(log.set_verbosity, log.get_verbosity())
            log.set_verbosity_error()
        if hf_logging.is_progress_bar_enabled():
            restore.callback(hf_logging.enable_progress_bar)
        hf_logging.disable_progress_bar()
        yield


def one_line(error: BaseException, fix: str = "") -> str:
    """The line a user reads: a `TooLong`'s problem with the `fix` of the place it is read in, else the first line."""
    if getattr(error, "problem", None):
        return error.problem + fix
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def folder_problem(name: str) -> str | None:
    """What is wrong with `name` as a saved folder, or None: it may be a model (a folder, or a Hub id)."""
    if not name:
        return "no model given: name a saved BriLLM folder or a Hub id."
    if os.path.isfile(name):
        return f"{name!r} is a file, not a model folder: {SAVED}"
    if not os.path.isdir(name):
        local = not _HUB_ID.match(name) or ("/" in name and os.path.isdir(name.split("/", 1)[0]))
        return f"no such folder: {name!r}." if local else None
    if not os.path.isfile(os.path.join(name, "config.json")):
        return f"{name!r} is not a BriLLM model folder (it holds no config.json): {SAVED}"
    return None


def load_model(name_or_path: str, extend: bool = False):
    """(model, tokenizer) of a folder or Hub id in eval mode, by this package's BriLLM; `extend`: past its positions."""
    name = os.path.expanduser(str(name_or_path).strip())
    with quiet():
        if problem := folder_problem(name):
            raise ValueError(problem)
        try:
            config = AutoConfig.from_pretrained(name, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as error:
            if os.path.isdir(name):
                raise ValueError(f"{name!r} is not a BriLLM model folder ({one_line(error)}).") from None
            raise ValueError(f"no such folder, and no Hub model {name!r} could be read ({one_line(error)}).") from None
        if getattr(config, "model_type", None) != "brillm":
            raise ValueError(f"{name!r} holds a {config.model_type!r} model, not a BriLLM: give a folder saved by "
                             "BriLLM's save_pretrained.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=False).eval()
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot load the BriLLM model {name!r}: {one_line(error)}") from None
    if extend:
        model.config.position_overflow = "extend"
        tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
    return model, tokenizer


@dataclass
class Explorer:
    """The page's data (`data`, JSON-ready) and its renderings: `to_html()`, `save(path)`, `_repr_html_()`."""

    data: dict

    @classmethod
    def error(cls, message: str) -> "Explorer":
        """A page that shows `message` in place of the views (bad input, a model that would not load, ...)."""
        return cls({"title": "BriLLM explorer", "error": str(message)})

    def to_html(self) -> str:
        payload = json.dumps(self.data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        style = (_STATIC / "explorer.css").read_text(encoding="utf-8")
        script = "\n".join((_STATIC / name).read_text(encoding="utf-8") for name in SCRIPTS)
        title = html.escape(str(self.data.get("title", "BriLLM explorer")))
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                f"<style>\n{style}</style></head>\n<body>\n<div id=\"app\"></div>\n"
                f'<script type="application/json" id="brillm-data">{payload}</script>\n'
                f'<script>\n(function () {{\n  "use strict";\n{script}\n}})();\n</script>\n</body></html>\n')

    def save(self, path) -> str:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_html(), encoding="utf-8")
        return os.fspath(path)

    def iframe(self, height: int = 720) -> str:
        """The page inside a sandboxed iframe (scripts run, nothing else is allowed): for notebooks and Gradio."""
        return (f'<iframe class="brillm-explorer" sandbox="allow-scripts" style="width:100%;height:'
                f'{int(height)}px;border:1px solid #ddd;border-radius:6px" '
                f'srcdoc="{html.escape(self.to_html(), quote=True)}"></iframe>')

    _repr_html_ = iframe  # a notebook cell shows the page in its iframe


class TooLong(ValueError):
    """A text past the trained positions: `problem` says what; the message adds Python's fix, `one_line` another."""

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
    """The token ids `energy_trace` reads for `text` (a string with its tokenizer, or ids), or a one-line ValueError."""
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
    ids = [entry] if entry not in (None, unk) else tokenizer(node, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{node!r} is not one token of this tokenizer (it reads as {len(ids)} tokens): give a single "
                         "token, or its id.")
    if ids[0] == unk:
        raise ValueError(f"{node!r} is not in the vocabulary of this tokenizer: give one of its tokens, or an id.")
    return int(ids[0])


def _model_facts(model) -> dict:
    config, name = model.config, str(getattr(model.config, "_name_or_path", "") or "").strip()
    # a folder's own name (the last part of its path), a Hub id as it is
    name = (os.path.basename(os.path.realpath(name)) or name) if os.path.isdir(name) else name or "BriLLM"
    return {"name": name, "vocab_size": int(config.vocab_size), "max_positions": int(config.max_position_embeddings),
            "graph": str(config.graph), "edges": int(config.num_edges) if getattr(config, "num_edges", None) else None,
            "extend": getattr(config, "position_overflow", "error") == "extend"}


def _token_data(texts: TokenText, paths: list[dict], hoods: dict) -> dict:
    """Every token's chip label, the paths' tokens as prose, the bytes of those that are pieces of a character."""
    in_paths = sorted({t for p in paths for t in p["tokens"]})
    used = set(in_paths) | set(hoods) | {v for p in paths for s in p["steps"] for v in
                                         [s["tgt"], s.get("pred", s["tgt"])] + [a for a, _ in s["alts"]]}
    used |= {v for h in hoods.values() for v in [e[0] for e in h["real"]] + [x for r in h["shared"] for x in r[3]]}
    pieces = {t: texts.bytes(t) for t in in_paths if not texts.whole(t)}  # none without a tokenizer
    return {"labels": {str(i): label(texts.text(i), i) for i in sorted(used)},
            "prose": {str(t): prose(texts.text(t)) for t in in_paths} if texts.tokenizer is not None else {},
            "bytes": {str(t): data.hex(" ") for t, data in pieces.items()},
            "specials": sorted(i for i in used if i in texts.special)}


def explore(model, text=None, tokenizer=None, *, prompt=None, max_new_tokens: int = 20, top_k: int = 5,
            neighbours: int = 10, nodes=(), **generate_kwargs) -> Explorer:
    """The page of `text` (a string with `tokenizer`, or ids) and of `prompt`'s continuation by `energy_generate`."""
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
        extra = [_node_id(n, tokenizer) for n in nodes]  # under quiet(): a text may be tokenized
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else model.config.bos_token_id
    hoods = neighbourhoods(model, [p["tokens"] for p in paths], extra, neighbours, bos, follow=FOLLOW)
    facts = _model_facts(model)
    return Explorer({"title": f"BriLLM explorer: {facts['name']}", "model": facts,
                     **_token_data(texts, paths, hoods), "positions": position_logits(model), "paths": paths,
                     "nodes": {str(u): h for u, h in hoods.items()}, "added": extra, "focus": (extra or [None])[0]})


def compare(model_a, model_b, text, tokenizer=None, tokenizer_b=None, *, names=None, top_k: int = 5) -> Explorer:
    """The diff page of one text through two BriLLMs; `tokenizer_b` (default `tokenizer`) must read the same tokens."""
    tokenizer_b = tokenizer if tokenizer_b is None else tokenizer_b
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
    facts = [_model_facts(model_a), _model_facts(model_b)]
    names = list(names) if names is not None else [f["name"] for f in facts]
    if names[0] == names[1]:
        names = [f"{names[0]} (A)", f"{names[1]} (B)"]
    texts, source, paths = [TokenText(tokenizer), TokenText(tokenizer_b)], text if isinstance(text, str) else ids, []
    with quiet():
        for model, tt, name in zip((model_a, model_b), texts, names):
            path = trace_path(energy_trace(model, source, tt.tokenizer, top_k=top_k), tt)
            paths.append({**path, "name": name, "positions": position_logits(model)})
    factor = [abs(math.log(sb["rank"] / sa["rank"])) for sa, sb in zip(paths[0]["steps"], paths[1]["steps"])]
    changed = [i for i in sorted(range(len(factor)), key=lambda i: (-factor[i], i))[:CHANGED] if factor[i] > 0]
    tokens = _token_data(texts[0], paths, {})
    tokens["labels"] = {**_token_data(texts[1], paths, {})["labels"], **tokens["labels"]}
    return Explorer({"title": f"BriLLM diff: {names[0]} \u2192 {names[1]}", "model": facts[0], **tokens,
                     "positions": paths[0]["positions"], "paths": paths, "nodes": {}, "added": [], "focus": None,
                     "diff": {"names": names, "models": facts, "changed": changed}})
