"""Loading a saved BriLLM for the explorer, quietly and by this package's BriLLM (never the folder's own code), with
one-line messages for every way it fails."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from huggingface_hub.utils import logging as hub_logging
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

# what the Hub accepts as a repository id: a name, or a namespace and a name
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
SAVED = "give the folder save_pretrained wrote."


@contextmanager
def quiet():
    """transformers' and the Hub client's warnings and progress bars off for the block, then as they were (the
    explorer checks lengths itself: the tokenizer's "indexing errors" warning would mislead)."""
    level, hub_level = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hub_logging.set_verbosity(hub_level)
        if bars:
            hf_logging.enable_progress_bar()


def one_line(error: BaseException, fix: str = "") -> str:
    """The line a user reads for `error`: a `TooLong`'s problem with the `fix` of the place it is read in, else the
    error's first line."""
    if getattr(error, "problem", None):
        return error.problem + fix
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def display_name(name_or_path) -> str:
    """A model's name for a title: a folder's own name (the last part of its path), a Hub id as it is."""
    name = str(name_or_path or "").strip()
    return (os.path.basename(os.path.realpath(name)) or name) if os.path.isdir(name) else name or "BriLLM"


def looks_local(name: str) -> bool:
    """Whether `name` can only be a path (not a Hub id), or reads "folder/name" with the folder here (outputs/dmeo)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.count("/") > 1
            or not _HUB_ID.match(name) or ("/" in name and os.path.isdir(name.split("/", 1)[0])))


def folder_problem(name: str) -> str | None:
    """What is wrong with `name` as a saved folder (none, a file, missing, no config.json), or None: may be a model."""
    if not name:
        return "no model given: name a saved BriLLM folder or a Hub id."
    if os.path.isfile(name):
        return f"{name!r} is a file, not a model folder: {SAVED}"
    if not os.path.isdir(name):
        return f"no such folder: {name!r}." if looks_local(name) else None
    if not os.path.isfile(os.path.join(name, "config.json")):
        return f"{name!r} is not a BriLLM model folder (it holds no config.json): {SAVED}"
    return None


def _config(name: str):
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
    return config


def load_model(name_or_path: str, extend: bool = False):
    """(model, tokenizer) of a saved BriLLM folder or Hub id in eval mode, read by this package's BriLLM (`extend`:
    past its trained positions), or a one-line ValueError."""
    name = os.path.expanduser(str(name_or_path).strip())
    with quiet():
        _config(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=False).eval()
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot load the BriLLM model {name!r}: {one_line(error)}") from None
    if extend:
        model.config.position_overflow = "extend"
        tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
    return model, tokenizer
