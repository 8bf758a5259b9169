"""What the Hugging Face interop tests of every family share: loading an exported folder in transformers, and
reading a folder's safetensors files whole."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def transformers_model(folder: Path) -> torch.nn.Module:
    """The folder's model as transformers' AutoModelForCausalLM loads it, float32, eager attention, in eval mode."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors
