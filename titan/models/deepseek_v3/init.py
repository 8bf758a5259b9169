"""Weight init after a meta-device build: the shared scheme (titan/models/common/init.py), torchtitan's for
DeepSeek-V3: projections at std 0.02, those into the residual stream (wo, w2, w3) shrunk with depth, norms to 1, the
experts as the other mixture-of-experts family's, and the multi-token prediction modules as blocks after the last."""

import torch
from torch import nn

from titan.models.common.init import (
    INPUT_PROJECTION_STD,
    init_feed_forward,
    init_moe,
    init_output,
    rebuild_rotary_table,
    residual_output_std,
)
from titan.models.deepseek_v3.model import MultiHeadLatentAttention, TransformerBlock


def init_attention(attention: MultiHeadLatentAttention, output_std: float) -> None:
    inputs = ([attention.wq] if attention.q_lora_rank == 0 else [attention.wq_a, attention.wq_b])
    for linear in (*inputs, attention.wkv_a, attention.wkv_b):
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    nn.init.trunc_normal_(attention.wo.weight, mean=0.0, std=output_std)
    attention.kv_norm.reset_parameters()
    if attention.q_lora_rank > 0:
        attention.q_norm.reset_parameters()


def init_block(block: TransformerBlock, output_std: float) -> None:
    init_attention(block.attention, output_std)
    block.attention_norm.reset_parameters()
    block.ffn_norm.reset_parameters()
    if hasattr(block, "moe"):
        init_moe(block.moe, output_std)
    else:
        init_feed_forward(block.feed_forward, output_std)


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a DeepSeek-V3 Transformer, or of a pipeline stage of one (absent parts are None), and
    rebuild the rotary table on buffer_device (None: where it is now). MTP module k's block is initialised as block
    n_layers + k would be."""
    args = model.args
    rebuild_rotary_table(model, buffer_device)
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight)
    for layer_id, block in model.layers.items():
        init_block(block, residual_output_std(args, int(layer_id)))
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.output is not None:
        init_output(model.output.weight, args.dim)
    if model.mtp is not None:
        model.mtp.loss_sum.zero_()
        for depth, module in model.mtp.depths.items():
            for norm in (module.enorm, module.hnorm, module.norm):
                norm.reset_parameters()
            nn.init.trunc_normal_(module.eh_proj.weight, mean=0.0, std=INPUT_PROJECTION_STD)
            init_block(module.block, residual_output_std(args, args.n_layers + int(depth)))
