"""Perplexity of a saved BriLLM: the built-in token-weighted one (`modeling_brillm.evaluation.perplexity`) and the
`evaluate` metric's mean of per-text perplexities (run in-process when its script cannot be downloaded). The code:
modeling_brillm/training/perplexity_cli.py.

    python examples/perplexity.py --model outputs/demo --texts valid.txt            # one text per line
    python examples/perplexity.py --model outputs/demo --text "the cat sat" --text "a dog" --no_metric
"""

import sys

from modeling_brillm.training.perplexity_cli import main

if __name__ == "__main__":
    sys.exit(main())
