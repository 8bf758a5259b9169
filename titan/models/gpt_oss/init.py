"""GPT-OSS's weight init: the shared walk and block draws (titan/models/common/init.py, which zeroes every bias), then
each block's sinks at the input projections' std, as transformers initialises them."""

import torch
from torch import nn

from titan.models.common.init import INPUT_PROJECTION_STD, init_decoder, init_grouped_query_block


def init_block(block: nn.Module, output_std: float) -> None:
    init_grouped_query_block(block, output_std)
    nn.init.trunc_normal_(block.attention.sinks, mean=0.0, std=INPUT_PROJECTION_STD)


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a GPT-OSS Transformer, or of a pipeline stage of one, and rebuild its rotary table on
    buffer_device (None: where it is now)."""
    init_decoder(model, buffer_device, init_block)
