"""Weight init after a meta-device build: the shared scheme (titan/models/common/init.py) as Llama fills it,
extended to QK-norm, the router and the experts, and to a tied output."""

import torch
from torch import nn

from titan.models.common.decoder import tie_output
from titan.models.common.init import (
    INPUT_PROJECTION_STD,
    init_moe,
    init_output,
    rebuild_rotary_table,
    residual_output_std,
)
from titan.models.qwen3.model import TransformerBlock


def init_block(block: TransformerBlock, output_std: float) -> None:
    """Input projections (and the router, and each expert's w1) at std 0.02, projections into the residual stream
    (and w3, as Llama's init has it) at output_std, norms to 1, the routing bias and token counts to 0."""
    attention = block.attention
    inputs = [attention.wq, attention.wk, attention.wv]
    outputs = [attention.wo]
    for norm in (block.attention_norm, block.ffn_norm, attention.q_norm, attention.k_norm):
        norm.reset_parameters()
    if hasattr(block, "moe"):
        init_moe(block.moe, output_std)
    else:
        inputs.append(block.feed_forward.w1)
        outputs += [block.feed_forward.w2, block.feed_forward.w3]
    for linear in inputs:
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    for linear in outputs:
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=output_std)


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a Qwen3 Transformer, or of a pipeline stage of one (absent parts are None), and
    rebuild the rotary table on buffer_device (None: where it is now). As Llama's: embeddings at std 1, the output
    at std dim**-0.5 (unit-variance logits); a tied matrix gets the output's std, which the embedding's RMSNorm'd
    consumers don't mind."""
    args = model.args
    tie_output(model)  # to_empty() untied them: one matrix to fill
    rebuild_rotary_table(model, buffer_device)
    for layer_id, block in model.layers.items():
        init_block(block, residual_output_std(args, int(layer_id)))
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.tok_embeddings is not None:
        if args.tie_embeddings:
            init_output(model.tok_embeddings.weight, args.dim)
        else:
            nn.init.normal_(model.tok_embeddings.weight)
    if model.output is not None and not args.tie_embeddings:
        init_output(model.output.weight, args.dim)
