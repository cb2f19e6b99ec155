"""The one exception of the training scripts, how a script reports it, and saved folders loaded with a line a fault."""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class UsageError(Exception):
    """A problem the user can fix (bad flag, missing data, a model too big): printed as one line, no traceback."""


CLI_ERRORS = (UsageError, ValueError, TypeError, OSError)  # what the generate and perplexity scripts print as a line


def run_cli(parse_args, run, argv=None, catch=(UsageError,)) -> int:
    """`run(parse_args(argv))`; an exception of `catch` is one `error:` line on stderr (first process) and status 2."""
    args = parse_args(argv)
    try:
        return run(args)
    except catch as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


def first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def load_tokenizer(path, fix: str = "pass --tokenizer_name"):
    """`AutoTokenizer.from_pretrained(path)`; a folder without its tokenizer.json, or with a truncated one, is named."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "tokenizer.json").is_file() and not any(
            p.name in ("vocab.json", "vocab.txt") or p.suffix == ".model" for p in folder.iterdir()):
        raise UsageError(f"{folder} has no tokenizer (no tokenizer.json): save the model's tokenizer there "
                         f"(tokenizer.save_pretrained), or {fix}.")
    for file in (p for p in (folder / "tokenizer.json", folder / "tokenizer_config.json") if p.is_file()):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except ValueError as err:
            raise UsageError(f"{file} is truncated or corrupt (not JSON: {err}): save the tokenizer again.") from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # a Hub id that is not there, offline, ...
        raise UsageError(f"could not load the tokenizer of {path}: {first_line(err)}; {fix}.") from None


def load_model(path, model_class=AutoModelForCausalLM, **kwargs):
    """`model_class.from_pretrained(path)` (the installed package answers for the brillm type), refused where its
    weights hold NaN or infinity (it would generate padding), naming the first such tensor."""
    try:
        model = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise UsageError(f"could not load the model {path}: {first_line(err)}") from None
    for name, param in model.named_parameters():
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise UsageError(f"the weights are broken: {name} holds {bad:,} NaN or infinite value(s) of "
                             f"{param.numel():,}; load an earlier checkpoint or retrain.")
    return model
