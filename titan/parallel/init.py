"""Weights that are the same whatever the parallel layout: where sharded random init cannot give them, each rank keeps
its share of a full copy."""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from titan.parallel.ac import model_fqn


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
