"""The accelerator of a training run and the checks on how it was launched."""

import os

import accelerate
import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed

from .errors import UsageError
from .fsdp import FSDP_ENV, fsdp_on_cpu, is_fsdp, truthy
from .memory import keep_freed_memory


def launch_on_cpu(environ=os.environ, gpus: int | None = None) -> bool:
    """Whether a multi-process launch trains on the CPU: `ACCELERATE_USE_CPU`, or a config that hides every GPU
    (cpu_2.yaml). A GPU launch of more processes on this machine than visible GPUs is refused before any work."""
    if truthy(environ.get("ACCELERATE_USE_CPU")):
        return True
    if gpus is None:  # torch's current accelerator type
        gpus = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if gpus == 0 and hidden is not None:
        return True  # the launch hid the GPUs on purpose
    local = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE") or 1)
    if local > gpus:
        seen = "no GPU is visible" if gpus == 0 else f"only {gpus} GPU{'s are' if gpus > 1 else ' is'} visible"
        fix = f"launch at most {gpus} process{'es' if gpus > 1 else ''} (--num_processes {gpus}), or " if gpus else ""
        raise UsageError(
            f"this launch asks for GPUs, one per process, and starts {local} processes on this machine, but {seen}"
            f"{f' (CUDA_VISIBLE_DEVICES={hidden})' if hidden is not None else ''}: {fix}train on the CPU with "
            "`accelerate launch --config_file configuration/accelerate/cpu_2.yaml` (or ACCELERATE_USE_CPU=1).")
    return False


# fsdp_config settings that the CPU path (fsdp.prepare_on_cpu) cannot honour: (variable, refused value, why)
CPU_FSDP_LIMITS = (
    ("FSDP_VERSION", lambda v: v != "2", "fsdp_version must be 2 (torch's fully_shard)"),
    ("FSDP_STATE_DICT_TYPE", lambda v: v.upper() != "SHARDED_STATE_DICT",
     "fsdp_state_dict_type must be SHARDED_STATE_DICT (accelerate restores a full one on rank 0 only under FSDP "
     "proper)"),
    ("FSDP_OFFLOAD_PARAMS", truthy, "fsdp_offload_params must be false (the parameters are in host memory already)"),
    ("FSDP_ACTIVATION_CHECKPOINTING", truthy, "fsdp_activation_checkpointing must be false (BriLLM has no layers "
     "to checkpoint)"),
    ("FSDP_CPU_RAM_EFFICIENT_LOADING", truthy, "fsdp_cpu_ram_efficient_loading must be false (every process builds "
     "the model)"),
)


def fsdp_not_formed(accelerator, environ=os.environ, shards_on_cpu: bool = False) -> str | None:
    """The error when the launch asked for FSDP but no FSDP run can follow: accelerate forms FSDP only on GPUs; on the
    CPU a script that shards the model itself (`shards_on_cpu`) runs FSDP2, any other would silently train as DDP."""
    kind = accelerator.distributed_type.value
    if not truthy(environ.get(FSDP_ENV)) or kind == "FSDP":
        return None
    formed = (f"this launch asks for FSDP (distributed_type: FSDP) but accelerate {accelerate.__version__} formed a "
              f"{kind} run on {accelerator.device.type}")
    if kind == "MULTI_CPU" and shards_on_cpu:
        wrong = [why for name, refused, why in CPU_FSDP_LIMITS if refused(environ.get(name, ""))]
        return None if not wrong else (
            f"{formed}, where this script shards the model itself with torch's FSDP2, which needs: {'; '.join(wrong)}. "
            "Fix the launch config (configuration/accelerate/cpu_2_fsdp.yaml has them).")
    if kind == "MULTI_CPU":
        return (f"{formed}: accelerate shards with FSDP only on GPUs, and this script does not shard the model itself "
                "on the CPU (examples/pretrain.py does), so it would train as plain DDP. Launch FSDP on GPUs "
                "(configuration/accelerate/gpu8_fsdp.yaml), or train data parallel on the CPU with "
                "configuration/accelerate/cpu_2.yaml.")
    if accelerator.num_processes == 1:
        return (f"{formed}: FSDP shards over several processes, and this launch started one. Set num_processes to 2 "
                "or more (configuration/accelerate/cpu_2_fsdp.yaml), or train one process without FSDP "
                "(configuration/accelerate/cpu_1.yaml).")
    return (f"{formed}, which does not shard the model. Launch FSDP on GPUs (configuration/accelerate/gpu8_fsdp.yaml) "
            "or on the CPU (configuration/accelerate/cpu_2_fsdp.yaml).")


def make_accelerator(args, shards_on_cpu: bool = False):
    """(the Accelerator of a training script, its start-up line); `shards_on_cpu`: the script runs FSDP on the CPU."""
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a CPU launch of several needs cpu=True, else independent runs
    accelerator = Accelerator(
        cpu=multi and launch_on_cpu(),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,  # stepped by hand, once per optimizer step, whatever the processes
        log_with=args.report_to if args.with_tracking else None, project_dir=args.output_dir)
    if multi and accelerator.num_processes == 1:
        raise UsageError("WORLD_SIZE > 1 but accelerate did not form a process group.")
    if truthy(os.environ.get("ACCELERATE_USE_CPU")) and os.environ.get("MASTER_PORT") and not multi \
            and "LOCAL_RANK" not in os.environ:  # accelerate's --cpu launcher starts several processes only via mpirun
        raise UsageError(
            "`accelerate launch --cpu --num_processes N` (N > 1) started ONE process: accelerate starts several CPU "
            "processes only through mpirun. Use `accelerate launch --config_file configuration/accelerate/cpu_2.yaml "
            "...` (torchrun + gloo), or `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`.")
    error = fsdp_not_formed(accelerator, shards_on_cpu=shards_on_cpu)
    if error:
        raise UsageError(error)
    for library in (datasets.utils.logging, transformers.utils.logging):
        (library.set_verbosity_warning if accelerator.is_main_process else library.set_verbosity_error)()
    if not accelerator.is_main_process:
        datasets.disable_progress_bars()
    set_seed(args.seed)
    cpu = accelerator.device.type == "cpu"
    if args.torch_threads and cpu:
        torch.set_num_threads(args.torch_threads)
    kept = cpu and not args.no_malloc_tuning and keep_freed_memory()
    kind = "MULTI_CPU, sharded by the script with torch's FSDP2" if fsdp_on_cpu(accelerator) else \
        accelerator.distributed_type.value
    line = (f"{accelerator.num_processes} process(es) [{kind}] on {accelerator.device}"
            + (f" ({torch.get_num_threads()} threads{', malloc keeps freed memory' if kept else ''})" if cpu else "")
            + f", mixed precision {accelerator.mixed_precision}")
    if accelerator.mixed_precision in ("bf16", "fp16") and not is_fsdp(accelerator):  # FSDP casts the gathered weights
        line += " (autocast does not reach BriLLM's float32 math: see docs/gpu.md, 'Mixed precision')"
    return accelerator, line
