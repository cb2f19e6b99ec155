"""Grow a trained BriLLM without retraining it: add tokens (nodes) and the new text's bigrams (edges), both starting as
the shared edge so no old logit moves, then fine-tune only what is new with a replay of old text. By default the new
text is grow_graph_text.txt beside this script (plant biology, which the demo's tokenizer splits into pieces). The
code: modeling_brillm/training/growing.py.

    python examples/grow_graph.py --model outputs/demo --output_dir outputs/demo-grown
    python examples/grow_graph.py --model DIR --new_text new.txt --old_text heldout.txt --add_tokens word1 word2
"""

from pathlib import Path

from modeling_brillm.training.growing import main

if __name__ == "__main__":
    main(default_new_text=Path(__file__).with_name("grow_graph_text.txt"))
