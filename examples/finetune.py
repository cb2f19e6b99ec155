#!/usr/bin/env python
"""Fine-tune a saved (or converted) BriLLM model on prompt/completion data, with the loss on the completion only.

    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --output_dir outputs/finetune-demo
    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --train_file data.jsonl \\
        --train_only start_signal --output_dir outputs/prompt-tuned

Data: a .jsonl file of {"prompt": ..., "completion": ...} records (TRL's SFT convention), {"text": ...} records or a
.txt file of plain texts; with no --train_file, topic/summary pairs from Python's documentation (the demo's text).

What is trained (`--train_only`): all (every parameter); touched_edges (the edge rows of the real edges the data's
consecutive pairs cross, not the shared edge row 0); node_bias (how the signal starts from each first token);
start_signal (d numbers: prompt tuning; a model with the release's uniform start gets a learned one initialised to
1/d, the same model, and `--signal_id k` trains signal k; generate with `signal_ids=torch.tensor([k])`). Frozen
parameters stay bit for bit as they were.

Reports the completion perplexity of the validation pairs before and after, and saves a Hugging Face folder (weights,
the model's code, tokenizer, a model card, finetune_results.json) atomically. The code:
modeling_brillm/training/finetuning.py (`--help` lists the flags).
"""

import sys

from modeling_brillm.training.finetuning import main

if __name__ == "__main__":
    sys.exit(main())
