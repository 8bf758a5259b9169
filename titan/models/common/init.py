"""What every family's weight init shares: torchtitan's scheme (so loss curves compare with its runs), filled in
place with nn.init functions, so it works on sharded parameters and is reproducible under torch.manual_seed. Each
family's init.py fills its own blocks with these, in its own order of draws."""

import torch
from torch import Tensor, nn

from titan.models.common.args import DecoderArgs
from titan.models.common.rotary import precompute_rope_cache

# nn.init.trunc_normal_'s default cutoffs are +-2 in absolute value (100 std at 0.02): in practice a plain
# normal. Kept as torchtitan has it; only the output layer is truncated at 3 std.
INPUT_PROJECTION_STD = 0.02
OUTPUT_CUTOFF_STDS = 3.0


def residual_output_std(args: DecoderArgs, layer_id: int) -> float:
    """Std of the projections that write into the residual stream (wo, w2), shrunk with depth so the
    residual's variance doesn't grow with the number of layers. w3 gets it too, as in torchtitan."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    return INPUT_PROJECTION_STD / (2 * depth) ** 0.5


def rebuild_rotary_table(model: nn.Module, buffer_device: torch.device | str | None) -> None:
    """The rotary table of model.args, computed again on buffer_device (None: where it is now): to_empty() left it
    uninitialised, and a checkpoint does not carry it."""
    with torch.device(buffer_device or model.rope.cache.device):
        model.rope.cache = precompute_rope_cache(model.args)


def init_output(weight: Tensor, dim: int) -> None:
    """The output layer's weight (or a tied embedding's) at std dim**-0.5, so initial logits have about unit
    variance, truncated at OUTPUT_CUTOFF_STDS."""
    final_std = dim**-0.5
    cutoff = OUTPUT_CUTOFF_STDS * final_std
    nn.init.trunc_normal_(weight, mean=0.0, std=final_std, a=-cutoff, b=cutoff)


def init_moe(moe: nn.Module, output_std: float) -> None:
    """A mixture of experts (titan/models/common/moe.py MoE): the router and each expert's w1 at std 0.02, w2 and w3
    at output_std (as a dense feed-forward's), shared experts likewise, the routing bias and token counts to 0."""
    nn.init.trunc_normal_(moe.router.gate.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    nn.init.trunc_normal_(moe.experts.w1, mean=0.0, std=INPUT_PROJECTION_STD)
    for weight in (moe.experts.w2, moe.experts.w3):
        nn.init.trunc_normal_(weight, mean=0.0, std=output_std)
    if moe.shared_experts is not None:
        init_feed_forward(moe.shared_experts, output_std)
    moe.tokens_per_expert.zero_()
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.zero_()


def init_feed_forward(feed_forward: nn.Module, output_std: float) -> None:
    """A SwiGLU feed-forward: w1 at std 0.02, w2 and w3 at output_std, as torchtitan's Llama."""
    nn.init.trunc_normal_(feed_forward.w1.weight, mean=0.0, std=INPUT_PROJECTION_STD)
    for linear in (feed_forward.w2, feed_forward.w3):
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=output_std)
