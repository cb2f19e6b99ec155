"""Perplexity of a saved BriLLM: the fast built-in one, and the `evaluate` "perplexity" metric.

    python examples/perplexity.py --model outputs/demo --texts valid.txt            # one text per line
    python examples/perplexity.py --model outputs/demo --text "the cat sat" --text "a dog"
    python examples/perplexity.py --model outputs/demo --dataset wikitext --dataset_config wikitext-2-raw-v1 \
        --split test --limit 500
    python examples/perplexity.py --model outputs/demo --texts valid.txt --no_metric --json ppl.json

Two numbers, two definitions:
  built-in   `modeling_brillm.evaluation.perplexity`: exp(total NLL / predicted tokens) over the whole corpus
             (token-weighted), from the model's exact loss; texts longer than --block_size are split into blocks.
  metric     `evaluate.load("perplexity")`: per-text perplexities and their plain mean ("mean_perplexity").
             The metric's script is downloaded from the Hub at run time; offline, the same steps are run in-process
             (`modeling_brillm.evaluation.per_text_perplexity`) and this is said on stderr.
The metric loads the model with `AutoModelForCausalLM.from_pretrained(model_id)` (no trust_remote_code): that works
because this script imports `modeling_brillm`, which registers the brillm model type. It pads on the tokenizer's
padding side; BriLLM tokenizers pad on the right, which is what the metric expects. The code:
modeling_brillm/training/perplexity_cli.py.
"""

import sys

from modeling_brillm.training.perplexity_cli import main

if __name__ == "__main__":
    sys.exit(main())
