#!/usr/bin/env python
"""Fine-tune a saved (or converted) BriLLM model on prompt/completion data, with the loss on the completion only.

    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --output_dir outputs/finetune-demo
    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --train_file data.jsonl \\
        --train_only start_signal --output_dir outputs/prompt-tuned

Data (`modeling_brillm.training.sft_data`): a .jsonl file of {"prompt": ..., "completion": ...} records (TRL's SFT
convention), {"text": ...} records or a .txt file of plain texts (every token scored); with no --train_file, the
built-in set of topic/summary pairs from Python's documentation (the text the demo model was trained on).

What is trained (`--train_only`):
  all            every parameter.
  touched_edges  only the edge rows (matrix + bias) of the edges the training data crosses: every consecutive token
                 pair u→v of every training sequence (prompt and completion) that is a real edge of the graph.
                 Not the shared edge (row 0: every non-edge pair of the whole graph uses it) and not the other
                 candidate edges of the sources (the exact loss's softmax gives them gradients; they are dropped).
                 Every other row stays bit for bit what it was.
  node_bias      only the node biases (V × d): how the signal starts from each first token. A tokenizer that
                 prepends <s> makes <s> every sequence's first token, so only its row (d numbers) learns.
  start_signal   only the start signal (d numbers): prompt tuning for BriLLM. A model with the release's uniform
                 start is loaded with a learned one initialised to 1/d (the same model), and `--signal_id k`
                 trains signal k (more are added as needed); generate with `signal_ids=torch.tensor([k])`.
Frozen parameters have requires_grad False and are bit for bit unchanged.

Reports the completion perplexity (full softmax over all V nodes, completion tokens only) of the validation pairs
before and after, and saves a normal Hugging Face folder (weights, the model's code, tokenizer, a model card and
finetune_results.json), written to a temporary folder and renamed into place. The steps are `run` in
modeling_brillm/training/finetuning.py, its flags `parse_args` there (`--help` lists them).
"""

import sys

from modeling_brillm.training.finetuning import main

if __name__ == "__main__":
    sys.exit(main())
