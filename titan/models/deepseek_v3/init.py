"""DeepSeek-V3's weight init: the shared walk (titan/models/common/init.py), torchtitan's for DeepSeek-V3, with
latent attention's projections drawn before the block's feed-forward; the multi-token prediction modules' blocks are
filled as blocks after the last."""

import torch
from torch import nn

from titan.models.common.init import init_decoder, init_feed_forward, init_moe, init_projections
from titan.models.deepseek_v3.model import TransformerBlock


def init_block(block: TransformerBlock, output_std: float) -> None:
    """Latent attention's input projections at std 0.02 and wo at output_std, then the dense feed-forward or the
    mixture of experts."""
    attention = block.attention
    queries = [attention.wq] if attention.q_lora_rank == 0 else [attention.wq_a, attention.wq_b]
    init_projections([*queries, attention.wkv_a, attention.wkv_b], [attention.wo], output_std)
    if block.uses_moe:
        init_moe(block.moe, output_std)
    else:
        init_feed_forward(block.feed_forward, output_std)


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a DeepSeek-V3 Transformer, or of a pipeline stage of one, and rebuild its rotary table
    on buffer_device (None: where it is now)."""
    init_decoder(model, buffer_device, init_block)
