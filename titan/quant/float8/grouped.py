"""Float8 grouped matmuls for a mixture of experts' experts, as torchao's float8 rowwise grouped recipe defines them
(torchao/prototype/moe_training/fp8_grouped_mm.py), with tensorwise and rowwise_with_gw_hp beside it.

For one expert, out = x @ W^T with tokens x (M, K), weight W (N, K) and grad_output g (M, N); over the experts the
weights are stacked (E, N, K) and x holds every expert's block of rows (titan/quant/grouped.py pads the blocks).
  output       x @ W^T   contracts K
  grad_input   g @ W     contracts N
  grad_weight  g^T @ x   contracts each expert's own rows
Each operand is cast as the recipe's table says (titan/quant/float8/linear.py): an axiswise token operand gets a
scale per row along the contraction dim (per column within each expert's rows in grad_weight), a tensorwise one a
single scale for all tokens; an axiswise weight a scale per row of each expert along the contraction dim, a
tensorwise one a scale per expert. Every operand is E4M3: torch._scaled_grouped_mm takes no E5M2.

Native: torch._scaled_grouped_mm (CUDA, Hopper and newer), which writes bf16. Emulated: the same float8 values,
dequantized and multiplied in fp32.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from titan.models.common.moe import ExpertFunction, TokenCounts
from titan.quant.float8.casts import amax_to_scale, cast_to_float8, dequantize, rowwise_cast, tensorwise_cast
from titan.quant.float8.linear import RECIPES, TENSORWISE_E4M3, OperandCast, Recipe
from titan.quant.grouped import PaddedGroups, high_precision_grouped_mm, padded_experts

FLOAT8_GROUP_ALIGNMENT = 16
"""Rows per token-block step: torch._scaled_grouped_mm's float8 kernels need each expert's block of rows (the
contraction dim of grad_weight) to be a multiple of 16."""

# The experts' form of each --float8.recipe_name. rowwise is torchao's Float8TrainingRecipe.FP8_ROWWISE (E4M3,
# power-of-2 scales, every matmul), which is the dense rowwise recipe; rowwise_with_gw_hp is the dense recipe too;
# tensorwise keeps the dense recipe's granularity with E4M3 gradients, since the grouped kernel takes E4M3 only.
EXPERT_RECIPES = {
    "tensorwise": Recipe("tensorwise",
                         output=(TENSORWISE_E4M3, TENSORWISE_E4M3),
                         grad_input=(TENSORWISE_E4M3, TENSORWISE_E4M3),
                         grad_weight=(TENSORWISE_E4M3, TENSORWISE_E4M3)),
    "rowwise": RECIPES["rowwise"],
    "rowwise_with_gw_hp": RECIPES["rowwise_with_gw_hp"],
}


def cast_tokens(x: Tensor, cast: OperandCast) -> tuple[Tensor, Tensor]:
    """Token rows x (rows, C) contracted along C: (data, scale (rows, 1) axiswise or 0-dim tensorwise)."""
    if cast.granularity == "tensorwise":
        return tensorwise_cast(x, cast.dtype, cast.power_of_2)
    return rowwise_cast(x, cast.dtype, -1, cast.power_of_2)


def cast_weights(weight: Tensor, cast: OperandCast, contraction_dim: int) -> tuple[Tensor, Tensor]:
    """Stacked weights (E, N, K) contracted along `contraction_dim` (-1: K, -2: N): (data, scale with the weight's
    shape and the contraction dim set to 1 when axiswise, (E, 1, 1) when tensorwise: one scale per expert)."""
    if cast.granularity == "tensorwise":
        amax = weight.float().abs().amax(dim=(-2, -1), keepdim=True)  # (E, 1, 1)
        scale = amax_to_scale(amax, cast.dtype, cast.power_of_2)
        return cast_to_float8(weight, cast.dtype, scale), scale
    return rowwise_cast(weight, cast.dtype, contraction_dim, cast.power_of_2)


def cast_expert_columns(x: Tensor, cast: OperandCast, expert_of_row: Tensor,
                        num_experts: int) -> tuple[Tensor, Tensor]:
    """Token rows x (rows, C) contracted along the rows of each expert's block (grad_weight): (data, scale
    (experts, C) axiswise, one per column of each expert's rows, or 0-dim tensorwise). An expert without rows gets
    the scale of an all-zero column."""
    if cast.granularity == "tensorwise":
        return tensorwise_cast(x, cast.dtype, cast.power_of_2)
    x_fp32 = x.float()
    index = expert_of_row[:, None].expand_as(x_fp32)  # (rows, C); rows after the last block go to row `num_experts`
    amax = x_fp32.new_zeros(num_experts + 1, x.size(1)).scatter_reduce_(0, index, x_fp32.abs(), "amax")
    scale = amax_to_scale(amax[:num_experts], cast.dtype, cast.power_of_2)  # (experts, C)
    return cast_to_float8(x_fp32, cast.dtype, scale_of_rows(scale, expert_of_row)), scale


def row_scales(scale: Tensor, rows: int) -> Tensor:
    """A token operand's scale as the kernel takes it: (rows,)."""
    return scale.expand(rows, 1).reshape(rows)


