#!/usr/bin/env python
"""Pretrain a BriLLM graph language model with `accelerate launch`.

    accelerate launch --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \\
        --config demo --output_dir outputs/demo
    accelerate launch --config_file configuration/accelerate/gpu8_ddp.yaml examples/pretrain.py \\
        --config brillm-en --train_file wiki_en.txt --output_dir outputs/brillm-en

The flags follow transformers' `run_clm_no_trainer.py` plus BriLLM's own (`--help` lists each with its default).
A run's settings are the default preset (every setting with its rule), a preset's changes (`--config`) or a saved
recipe (`--recipe`), then the flags; the data probe chooses the "auto" values; the run prints each setting with the
rule, preset, recipe file or flag that set it (docs/training.md).

The run, in order (`run` in modeling_brillm/training/pretraining.py): the settings; the data (`--train_file`,
`--dataset_name`, or the English documentation text embedded in every CPython install) and the tokenizer; blocks of
`--block_size` tokens; the plan (the run's length, the auto values, the sparse graph, the memory check); the model
prepared for one process, DDP, FSDP or `--edge_sharding source`; training with validation, the best model kept and
atomic checkpoints that resume exactly; the Hugging Face folder with its model card and `recipe.json`; a few
continuations; `--push_to_hub`. Every optimizer step appends its token-weighted global loss to
`<output_dir>/train_log.jsonl`, the same whatever the number of processes.
"""

import sys

from modeling_brillm.training.pretraining import main

if __name__ == "__main__":
    sys.exit(main())
