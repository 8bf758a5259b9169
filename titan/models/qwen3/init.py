"""Qwen3's weight init: the shared walk (titan/models/common/init.py) with the shared grouped-query block's draws
(the QK-norms are norms, set to 1 with the others), drawing the embedding after the blocks."""

import torch
from torch import nn

from titan.models.common.init import init_decoder, init_grouped_query_block


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a Qwen3 Transformer, or of a pipeline stage of one, and rebuild its rotary table on
    buffer_device (None: where it is now)."""
    init_decoder(model, buffer_device, init_grouped_query_block, embedding_last=True)