def expert_scales(scale: Tensor, num_experts: int, size: int) -> Tensor:
    """A weight's (or grad_weight's) scale as the kernel takes it, one per expert and column: (experts, size) from a
    per-expert (E, 1, 1), per-row (E, size, 1) or (E, 1, size), per-column (E, size) or 0-dim scale."""
    if scale.dim() > 0:
        scale = scale.reshape(num_experts, -1)  # (E, 1) or (E, size)
    return scale.expand(num_experts, size).contiguous()


def scale_of_rows(scale: Tensor, expert_of_row: Tensor) -> Tensor:
    """A grad_weight operand's scale broadcast to its rows: (rows, C) from per-expert columns (E, C), or 0-dim. Rows
    after the last block (expert E) hold zeros; they take a scale of 1."""
    if scale.dim() == 0:
        return scale
    return torch.cat([scale, scale.new_ones(1, scale.size(1))])[expert_of_row]


def native_grouped_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor) -> Tensor:
    """torch._scaled_grouped_mm with the reciprocal (dequantizing) scales it takes; a row-major, b column-major."""
    return torch._scaled_grouped_mm(a, b, a_scale.reciprocal(), b_scale.reciprocal(), offs=offsets,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)


def forward_mm(x: Tensor, weight: Tensor, offsets: Tensor, recipe: Recipe, emulate: bool,
               token_counts: TokenCounts) -> Tensor:
    """x (rows, K) @ weight (E, N, K)^T per expert block -> (rows, N), as float32 (emulated) or bf16 (native)."""
    (x_data, x_scale), (w_data, w_scale) = cast_tokens(x, recipe.output[0]), cast_weights(weight, recipe.output[1], -1)
    if emulate:
        return high_precision_grouped_mm(dequantize(x_data, x_scale), dequantize(w_data, w_scale).transpose(-2, -1),
                                         offsets, token_counts)
    num_experts, n, _ = weight.shape
    return native_grouped_mm(x_data, row_scales(x_scale, x.size(0)), w_data.transpose(-2, -1),
                             expert_scales(w_scale, num_experts, n), offsets)


def grad_input_mm(grad: Tensor, weight: Tensor, offsets: Tensor, recipe: Recipe, emulate: bool,
                  token_counts: TokenCounts) -> Tensor:
    """grad (rows, N) @ weight (E, N, K) per expert block -> (rows, K)."""
    (g_data, g_scale) = cast_tokens(grad, recipe.grad_input[0])
    (w_data, w_scale) = cast_weights(weight, recipe.grad_input[1], -2)
    if emulate:
        return high_precision_grouped_mm(dequantize(g_data, g_scale), dequantize(w_data, w_scale), offsets,
                                         token_counts)
    num_experts, _, k = weight.shape
    w_column_major = w_data.transpose(-2, -1).contiguous().transpose(-2, -1)  # (E, N, K), strides (N K, 1, N)
    return native_grouped_mm(g_data, row_scales(g_scale, grad.size(0)), w_column_major,
                             expert_scales(w_scale, num_experts, k), offsets)


