"""BriLLM's energy paths as one self-contained HTML page (no server, no network; views in docs/explorer.md).

`explore(model, text, tokenizer)` traces `text` (`energy_trace`) and, with `prompt=`, continues it (`energy_generate`);
`compare(model_a, model_b, text, tokenizer)` traces one text through two models. The `Explorer` they return holds the
page's data (`.data`), writes it (`.save(path)`) and shows itself in a notebook. A saved model's code never imports
the explorer. `cli.main` and `app.main` are examples/visualize.py's and examples/app.py's code."""

from .build import TooLong, check_text, compare, explore
from .edges import neighbourhoods
from .loading import load_model
from .page import Explorer
from .paths import mix_weights
from .text import label

__all__ = ["Explorer", "TooLong", "check_text", "compare", "explore", "label", "load_model", "mix_weights",
           "neighbourhoods"]
