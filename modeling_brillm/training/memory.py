"""Training memory: the estimate of what one process needs, what is available, the check run before the model is
allocated, the step's memory on a GPU, and glibc malloc tuning for the CPU path."""

import ctypes
import os
from typing import Callable

import psutil
import torch

from modeling_brillm.backend import HAVE_TRITON, current_backend
from modeling_brillm.sharding import sharded_memory

from .errors import UsageError
from .fsdp import is_fsdp

MEMORY_ENV = "BRILLM_AVAILABLE_MEMORY_GB"  # pretend this much memory is available (tests, containers)
# Upper estimates of a step's activations: the recipe's step on the torch path (readout and count prior on) stays below
LOGIT_COPIES = 6  # (tokens, V) float32 tensors alive at the step's peak: logits, readout, prior, softmax, gradients
CANDIDATE_COPIES = 4  # (candidates, d) float32 buffers of the torch path's candidate energies and their gradients


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def whole_model_bytes(config) -> float:
    """The float32 weights of the whole model, +10%: what a process needs to build it before sharding it."""
    return 4 * config.num_parameters_formula() * 1.1


def training_memory(num_params: int, strategy: str = "single", world_size: int = 1,
                    mixed_precision: str = "no", moment_bytes: int = 8) -> dict:
    """Bytes one process needs to train `num_params` fp32 parameters with AdamW, +10%; FSDP shards them over
    `world_size` and gathers the whole table's parameters and gradients (BriLLM is one module) in the compute dtype."""
    if strategy == "fsdp":
        width = 2 if mixed_precision in ("fp16", "bf16") else 4
        parts = {"sharded params+grads+AdamW": (8 + moment_bytes) * num_params / max(world_size, 1),
                 "gathered params+grads": 2 * width * num_params}
    else:
        parts = {"params": 4 * num_params, "grads": 4 * num_params, "AdamW moments": moment_bytes * num_params}
        if strategy == "ddp":
            parts["DDP buckets"] = 4 * num_params
    return {"total": sum(parts.values()) * 1.1, "parts": parts}


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory: a step frees and allocates the same large temporaries, each above the mmap
    threshold a fresh mmap page-faulted in again (~40% of the demo's wall time in the kernel). Linux only."""
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's: elsewhere an OSError
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def available_memory(accelerator, override_gb: float | None) -> tuple[float, str]:
    """(bytes this process may use, where the figure comes from)."""
    if override_gb is None and os.environ.get(MEMORY_ENV):
        try:
            override_gb = float(os.environ[MEMORY_ENV])
        except ValueError:
            raise UsageError(f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r} is not a number of GB.") from None
    if override_gb is not None:
        return override_gb * 1024 ** 3, "set by --available_memory_gb / " + MEMORY_ENV
    if accelerator.device.type == "cuda":
        return float(torch.cuda.mem_get_info(accelerator.device)[0]), \
            f"free memory of {torch.cuda.get_device_name(accelerator.device)}"
    avail = float(psutil.virtual_memory().available)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes or 1))
    if local > 1:
        return avail / local, f"available RAM (psutil) shared by {local} processes on this machine"
    return avail, "available RAM (psutil)"


def state_memory(config, accelerator, args, tokens: int | None = None) -> dict:
    """This run's `training_memory`, or by source `sharding.sharded_memory` +10% (`tokens` per process: batch x T)."""
    strategy = "fsdp" if is_fsdp(accelerator) else ("ddp" if accelerator.num_processes > 1 else "single")
    moment_bytes = 4 if getattr(args, "moment_dtype", "float32") == "bfloat16" else 8
    if getattr(args, "edge_sharding", "none") == "source":
        tokens = args.per_device_train_batch_size * args.block_size if tokens is None else tokens
        W = accelerator.num_processes
        parts = sharded_memory(config, W, global_tokens=tokens * W, moment_bytes=moment_bytes)
        parts.pop("total")
        return {"total": sum(parts.values()) * 1.1, "parts": parts}
    return training_memory(config.num_parameters_formula(), strategy, accelerator.num_processes,
                           accelerator.mixed_precision, moment_bytes)


def check_memory(config, accelerator, args) -> str:
    """Refuse (UsageError) a model whose training state cannot fit; return a line describing the estimate."""
    need = state_memory(config, accelerator, args)
    have, source = available_memory(accelerator, args.available_memory_gb)
    have = agreed_free(accelerator, have)
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need["parts"].items())
    if need["total"] > have:
        what = "dense" if config.graph == "dense" else f"sparse ({config.num_edges:,} real edges)"
        raise UsageError(
            f"refusing to build the model: the {what} graph with V={config.vocab_size}, d={config.node_size} has "
            f"{config.num_parameters_formula():,} parameters and training it needs about {human_bytes(need['total'])} "
            f"per process ({parts}), but only {human_bytes(have)} is available ({source}). Use a sparse graph (drop "
            "--dense_graph) and raise --min_bigram_count to keep only frequent bigrams, or lower --node_size / "
            "--vocab_size, or shard the edge table over processes by source node (--edge_sharding source, "
            "configuration/accelerate/gpu8_sharded.yaml) or the model with FSDP (gpu8_fsdp.yaml).")
    return (f"training memory estimate: {human_bytes(need['total'])} per process ({parts}, +10%); available: "
            f"{human_bytes(have)} ({source})")


# ------------------------------------------------------------------------------- the step's memory on a device
def device_facts(device) -> tuple[str, float | None]:
    """(the device's type, the bytes free on it, counting what torch's allocator holds unused; None off CUDA)."""
    if device.type != "cuda":
        return device.type, None
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return "cuda", float(torch.cuda.mem_get_info(device)[0] + unused)


def successors_per_token(config, graph=None) -> float:
    """The successors a training token's source scores, averaged over tokens (the degree weighted by the bigram
    counts; V on a dense graph; the mean degree without counts)."""
    V = config.vocab_size
    if config.graph == "dense":
        return float(V)
    if graph is None or int(graph.counts.sum()) == 0:
        return max(1.0, config.num_edges / max(V, 1))
    degree = (graph.indptr[1:] - graph.indptr[:-1]).double()
    tokens = torch.zeros(V, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(V), degree.long()), graph.counts.double())
    return float((tokens * degree).sum() / tokens.sum())


def step_memory(config, graph, accelerator, args) -> Callable[[int], float]:
    """blocks -> the bytes one process needs to train a batch of `blocks`: the state, plus per token (an upper estimate
    of the exact loss) its logits, its source's candidate energies and the edge row it crosses, with their gradients."""
    kernels = accelerator.device.type == "cuda" and HAVE_TRITON and current_backend() != "torch"
    d, candidates = config.node_size, successors_per_token(config, graph)
    per_token = 4 * LOGIT_COPIES * config.vocab_size + 4 * candidates * (2 if kernels else CANDIDATE_COPIES * d) \
        + 2 * 4 * (d * d + d)
    sharded = getattr(args, "edge_sharding", "none") == "source"

    def need(blocks: int) -> float:
        tokens = blocks * args.block_size
        return state_memory(config, accelerator, args, tokens)["total"] + (0.0 if sharded else 1.1 * tokens * per_token)

    return need


def agreed_free(accelerator, free: float | None) -> float | None:
    """The least free memory over the processes, so that every process decides the same (the batch, the path)."""
    if free is None or accelerator.num_processes == 1:
        return free
    return float(accelerator.gather(torch.tensor([free], dtype=torch.float64, device=accelerator.device)).min())