def grad_weight_mm(grad: Tensor, x: Tensor, groups: tuple[Tensor, Tensor], num_experts: int, recipe: Recipe,
                   emulate: bool, token_counts: TokenCounts) -> Tensor:
    """grad^T (N, rows) @ x (rows, K) over each expert's block of rows -> (E, N, K)."""
    offsets, expert_of_row = groups
    if recipe.grad_weight is None:
        return high_precision_grouped_mm(grad.t(), x, offsets, token_counts)
    g_data, g_scale = cast_expert_columns(grad, recipe.grad_weight[0], expert_of_row, num_experts)
    x_data, x_scale = cast_expert_columns(x, recipe.grad_weight[1], expert_of_row, num_experts)
    if emulate:
        return high_precision_grouped_mm(dequantize(g_data, scale_of_rows(g_scale, expert_of_row)).t(),
                                         dequantize(x_data, scale_of_rows(x_scale, expert_of_row)), offsets,
                                         token_counts)
    n, k = grad.size(1), x.size(1)
    # The kernel takes one scale per column of each expert's rows, expert-major: (experts * N,) and (experts * K,).
    return torch._scaled_grouped_mm(g_data.t().contiguous(), x_data.t().contiguous().t(),
                                    expert_scales(g_scale, num_experts, n).reshape(-1).reciprocal(),
                                    expert_scales(x_scale, num_experts, k).reshape(-1).reciprocal(),
                                    offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)


class Float8GroupedMatmul(torch.autograd.Function):
    """x (rows, K) in the padded layout @ weight (E, N, K)^T per expert block, the recipe's casts in all three
    matmuls. Saves the high-precision x and weight and casts them again for each backward matmul, as the linears do.
    Rows after the last block come out zero, so that no later cast sees the kernels' undefined rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor, expert_of_row: Tensor, recipe: Recipe,
                emulate: bool, token_counts: TokenCounts) -> Tensor:
        ctx.save_for_backward(x, weight, offsets, expert_of_row)
        ctx.recipe, ctx.emulate, ctx.token_counts = recipe, emulate, token_counts
        in_block = (expert_of_row < weight.size(0))[:, None]
        return forward_mm(x, weight, offsets, recipe, emulate, token_counts).to(x.dtype).masked_fill(~in_block, 0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None, None, None]:
        x, weight, offsets, expert_of_row = ctx.saved_tensors
        in_block = (expert_of_row < weight.size(0))[:, None]
        grad_input = grad_input_mm(grad, weight, offsets, ctx.recipe, ctx.emulate, ctx.token_counts).to(grad.dtype)
        grad_weight = grad_weight_mm(grad, x, (offsets, expert_of_row), weight.size(0), ctx.recipe, ctx.emulate,
                                     ctx.token_counts)
        return grad_input.masked_fill(~in_block, 0), grad_weight.to(weight.dtype), None, None, None, None, None


@dataclass(frozen=True)
class Float8ExpertMatmuls:
    """The experts' matmuls in float8 grouped matmuls (titan/models/common/moe.py ExpertMatmuls)."""

    recipe_name: str
    emulate: bool

    def __call__(self, x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                 token_counts: TokenCounts) -> Tensor:
        return padded_experts(x, counts, params, function, token_counts, self.grouped_mm, FLOAT8_GROUP_ALIGNMENT)

    def grouped_mm(self, x: Tensor, weight: Tensor, groups: PaddedGroups, token_counts: TokenCounts) -> Tensor:
        return Float8GroupedMatmul.apply(x, weight, groups.offsets, groups.expert_of_row,
                                         EXPERT_RECIPES[self.recipe_name], self.emulate, token_counts)
