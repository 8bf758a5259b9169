"""MXFP8 grouped matmuls for a mixture of experts' experts, as torchao's `_to_mxfp8_then_scaled_grouped_mm` defines
them (torchao/prototype/moe_training/mxfp8_grouped_mm.py), with the recipe's scale rounding as the MX linears use it
(--mx.recipe_name: mxfp8 rounds down, the OCP spec's floor; mxfp8_rceil rounds up, torchao's MoE default).

For one expert, out = x @ W^T with tokens x (M, K), weight W (N, K) and grad_output g (M, N); every operand is E4M3
in blocks of 32 along the contraction dim of its matmul:
  output       x @ W^T   x and W in blocks along K
  grad_input   g @ W     g along N, W along N
  grad_weight  g^T @ x   g and x in blocks along the tokens: each expert's block of rows is padded to a multiple of
                         32 (titan/quant/grouped.py), so no block spans two experts.
Native: torch._scaled_grouped_mm with E8M0 scales (CUDA, Blackwell SM100), which writes bf16. Emulated: the same
MXFP8 values dequantized to bf16 (exact: a 4-bit significand times a power of two) and multiplied by
torch._grouped_mm in bf16, as torchao's emulated mode does, so both write bf16 products.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from titan.models.common.moe import ExpertFunction, TokenCounts
from titan.quant.formats import E4M3, MX_BLOCK_SIZE
from titan.quant.grouped import PaddedGroups, padded_experts
from titan.quant.mx.blocked import to_blocked_k_groups, to_blocked_m_groups, to_blocked_per_expert
from titan.quant.mx.linear import RECIPES
from titan.quant.mx.numerics import ScaleRounding, dequantize, quantize_codes

MX_GROUP_ALIGNMENT = MX_BLOCK_SIZE
"""Rows per token-block step: grad_weight's MX blocks run along each expert's rows."""


@torch.library.custom_op("titan::mx_quantize_dequantize", mutates_args=())
def quantize_dequantize(x: Tensor, dim: int, rounding: str) -> Tensor:
    """x's MXFP8 values, blocks of 32 along `dim` with `rounding`'s scales, in bf16 (which holds every one of them
    exactly), contiguous.

    An opaque op to torch.compile: inductor's CPU code generator fails (an assertion in its loop split, torch 2.13)
    on a backward that quantizes one gradient along both of its dims for two grouped matmuls; emulation is for
    numerics, not speed, so its quantization runs as in eager mode."""
    codes, data = quantize_codes(x, MX_BLOCK_SIZE, E4M3, dim, rounding)
    return dequantize(codes, data, MX_BLOCK_SIZE, torch.bfloat16, dim).contiguous()


@quantize_dequantize.register_fake
def _(x: Tensor, dim: int, rounding: str) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.bfloat16)


def emulated_forward(x: Tensor, weight: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """x (rows, K) @ weight (E, N, K)^T per expert block -> (rows, N) bf16."""
    # Contiguous (E, K, N) weights, as torchao's emulation multiplies them: the CPU kernel's summation order
    # depends on the layout, and the emulation is to equal torchao's bit for bit.
    return torch._grouped_mm(quantize_dequantize(x, -1, rounding),
                             quantize_dequantize(weight, -1, rounding).transpose(-2, -1).contiguous(), offs=offsets)


def emulated_grad_input(grad: Tensor, weight: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """grad (rows, N) @ weight (E, N, K) per expert block -> (rows, K) bf16."""
    return torch._grouped_mm(quantize_dequantize(grad, -1, rounding),
                             quantize_dequantize(weight, -2, rounding).contiguous(), offs=offsets)


def emulated_grad_weight(grad: Tensor, x: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """grad^T (N, rows) @ x (rows, K) over each expert's rows -> (E, N, K) bf16."""
    grad_t = quantize_dequantize(grad.t().contiguous(), -1, rounding)  # (N, rows), blocks along the rows
    x_t = quantize_dequantize(x.t().contiguous(), -1, rounding)  # (K, rows)
    return torch._grouped_mm(grad_t, x_t.transpose(-2, -1), offs=offsets)


def e8m0(codes: Tensor) -> Tensor:
    return codes.view(torch.float8_e8m0fnu)


