"""Weight init after a meta-device build (`model.to_empty(device=...)`, then the family's init_weights): torchtitan's
scheme, so loss curves compare with its runs, filled in place with nn.init functions, so it works on sharded
parameters and is reproducible under torch.manual_seed. One walk over the decoder (init_decoder) serves every family;
a family gives it how to fill one block, which fixes the order of its draws."""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from titan.models.common.args import DecoderArgs
from titan.models.common.decoder import tie_output
from titan.models.common.mtp import MultiTokenPrediction

# nn.init.trunc_normal_'s default cutoffs are +-2 in absolute value (100 std at 0.02): in practice a plain
# normal. Kept as torchtitan has it; only the output layer is truncated at 3 std.
INPUT_PROJECTION_STD = 0.02
OUTPUT_CUTOFF_STDS = 3.0

BlockInit = Callable[[nn.Module, float], None]
"""Fills the projections (and experts) of one block, given the std of those that write into the residual stream."""


def residual_output_std(args: DecoderArgs, layer_id: int) -> float:
    """Std of the projections that write into the residual stream (wo, w2), shrunk with depth so the
    residual's variance doesn't grow with the number of layers. w3 gets it too, as in torchtitan."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    return INPUT_PROJECTION_STD / (2 * depth) ** 0.5


def rebuild_rotary_table(model: nn.Module, buffer_device: torch.device | str | None) -> None:
    """The rotary tables of model.args, computed again on buffer_device (None: where they are now): to_empty() left
    them uninitialised, and a checkpoint does not carry them."""
    with torch.device(buffer_device or model.rope.cache.device):
        model.rope.rebuild()


def init_output(weight: Tensor, dim: int) -> None:
    """The output layer's weight (or a tied embedding's) at std dim**-0.5, so initial logits have about unit
    variance, truncated at OUTPUT_CUTOFF_STDS."""
    final_std = dim**-0.5
    cutoff = OUTPUT_CUTOFF_STDS * final_std
    nn.init.trunc_normal_(weight, mean=0.0, std=final_std, a=-cutoff, b=cutoff)


def init_projections(inputs: list[nn.Linear], outputs: list[nn.Linear], output_std: float) -> None:
    """The input projections at std 0.02, then the projections into the residual stream (and w3, as torchtitan
    has it) at output_std, in the order given; biases, where a family has them, at 0 (no draw)."""
    for linear in inputs:
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    for linear in outputs:
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=output_std)
    for linear in inputs + outputs:
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


def init_feed_forward(feed_forward: nn.Module, output_std: float) -> None:
    """A SwiGLU feed-forward: w1 at std 0.02, w2 and w3 at output_std, as torchtitan's Llama."""
    init_projections([feed_forward.w1], [feed_forward.w2, feed_forward.w3], output_std)


def init_moe(moe: nn.Module, output_std: float) -> None:
    """A mixture of experts (titan/models/common/moe.py MoE): the router and each expert's w1 at std 0.02, w2 and w3
    at output_std (as a dense feed-forward's), shared experts likewise; the router's and experts' biases (where a
    family has them), the routing bias and the token counts to 0."""
    nn.init.trunc_normal_(moe.router.gate.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    nn.init.trunc_normal_(moe.experts.w1, mean=0.0, std=INPUT_PROJECTION_STD)
    for weight in (moe.experts.w2, moe.experts.w3):
        nn.init.trunc_normal_(weight, mean=0.0, std=output_std)
    if moe.router.gate.bias is not None:
        nn.init.zeros_(moe.router.gate.bias)
    for name in moe.experts.weight_names:
        bias = getattr(moe.experts, f"{name}_bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
    if moe.shared_experts is not None:
        init_feed_forward(moe.shared_experts, output_std)
    moe.tokens_per_expert.zero_()
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.zero_()


def init_grouped_query_block(block: nn.Module, output_std: float) -> None:
    """A block (titan/models/common/block.py) of the shared grouped-query attention, Llama's and Qwen3's order of
    draws: a mixture of experts first, then the input projections of attention and of a dense feed-forward, then
    their projections into the residual stream."""
    attention = block.attention
    inputs, outputs = [attention.wq, attention.wk, attention.wv], [attention.wo]
    if block.uses_moe:
        init_moe(block.moe, output_std)
    else:
        inputs.append(block.feed_forward.w1)
        outputs += [block.feed_forward.w2, block.feed_forward.w3]
    init_projections(inputs, outputs, output_std)


def init_embedding(model: nn.Module) -> None:
    """The token embedding at std 1: it feeds an RMSNorm, so its scale only sets the residual stream's. A tied one
    is the output's matrix too and gets the output's std, which the embedding's RMSNorm'd consumers don't mind."""
    if model.tok_embeddings is None:
        return
    if model.args.tie_embeddings:
        init_output(model.tok_embeddings.weight, model.args.dim)
    else:
        nn.init.normal_(model.tok_embeddings.weight)


def init_mtp(mtp: MultiTokenPrediction, args: DecoderArgs, init_block: BlockInit) -> None:
    """Multi-token prediction module k: its projection at std 0.02 and its block as block n_layers + k would be;
    the loss sum to 0."""
    mtp.loss_sum.zero_()
    for depth, module in mtp.depths.items():
        nn.init.trunc_normal_(module.eh_proj.weight, mean=0.0, std=INPUT_PROJECTION_STD)
        init_block(module.block, residual_output_std(args, args.n_layers + int(depth)))


def init_decoder(model: nn.Module, buffer_device: torch.device | str | None, init_block: BlockInit,
                 embedding_last: bool = False) -> None:
    """Fill every parameter of a Decoder, or of a module holding some of its parts under the same names (a pipeline
    stage; absent parts are None), and rebuild its rotary table on buffer_device (None: where it is now).

    Draws in this order: the embedding (init_embedding), each block by init_block at its layer's
    residual_output_std, the output layer at std dim**-0.5 (unit-variance logits; a tied one is the embedding's),
    and the multi-token prediction modules. embedding_last draws the embedding after the blocks instead, Qwen3's
    order, so its initial weights stay those of earlier runs. Every norm is set to 1, which draws nothing."""
    args = model.args
    tie_output(model)  # to_empty() untied them: one matrix to fill
    rebuild_rotary_table(model, buffer_device)
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.reset_parameters()
    if not embedding_last:
        init_embedding(model)
    # Keys, not positions, give the layer id: they stay the original ids even if the ModuleDict is edited.
    for layer_id, block in model.layers.items():
        init_block(block, residual_output_std(args, int(layer_id)))
    if embedding_last:
        init_embedding(model)
    if model.output is not None and not args.tie_embeddings:
        init_output(model.output.weight, args.dim)
    if model.mtp is not None:
        init_mtp(model.mtp, args, init_block)
