"""Grow a trained BriLLM without retraining it: add tokens (nodes) and edges, then fine-tune only what is new.

    python examples/grow_graph.py --model outputs/demo --output_dir outputs/demo-grown
    python examples/grow_graph.py --model DIR --new_text new.txt --old_text heldout.txt --add_tokens word1 word2

Steps (the Hugging Face way, then BriLLM's own):
  1. `tokenizer.add_tokens([...])` and `model.resize_token_embeddings(len(tokenizer))`: the new nodes join the
     graph through the shared edge; the old nodes' logits do not change (checked here, exactly);
  2. `model.add_edges_from_sequences(new_text_ids)`: every bigram of the new text that is not a real edge yet
     becomes one, initialised as a copy of the shared edge, so no energy changes (checked here; with the recipe's
     `non_edge_bias` a new pair's logit moves by exactly its node's non-successor offset, which the check expects);
  3. a short fine-tune (AdamW) of the new edges and the new nodes' rows only (start bias, and with the recipe's
     options the non-successor offset and readout; `--train new`, the default:
     every old parameter stays bit for bit as it was) or of everything (`--train all`), on the new text plus a
     replay of `--replay` old training texts per step: they teach the new edges to stay weak where old text goes
     on as before (without them a new edge from a frequent node, e.g. the space token, takes probability mass from
     old continuations everywhere);
  4. perplexity before/after on held-out new text (all tokens, and the new tokens as targets) and on held-out old
     text; then save, reload with `from_pretrained` and as remote code, and check the logits.

New text: `--new_text` (one text per line), by default `grow_graph_text.txt` beside this script, a short text on
plant biology whose words the demo's tokenizer (trained on Python's documentation) splits into pieces. Every 4th
line is held out. Old text: `--old_text`, by default the demo's own validation split of the built-in corpus (every
20th paragraph, its sentences cut to 32 tokens as in training), and for the replay the rest of it
(`--old_train_text` otherwise). New tokens: `--add_tokens`, by default the `--num_new_tokens` most frequent words of
the new text that the tokenizer splits into 2 or more pieces and the old text never uses. The code:
modeling_brillm/training/growing.py.
"""

from pathlib import Path

from modeling_brillm.training.growing import main

if __name__ == "__main__":
    main(default_new_text=Path(__file__).with_name("grow_graph_text.txt"))