def native_forward(x: Tensor, weight: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """x (rows, K) @ weight (E, N, K)^T per expert block on Blackwell's block-scaled tensor cores -> (rows, N) bf16."""
    x_codes, x_data = quantize_codes(x, MX_BLOCK_SIZE, E4M3, -1, rounding)  # codes (rows, K / 32)
    w_codes, w_data = quantize_codes(weight, MX_BLOCK_SIZE, E4M3, -1, rounding)  # codes (E, N, K / 32)
    # b is (E, K, N) column-major: the row-major (E, N, K) data transposed.
    return torch._scaled_grouped_mm(x_data, w_data.transpose(-2, -1), e8m0(to_blocked_m_groups(x_codes, offsets)),
                                    e8m0(to_blocked_per_expert(w_codes)), offs=offsets, out_dtype=torch.bfloat16)


def native_grad_input(grad: Tensor, weight: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """grad (rows, N) @ weight (E, N, K) per expert block -> (rows, K) bf16."""
    g_codes, g_data = quantize_codes(grad, MX_BLOCK_SIZE, E4M3, -1, rounding)  # codes (rows, N / 32)
    w_codes, w_data = quantize_codes(weight, MX_BLOCK_SIZE, E4M3, -2, rounding)  # codes (E, N / 32, K)
    w_column_major = w_data.transpose(-2, -1).contiguous().transpose(-2, -1)  # (E, N, K), strides (N K, 1, N)
    return torch._scaled_grouped_mm(g_data, w_column_major, e8m0(to_blocked_m_groups(g_codes, offsets)),
                                    e8m0(to_blocked_per_expert(w_codes.transpose(-2, -1))), offs=offsets,
                                    out_dtype=torch.bfloat16)


def native_grad_weight(grad: Tensor, x: Tensor, offsets: Tensor, rounding: ScaleRounding) -> Tensor:
    """grad^T (N, rows) @ x (rows, K) over each expert's rows -> (E, N, K) bf16: both operands in blocks along the
    rows, each expert's rows a multiple of 32."""
    g_codes, g_data = quantize_codes(grad.t().contiguous(), MX_BLOCK_SIZE, E4M3, -1, rounding)  # (N, rows / 32)
    x_codes, x_data = quantize_codes(x.t().contiguous(), MX_BLOCK_SIZE, E4M3, -1, rounding)  # (K, rows / 32)
    return torch._scaled_grouped_mm(g_data, x_data.transpose(-2, -1), e8m0(to_blocked_k_groups(g_codes, offsets)),
                                    e8m0(to_blocked_k_groups(x_codes, offsets)), offs=offsets,
                                    out_dtype=torch.bfloat16)


class MXGroupedMatmul(torch.autograd.Function):
    """x (rows, K) in the padded layout @ weight (E, N, K)^T per expert block, in MXFP8 in all three matmuls,
    re-quantizing the saved high-precision x and weight along each backward matmul's contraction dim. Rows after the
    last block come out zero, so that no later quantization sees the kernels' undefined rows. The product and both
    gradients are bf16, as the kernels write them; so in an fp32 run the output gradient arrives rounded to bf16, as
    in torchao's recipe (out_dtype bf16)."""


    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor, in_block: Tensor, emulate: bool,
                rounding: ScaleRounding) -> Tensor:
        ctx.save_for_backward(x, weight, offsets, in_block)
        ctx.emulate, ctx.rounding = emulate, rounding
        out = (emulated_forward if emulate else native_forward)(x, weight, offsets, rounding)
        return out.masked_fill(~in_block, 0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None, None]:
        x, weight, offsets, in_block = ctx.saved_tensors
        grad_input_mm, grad_weight_mm = ((emulated_grad_input, emulated_grad_weight) if ctx.emulate else
                                         (native_grad_input, native_grad_weight))
        grad_input = grad_input_mm(grad, weight, offsets, ctx.rounding)
        grad_weight = grad_weight_mm(grad, x, offsets, ctx.rounding)
        return grad_input.masked_fill(~in_block, 0), grad_weight, None, None, None, None


@dataclass(frozen=True)
class MXExpertMatmuls:
    """The experts' matmuls in MXFP8 grouped matmuls (titan/models/common/moe.py ExpertMatmuls)."""

    emulate: bool
    recipe_name: str = "mxfp8"
    """An MX recipe (titan/quant/mx/linear.py RECIPES): its scale rounding."""

    def __call__(self, x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                 token_counts: TokenCounts) -> Tensor:
        return padded_experts(x, counts, params, function, token_counts, self.grouped_mm, MX_GROUP_ALIGNMENT)

    def grouped_mm(self, x: Tensor, weight: Tensor, groups: PaddedGroups, token_counts: TokenCounts) -> Tensor:
        in_block = (groups.expert_of_row < weight.size(0))[:, None]  # (rows, 1)
        return MXGroupedMatmul.apply(x, weight, groups.offsets, in_block, self.emulate,
                                     RECIPES[self.recipe_name]).to(x.dtype)
