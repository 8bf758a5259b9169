"""Llama 3's weight init: the shared walk (titan/models/common/init.py) with the shared grouped-query block's
draws."""

import torch
from torch import nn

from titan.models.common.init import init_decoder, init_grouped_query_block


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a Llama Transformer, or of a pipeline stage of one, and rebuild its rotary table on
    buffer_device (None: where it is now)."""
    init_decoder(model, buffer_device, init_grouped_query_block)
