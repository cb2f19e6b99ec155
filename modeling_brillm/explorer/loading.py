"""Loading a saved BriLLM for the explorer: one-line messages for every way it fails, no progress bars, and never
the folder's own code (the installed package's BriLLM reads it)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

# what the Hub accepts as a repository id: a name, or a namespace and a name
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@contextmanager
def quiet():
    """transformers' warnings and progress bars off for the block (errors still show), then as they were. The
    explorer checks lengths itself, so the tokenizer's "indexing errors" warning would only mislead."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    level, hub_level, bars = logging.get_verbosity(), hub_logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    hub_logging.set_verbosity_error()  # the Hub client's retry notices, one per attempt
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        hub_logging.set_verbosity(hub_level)
        if bars:
            logging.enable_progress_bar()


def display_name(name_or_path) -> str:
    """A model's name for a title: a folder's own name (the last part of its path), a Hub id as it is."""
    name = str(name_or_path or "").strip()
    if name and os.path.isdir(name):
        return os.path.basename(os.path.realpath(name)) or name
    return name or "BriLLM"


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a path: it can only be one (absolute, relative to . or ~, more than one '/', a
    backslash), or it reads "folder/name" where the folder exists here (a mistyped outputs/demo)."""
    head = name.split("/", 1)[0]
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.count("/") > 1
            or not _HUB_ID.match(name) or ("/" in name and os.path.isdir(head)))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _config(name: str):
    from transformers import AutoConfig

    if os.path.isfile(name):
        raise ValueError(f"{name!r} is a file, not a model folder: give the folder save_pretrained wrote.")
    if not os.path.isdir(name) and looks_local(name):
        raise ValueError(f"no such folder: {name!r}.")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"{name!r} is not a BriLLM model folder (it holds no config.json): give the folder "
                         "save_pretrained wrote.")
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:
        if os.path.isdir(name):
            raise ValueError(f"{name!r} is not a BriLLM model folder ({_first_line(error)}).") from None
        raise ValueError(f"no such folder, and no Hub model {name!r} could be read ({_first_line(error)}).") from None


def load_model(name_or_path: str, extend: bool = False):
    """(model, tokenizer) of a saved BriLLM folder or Hub id, in eval mode, loaded quietly by this package's own
    BriLLM (never the folder's code); with `extend` the model reads past its trained positions. Raises ValueError
    with a one-line message when the folder is missing or is not a BriLLM model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.path.expanduser(str(name_or_path).strip())
    if not name:
        raise ValueError("no model given: name a saved BriLLM folder or a Hub id.")
    with quiet():
        config = _config(name)
        if getattr(config, "model_type", None) != "brillm":
            raise ValueError(f"{name!r} holds a {config.model_type!r} model, not a BriLLM: give a folder saved by "
                             "BriLLM's save_pretrained.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=False).eval()
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot load the BriLLM model {name!r}: {_first_line(error)}") from None
    if extend:
        model.config.position_overflow = "extend"
        tokenizer.model_max_length = int(1e30)  # the trained range would warn of indexing errors falsely
    return model, tokenizer
