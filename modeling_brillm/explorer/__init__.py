"""An interactive, self-contained view of BriLLM's energy paths: one HTML page, no server, no network.

`explore(model, text, tokenizer)` traces `text` (`energy_trace`); with `prompt=` it also generates a continuation
(`energy_generate`). `compare(model_a, model_b, text, tokenizer)` traces one text through two models. The result,
an `Explorer`, holds the page's data (`.data`, JSON-ready), writes the page (`.save("path.html")`, `.to_html()`) and
shows itself in a notebook cell (`_repr_html_`: the page in a sandboxed iframe; IPython is not imported).

The page's views:
  * Text: the traced text as running prose coloured by rank, and every step of the path (the node the signal sits
    on, the true next token, the energy its edge delivers, its rank among all V nodes, the strongest alternatives,
    the signal's mix: the weight softmax_k(p_k) of every earlier edge in x_i = sum_k softmax_k(p_k) c_k). Tokens
    that are pieces of one UTF-8 character are shown as that character, grouped across their steps.
  * Generation: the continuation's energy path and runner-ups, its prompt folded.
  * Node: a node's real outgoing edges ranked by the mean energy each delivered over the node's visits, apart from
    the shared edge, whose tied targets make one row with their count.
  * Diff (a `compare` page): both models' energies and ranks per step, and the steps whose rank changed most.

Every token text is shown through `label` (visible whitespace, control, bidi and zero-width characters) and inserted
as text, never as markup; the data is embedded as JSON with '<', '>' and '&' escaped, so no token can end the
script that holds it. The explorer is not part of a saved model's code: nothing the model imports imports it.
"""

from .build import TooLong, check_text, compare, explore
from .edges import neighbourhoods
from .loading import load_model
from .page import Explorer
from .paths import mix_weights
from .text import label

__all__ = ["Explorer", "TooLong", "check_text", "compare", "explore", "label", "load_model", "mix_weights",
           "neighbourhoods"]
