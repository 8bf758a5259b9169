"""Blockwise float8 grouped matmuls for a mixture of experts' experts (--float8.recipe_name blockwise), as torchao's
`_to_fp8_blockwise_then_scaled_grouped_mm` defines them (torchao/prototype/moe_training/blockwise_fp8) with its token
groups padded: the recipe of the blockwise linears (titan/quant/float8/blockwise.py) per expert.

For one expert, out = x @ W^T with tokens x (M, K), weight W (N, K) and grad_output g (M, N):
  output       x in tiles of 1 x 128 along K, W in blocks of 128 x 128
  grad_input   g in tiles along N, W in the same blocks
  grad_weight  g and x in tiles of 128 rows down each column: each expert's block of rows is padded to a multiple
               of 128 (titan/quant/grouped.py), so no tile spans two experts.

torch has no blockwise grouped kernel, and torchao's fast one is DeepGEMM's (an optional CUDA package that Titan does
not call). So the experts always run torchao's emulated form, on every device: the float8 values dequantized to bf16
(each value times its inverse scale rounded to bf16, as torchao multiplies them) and multiplied by torch._grouped_mm
in bf16. That is slower than the bf16 experts it replaces; the conversion report says so, and the recipe is for the
numerics of DeepSeek-V3's training (the linears run natively on Hopper).
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from titan.models.common.moe import ExpertFunction, TokenCounts
from titan.quant.float8.blockwise import block_cast, dequantize_blocks, dequantize_tiles, tile_cast
from titan.quant.formats import FLOAT8_BLOCK_SIZE
from titan.quant.grouped import PaddedGroups, high_precision_grouped_mm, padded_experts

BLOCKWISE_GROUP_ALIGNMENT = FLOAT8_BLOCK_SIZE
"""Rows per token-block step: grad_weight's tiles run 128 rows down each expert's tokens."""


def tokens_in_bf16(x: Tensor, dim: int) -> Tensor:
    """x (rows, C)'s blockwise float8 values in tiles along `dim`, in bf16 as torchao's emulation multiplies them."""
    return dequantize_tiles(*tile_cast(x, dim), dim, torch.bfloat16)


def weights_in_bf16(weight: Tensor) -> Tensor:
    """The experts' weights (E, N, K) in 128 x 128 blocks of each, in bf16 as torchao's emulation multiplies them."""
    return dequantize_blocks(*block_cast(weight), torch.bfloat16)


class BlockwiseGroupedMatmul(torch.autograd.Function):
    """x (rows, K) in the padded layout @ weight (E, N, K)^T per expert block, in blockwise float8 in all three
    matmuls, the saved high-precision x and weight quantized again in backward. Products and gradients are bf16, as
    torchao's (its out_dtype); rows after the last block come out zero."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor, in_block: Tensor, token_counts: TokenCounts) -> Tensor:
        ctx.save_for_backward(x, weight, offsets, in_block)
        ctx.token_counts = token_counts
        # Contiguous (E, K, N) and (E, N, K) weights, as torchao's emulation multiplies them: the CPU kernel's
        # summation order depends on the layout.
        w_t = weights_in_bf16(weight).transpose(-2, -1).contiguous()
        return high_precision_grouped_mm(tokens_in_bf16(x, 1), w_t, offsets, token_counts).masked_fill(~in_block, 0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        x, weight, offsets, in_block = ctx.saved_tensors
        grad_input = high_precision_grouped_mm(tokens_in_bf16(grad, 1), weights_in_bf16(weight), offsets,
                                               ctx.token_counts)
        grad_weight = high_precision_grouped_mm(tokens_in_bf16(grad, 0).t(), tokens_in_bf16(x, 0), offsets,
                                                ctx.token_counts)
        return grad_input.masked_fill(~in_block, 0), grad_weight, None, None, None


@dataclass(frozen=True)
class BlockwiseExpertMatmuls:
    """The experts' matmuls in blockwise float8 grouped matmuls (titan/models/common/moe.py ExpertMatmuls)."""

    def __call__(self, x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                 token_counts: TokenCounts) -> Tensor:
        return padded_experts(x, counts, params, function, token_counts, self.grouped_mm, BLOCKWISE_GROUP_ALIGNMENT)

    def grouped_mm(self, x: Tensor, weight: Tensor, groups: PaddedGroups, token_counts: TokenCounts) -> Tensor:
        in_block = (groups.expert_of_row < weight.size(0))[:, None]  # (rows, 1)
        return BlockwiseGroupedMatmul.apply(x, weight, groups.offsets, in_block, token_counts).to(x.dtype)
