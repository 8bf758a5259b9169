"""Materialise and initialise the weights: this rank's parts of a model built on meta and already parallelized get
storage on the device, then the family's init from the seed. The weights are the same whatever the parallel layout:
where sharded or staged random init cannot give them, each rank keeps its share of a full copy. The build
(titan/train/build.py) calls init_weights, or allocate_weights where a dry run wants storage only."""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from titan.config.errors import ConfigError
from titan.metrics.log import logger
from titan.models.common.decoder import tie_output
from titan.models.common.family import ModelFamily
from titan.parallel.ac import model_fqn


def init_weights(parts: list[nn.Module], family: ModelFamily, args: object, num_params: int, device: torch.device,
                 seed: int, pipelined: bool, cpu_offload: bool) -> None:
    """Materialise this rank's `parts` (its pipeline stages, or the whole model; possibly sharded) of a model of
    `num_params` on the device and initialise them from the seed, with a single process's weights wherever a full
    copy fits (needs_full_init)."""
    if needs_full_init(parts[0], pipelined, cpu_offload):
        if full_copy_fits(num_params, device):
            full = build_full_model(family, args, device, seed)
            for part in parts:
                apply_to_empty(part, device, cpu_offload)
                tie_output(part)
                apply_full_init(part, full)
            return
        if cpu_offload:
            raise ConfigError(f"--training.enable_cpu_offload initialises the weights from a float32 copy of the "
                              f"whole model on the GPU ({num_params * 4 / 2**30:.1f} GiB), so that the shards in host "
                              f"memory get a single process's values, and it does not fit the GPU's free memory. "
                              f"Train this model without offload, on more GPUs "
                              f"(--parallelism.data_parallel_shard_degree).")
        # A model too large for one device: pipeline stages draw from streams of their own (the seed and their first
        # block), so no two stages share random numbers; sharded parameters draw from DTensor's RNG tracker. Either
        # way the weights are the seed's, but not a single process's, and another layout gets others.
        logger.info(f"The whole model ({num_params * 4 / 2**30:.1f} GiB in float32) does not fit this device's free "
                    f"memory to initialise a single process's weights from: each "
                    f"{'pipeline stage' if pipelined else 'shard'} initialises from the seed by itself, so the "
                    f"weights depend on the parallel layout.")
    for part in parts:
        if pipelined:
            torch.manual_seed(seed + first_block(part))
        materialize(family, part, device)


def allocate_weights(parts: list[nn.Module], device: torch.device, cpu_offload: bool) -> None:
    """Give this rank's parts storage only, no values: for fake tensors, which trunc_normal_ cannot read."""
    for part in parts:
        apply_to_empty(part, device, cpu_offload)


def apply_to_empty(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Allocate the storage of a meta-built (and sharded) model, uninitialised, on `device`; under `cpu_offload`
    its parameters in host memory instead, where FSDP's first forward checks they are (a DTensor keeps the device it
    was made on, so FSDP moving the local shards there itself does not pass), and its buffers, which forward reads on
    the device, on the device."""
    if not cpu_offload:
        model.to_empty(device=device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))


def materialize(family: ModelFamily, model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-built model on the device and fill it with the family's init_weights."""
    model.to_empty(device=device)
    with torch.no_grad():
        family.init_weights(model, device)


def build_full_model(family: ModelFamily, args: object, device: torch.device, seed: int) -> nn.Module:
    """An unsharded copy initialised exactly as a single process would initialise it."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        full = family.model(args)
    materialize(family, full, device)
    return full


def first_block(part: nn.Module) -> int:
    """The id of a pipeline stage's first transformer block (0 for the first stage, or one without blocks)."""
    return min((int(layer_id) for layer_id in part.layers), default=0)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (TP or FSDP applied)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def needs_full_init(model: nn.Module, pipelined: bool, cpu_offload: bool) -> bool:
    """Whether `model` (this rank's part) must keep its share of a full, unsharded copy initialised from the seed to
    get the weights a single process gets. No sharded or staged random init gives them:
    - on the CPU every shard draws the same numbers;
    - on CUDA, DTensor's random ops draw from an RNG tracker of their own (a synchronised seed and offsets per
      shard), not from the stream a single process reads: scripts/gpu_check.py saw FSDP over one H100 start at loss
      8.2060 where the same seed without FSDP starts at 8.2329;
    - under CPU offload the shards are in host memory when the weights are initialised;
    - a pipeline stage initialises only its own layers from the seed, so its first layer draws the numbers the
      embedding draws in a single process.
    The copy is the whole model in float32 on the device, once per rank, while the weights are initialised
    (full_copy_fits)."""
    return pipelined or cpu_offload or is_sharded(model)


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the tensors of a full, unsharded state dict into `model`, the whole model or a pipeline rank's share of
    it: each rank takes the entries its parameters have, and keeps its own shard of each."""
    own = get_model_state_dict(model).keys()
    set_model_state_dict(model, {fqn: state[fqn] for fqn in own if fqn in state},
                         options=StateDictOptions(full_state_dict=True))


def apply_full_init(model: nn.Module, full: nn.Module) -> None:
    """Fill `model`, the whole model or a pipeline stage of it, just materialised with to_empty, from `full` (an
    unsharded, already initialised copy): each rank keeps its own shard of every parameter, and every buffer is
    copied whole from the one of the same model FQN. That covers the buffers no state dict carries (the rotary table,
    a mixture of experts' token counts), which would otherwise keep whatever memory to_empty() gave them. No random
    op runs on the sharded parameters, which DTensor on CPU would warn about."""
    load_full_state_dict(model, full.state_dict())
    reference = dict(full.named_buffers())
    # The rank's names carry the wrappers of the stages applied since the build (activation checkpointing's).
    missing = [name for name, _ in model.named_buffers() if model_fqn(name) not in reference]
    if missing:
        raise RuntimeError(f"Buffers {missing} have no counterpart in the unsharded model, so they would keep "
                           f"uninitialised memory: a stage renamed them in a way model_fqn does not undo.")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(reference[model_fqn(name)])


def full_copy_fits(num_params: int, device: torch.device) -> bool:
    """Whether a float32 copy of a model of `num_params` fits in the device's free memory (always on a CPU, whose
    runs are small models), with 10% to spare for the allocator."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_params * 4 * 1.1 <= free
