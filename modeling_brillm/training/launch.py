"""The accelerator of a training run and the checks on how it was launched."""

from __future__ import annotations

import os

from .errors import UsageError
from .memory import keep_freed_memory


def make_accelerator(args, project_name: str | None = None):
    """An Accelerator for a training script (`args`: gradient_accumulation_steps, seed, output_dir, with_tracking,
    report_to, torch_threads, no_malloc_tuning), with the launch checked, logging quieted on non-main
    processes, the seed set, and the CPU tuned. Returns (accelerator, a line describing the setup)."""
    import datasets
    import torch
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed

    # A multi-process launch on a machine without CUDA must use CPU/gloo: without cpu=True accelerate would
    # start every process as an independent single-process run.
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        cpu=multi and not torch.cuda.is_available(),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,  # stepped by hand, once per optimizer step, whatever the processes
        log_with=args.report_to if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    if multi and accelerator.num_processes == 1:
        raise UsageError("WORLD_SIZE > 1 but accelerate did not form a process group.")
    if (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") and os.environ.get("MASTER_PORT")
            and not multi and "LOCAL_RANK" not in os.environ):
        # accelerate's CPU launcher sets MASTER_PORT when asked for several processes but starts them only through
        # mpirun; without it this is one process, and silently training with a smaller global batch is worse.
        raise UsageError(
            "`accelerate launch --cpu --num_processes N` (N > 1) started ONE process: accelerate starts several CPU "
            "processes only through mpirun. Use `accelerate launch --config_file configuration/accelerate/cpu_2.yaml "
            "...` (torchrun + gloo), or `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`."
        )
    if accelerator.is_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    if args.torch_threads and accelerator.device.type == "cpu":
        torch.set_num_threads(args.torch_threads)
    kept = accelerator.device.type == "cpu" and not args.no_malloc_tuning and keep_freed_memory()
    line = (f"{accelerator.num_processes} process(es) [{accelerator.distributed_type.value}] on {accelerator.device}"
            + (f" ({torch.get_num_threads()} threads{', malloc keeps freed memory' if kept else ''})"
               if accelerator.device.type == "cpu" else "") + ", "
            f"mixed precision {accelerator.mixed_precision}")
    return accelerator, line
