"""Dtype names as the config spells them, mapped to torch dtypes."""

import torch

from titan.config.job import DTypeName

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def to_dtype(name: DTypeName) -> torch.dtype:
    """torch dtype for a config dtype name such as --training.mixed_precision_param."""
    return DTYPES[name]
