"""Weights that are the same whatever the parallel layout, for CPU runs."""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (TP or FSDP applied)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def needs_full_init(model: nn.Module, device: torch.device, pipelined: bool) -> bool:
    """DTensor's sharded random init only reproduces the full tensor's values with CUDA's RNG; on CPU each
    shard would draw the same numbers, and a pipeline stage would draw the first numbers of the seed's stream,
    not its own layers'. There, CPU runs initialise a full copy and keep their part of it instead."""
    return device.type == "cpu" and (pipelined or is_sharded(model))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the tensors of a full, unsharded state dict into `model`, the whole model or a pipeline rank's share of
    it: each rank takes the entries its parameters have, and keeps its own shard of each."""
    own = get_model_state_dict(model).keys()
    set_model_state_dict(model, {fqn: state[fqn] for fqn in own if fqn in state},
                         options=StateDictOptions(full_state_dict=True))


def apply_full_init(model: nn.Module, full: nn.Module) -> None:
    """Fill `model`, the whole model or a pipeline stage of it, just materialised with to_empty, from `full` (an
    unsharded, already initialised copy): each rank keeps its own shard of every parameter, and buffers of the same
    name (the rotary table) are copied whole. No random op runs on the sharded parameters, which DTensor on CPU
    would warn about."""
    load_full_state_dict(model, full.state_dict())
    own_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, buffer in full.named_buffers():
            if name in own_buffers:
                own_buffers[name].copy_(buffer)
