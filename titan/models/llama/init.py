"""Weight init after a meta-device build: `model.to_empty(device=...)` then `init_weights(model)`.

torchtitan's scheme, so loss curves compare with its runs. Every tensor is filled in place with
nn.init functions, so it works on sharded parameters and is reproducible under torch.manual_seed.
"""

import torch
from torch import nn

from titan.models.llama.args import ModelArgs
from titan.models.llama.model import TransformerBlock, precompute_rope_cache

# nn.init.trunc_normal_'s default cutoffs are +-2 in absolute value (100 std at 0.02): in practice a plain
# normal. Kept as torchtitan has it; only the output layer is truncated at 3 std.
INPUT_PROJECTION_STD = 0.02
OUTPUT_CUTOFF_STDS = 3.0


def residual_output_std(args: ModelArgs, layer_id: int) -> float:
    """Std of the projections that write into the residual stream (wo, w2), shrunk with depth so the
    residual's variance doesn't grow with the number of layers. w3 gets it too, as in torchtitan."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    return INPUT_PROJECTION_STD / (2 * depth) ** 0.5


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
    with torch.device(buffer_device or model.rope.cache.device):
        model.rope.cache = precompute_rope_cache(model.args)
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight)
    # Keys, not positions, give the layer id: they stay the original ids even if the ModuleDict is edited.
    for layer_id, block in model.layers.items():
        init_block(block, residual_output_std(model.args, int(layer_id)))
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.output is not None:
        final_std = model.args.dim**-0.5
        cutoff = OUTPUT_CUTOFF_STDS * final_std
        nn.init.trunc_normal_(model.output.weight, mean=0.0, std=final_std, a=-cutoff, b=cutoff)
