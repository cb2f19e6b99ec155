"""The applications behind examples/ and their building blocks. Not the model's remote code: nothing in
modeling_brillm.py imports this subpackage.

  pretraining  examples/pretrain.py: `run` (the whole job as named steps), `main`; arguments: its flags and checks;
               planning: the run's length, auto values and memory before the model exists.
  recipe       every setting's rule (RULES) and the default preset; presets: a preset's changes and the flags
               resolved in one function, the auto values, the config and graph; pruning: the data probe.
  data, memory, launch, optimizers, loop (the step, evaluation), epochs (the loop, the one training clock and
               schedule), checkpoints, best, sharded, fsdp: the pieces of a run.
  finetuning   examples/finetune.py; sft_data: its records; sft: BriLLMSFTTrainer for TRL.
  generate_cli, perplexity_cli, growing, publishing (push_main): examples/generate.py, perplexity.py, grow_graph.py,
               push_to_hub.py.
"""


def __getattr__(name):  # BriLLMSFTTrainer (training/sft.py) imports trl, so only when asked for
    if name == "BriLLMSFTTrainer":
        from .sft import BriLLMSFTTrainer
        return BriLLMSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
