"""BriLLM's energy paths as one self-contained HTML page, and an app (docs/explorer.md). A saved model's code never
imports the explorer; `cli.main` and `app.main` are examples/visualize.py's and examples/app.py's code."""

from .build import Explorer, TooLong, check_text, compare, explore, load_model
from .records import mix_weights, neighbourhoods
from .text import label

__all__ = ["Explorer", "TooLong", "check_text", "compare", "explore", "label", "load_model", "mix_weights",
           "neighbourhoods"]
