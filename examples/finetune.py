"""Fine-tune a saved (or converted) BriLLM on prompt/completion data, the loss on the completion only; `--help` lists
the flags, docs/training.md the `--train_only` modes. The run: modeling_brillm/training/finetuning.py.

    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --output_dir outputs/finetune-demo
    accelerate launch examples/finetune.py --model_name_or_path outputs/demo --train_file data.jsonl \\
        --train_only start_signal --output_dir outputs/prompt-tuned
"""

import sys

from modeling_brillm.training.finetuning import main

if __name__ == "__main__":
    sys.exit(main())
