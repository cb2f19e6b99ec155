"""Building blocks of the training scripts (examples/pretrain.py and others). Not part of the model's remote
code: nothing in modeling_brillm.py imports this subpackage.

Modules:
  errors       UsageError, the one-line error of a bad flag, file or size.
  presets      configuration/models/*.json presets, defaults < preset < flags, the config and graph they give.
  data         files, the Hub or the embedded corpus; validation split; sentence and contiguous blocks;
               the tokenizer; collate and target counting.
  memory       the training-memory estimate, available memory, the check before allocating, malloc tuning.
  checkpoints  step_N checkpoints (atomic save, resolve, resume), the output folder, the jsonl train log.
  launch       the Accelerator of a run and the checks on how it was launched.
  optimizers   which optimizer (and gradient layout) a run uses, and building it.
  loop         the training step (TrainStep), evaluation, prompts and sample generation.
  epochs       the epoch loop of a pretraining run: steps, the log, periodic validation, checkpoints, resume.
  best         the best model by validation loss, kept on disk and in every checkpoint.
  publishing   the model card of the final save, the upload to the Hub.
"""


def __getattr__(name):  # BriLLMSFTTrainer (training/sft.py) imports trl, so only when asked for
    if name == "BriLLMSFTTrainer":
        from .sft import BriLLMSFTTrainer
        return BriLLMSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
