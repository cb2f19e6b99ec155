"""Pretrain a BriLLM graph language model with `accelerate launch`; `--help` lists every flag (docs/training.md).

    accelerate launch --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \\
        --config demo --output_dir outputs/demo
    accelerate launch --config_file configuration/accelerate/gpu8_ddp.yaml examples/pretrain.py \\
        --config brillm-en --train_file wiki_en.txt --output_dir outputs/brillm-en

The code: `run` in modeling_brillm/training/pretraining.py, its steps in order.
"""

import sys

from modeling_brillm.training.pretraining import main

if __name__ == "__main__":
    sys.exit(main())
