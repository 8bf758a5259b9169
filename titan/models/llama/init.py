"""Weight init after a meta-device build: `model.to_empty(device=...)` then `init_weights(model)`.

torchtitan's scheme, so loss curves compare with its runs. Every tensor is filled in place with
nn.init functions, so it works on sharded parameters and is reproducible under torch.manual_seed.
"""

import torch
from torch import nn

from titan.models.common.init import INPUT_PROJECTION_STD, init_output, rebuild_rotary_table, residual_output_std
from titan.models.llama.model import TransformerBlock


def init_block(block: TransformerBlock, output_std: float) -> None:
    """Fill one block: input projections at std 0.02, output projections at output_std, norms to 1."""
    attention, feed_forward = block.attention, block.feed_forward
    for linear in (attention.wq, attention.wk, attention.wv, feed_forward.w1):
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    for linear in (attention.wo, feed_forward.w2, feed_forward.w3):
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=output_std)
    block.attention_norm.reset_parameters()
    block.ffn_norm.reset_parameters()


def init_weights(model: nn.Module, buffer_device: torch.device | str | None = None) -> None:
    """Fill every parameter of a Transformer, or of a module holding some of its parts under the same names
    (tok_embeddings, rope, layers, norm, output; absent parts are None), and rebuild the rotary table on
    buffer_device (None: where it is now).

    Embeddings get std 1: they feed an RMSNorm, so their scale only sets the residual stream's.
    The output layer gets std dim**-0.5, so initial logits have about unit variance.
    """
    rebuild_rotary_table(model, buffer_device)
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight)
    # Keys, not positions, give the layer id: they stay the original ids even if the ModuleDict is edited.
    for layer_id, block in model.layers.items():
        init_block(block, residual_output_std(model.args, int(layer_id)))
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.output is not None:
        init_output(model.output.weight, model.args.dim)
