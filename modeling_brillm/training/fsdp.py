"""FSDP2 for pretraining: accelerate's on GPUs; on the CPU, where accelerate forms a MULTI_CPU run, `prepare_on_cpu`
shards the model with the pieces accelerate's FSDP2 is made of (configuration/README.md, "FSDP on the CPU")."""

import contextlib
import os

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import FullyShardedDataParallelPlugin, fsdp_utils
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

FSDP_ENV = "ACCELERATE_USE_FSDP"


def truthy(value: str | None) -> bool:
    """An environment flag as `accelerate launch` writes it ("true", "1", ...) read as a bool."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def fsdp_on_cpu(accelerator) -> bool:
    """The launch asked for FSDP and accelerate formed a multi-process CPU run: the script shards the model."""
    return truthy(os.environ.get(FSDP_ENV)) and accelerator.distributed_type.value == "MULTI_CPU"


def is_fsdp(accelerator) -> bool:
    """The model is (or will be) sharded with FSDP: by accelerate (GPUs) or by `prepare_on_cpu`."""
    return accelerator.distributed_type.value == "FSDP" or fsdp_on_cpu(accelerator)


def shard_model(model, plugin, num_processes: int):
    """`fully_shard` the modules the plugin's wrap policy picks (none under NO_WRAP), then the whole model, over a
    CPU mesh of `num_processes`, as accelerate's `fsdp2_prepare_model` does on GPUs; in place."""
    from accelerate.utils.other import get_module_children_bottom_up  # here: accelerate 1.3, the floor, lacks it

    mesh = init_device_mesh("cpu", (num_processes,))
    kwargs = dict(mesh=mesh, mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    plugin.set_auto_wrap_policy(model)
    policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and not isinstance(module, FSDPModule):
                fully_shard(module, reshard_after_forward=plugin.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the root: torch's default keeps its parameters gathered between forward and backward
    return model


def prepare_on_cpu(accelerator, model, make_optimizer, train_loader, eval_loader=None):
    """(model sharded with FSDP2 on the CPU, `make_optimizer(model)` over its shards, the prepared loaders)."""
    plugin = FullyShardedDataParallelPlugin()  # the launch's fsdp_config, from the FSDP_* variables
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    shard_model(model, plugin, accelerator.num_processes)
    held = sum(p.to_local().numel() for p in model.parameters())
    accelerator.print(f"FSDP2 on the CPU (torch's fully_shard over {accelerator.num_processes} processes): the main "
                      f"process holds {held:,} of the {sum(p.numel() for p in model.parameters()):,} parameters")
    optimizer = AcceleratedOptimizer(make_optimizer(model), device_placement=False)
    hook_checkpoints(accelerator, plugin, model, optimizer.optimizer)
    return (model, optimizer, *accelerator.prepare(train_loader, eval_loader))  # a None eval_loader stays None


def hook_checkpoints(accelerator, plugin, model, optimizer):
    """`save_state` / `load_state` also save / restore the sharded model and optimizer (accelerate's FSDP functions)."""
    def save(_models, _weights, output_dir):
        reshard(model)
        fsdp_utils.save_fsdp_model(plugin, accelerator, model, output_dir)
        fsdp_utils.save_fsdp_optimizer(plugin, accelerator, optimizer, model, output_dir)

    def load(_models, input_dir):
        reshard(model)
        fsdp_utils.load_fsdp_model(plugin, accelerator, model, input_dir)
        fsdp_utils.load_fsdp_optimizer(plugin, accelerator, optimizer, model, input_dir)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def reshard(model):
    """Shard again what FSDP2 left gathered after a forward without backward: the state-dict functions want shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(accelerator, model) -> dict:
    """The whole model's weights on the main process (under FSDP an empty dict elsewhere; call on every process)."""
    if not isinstance(model, FSDPModule):
        return accelerator.get_state_dict(model)
    reshard(model)  # then as accelerate's get_state_dict under FSDP2
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                cpu_offload=True))


@contextlib.contextmanager
def own_class(model):
    """The model shown as its own class while transformers saves it: `fully_shard` makes it torch's FSDP<Name>,
    whose module `save_pretrained` would otherwise copy as the model's remote code."""
    sharded = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(c for c in sharded.__mro__ if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = sharded
