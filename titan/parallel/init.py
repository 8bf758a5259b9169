"""Weights that are the same whatever the parallel layout, for CPU runs."""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (TP or FSDP applied)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def needs_full_init(model: nn.Module, device: torch.device) -> bool:
    """DTensor's sharded random init only reproduces the full tensor's values with CUDA's RNG; on CPU each
    shard would draw the same numbers. There, CPU runs initialise a full copy and shard it instead."""
    return device.type == "cpu" and is_sharded(model)


def apply_full_init(model: nn.Module, build_full_model: Callable[[], nn.Module]) -> None:
    """Overwrite the sharded parameters of `model` with those of `build_full_model()` (an unsharded, already
    initialised copy), each rank keeping its own shard."""
    full = build_full_model()
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
