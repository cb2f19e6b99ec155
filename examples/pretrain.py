#!/usr/bin/env python
"""Pretrain a BriLLM graph language model with `accelerate launch`.

    accelerate launch --config_file configuration/accelerate/cpu_1.yaml examples/pretrain.py \\
        --config demo --output_dir outputs/demo
    accelerate launch --config_file configuration/accelerate/gpu8_ddp.yaml examples/pretrain.py \\
        --config brillm-en --train_file wiki_en.txt --output_dir outputs/brillm-en

The flags follow transformers' `run_clm_no_trainer.py` wherever the concept is the same; BriLLM's own choose the
tokenizer, the graph and the loss (`--help` lists every one with its default: modeling_brillm/training/arguments.py).
A run's settings are the default preset (every setting with its rule: modeling_brillm/training/recipe.py), a
preset's changes (`--config`) or a saved recipe (`--recipe`), then the flags; the data probe chooses the "auto"
values. The run prints each setting with the rule, preset, recipe file or flag that set it.

What a run does, in order (`run` in modeling_brillm/training/pretraining.py): resolve and check the settings; read
the data (`--train_file`, `--dataset_name`, or with neither the English documentation text embedded in every CPython
install) and train or load the tokenizer; cut blocks of `--block_size` tokens; plan the run (the batch on a GPU, the
run's length, the recipe's auto values, the config and sparse graph of the training bigrams, the memory check);
prepare the model, optimizer and loaders (one process, DDP, FSDP or `--edge_sharding source`); train with periodic
validation, the best model kept and atomic checkpoints that resume exactly; save a Hugging Face folder with its model
card and `recipe.json`, print a few continuations, and `--push_to_hub`.

Every optimizer step appends `{"step", "loss", "lr", "tokens", ...}` to `<output_dir>/train_log.jsonl` (and every
evaluation `{"step", "eval_loss", "perplexity"}`); the loss of a step is the token-weighted mean over the whole
global batch, the same number whatever the number of processes.
"""

import sys

from modeling_brillm.training.pretraining import main

if __name__ == "__main__":
    sys.exit(main())
