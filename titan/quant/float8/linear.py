"""Float8Linear: nn.Linear whose three matmuls run in float8 with dynamic scaling.

Recipes (numerically those of torchao's float8 training):
  tensorwise          one scale per tensor; input and weight e4m3, grad_output e5m2 (its wider range).
  rowwise             one scale per row along each matmul's contraction dim, all e4m3, power-of-2 scales.
  rowwise_with_gw_hp  rowwise, but grad_weight = grad_output^T @ input stays in high precision.

For y = x @ W^T with x (M, K), W (N, K), grad_output g (M, N):
  output       x @ W^T   contracts K: x scaled per row of x, W per row of W.
  grad_input   g @ W     contracts N: g per row of g, W per column of W.
  grad_weight  g^T @ x   contracts M: g per column of g, x per column of x.
Native matmuls use torch._scaled_mm (CUDA SM89+, and torch's CPU kernels); with emulate the same
quantized values are dequantized and multiplied in high precision.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from titan.quant.float8.casts import dequantize, rowwise_cast, tensorwise_cast
from titan.quant.float8.gathered import weight_float8_tensorwise
from titan.quant.formats import E4M3, E5M2
from titan.quant.quantized_linear import QuantizedLinear


@dataclass(frozen=True)
class Recipe:
    name: str
    rowwise: bool
    grad_dtype: torch.dtype
    grad_weight_high_precision: bool


RECIPES = {
    "tensorwise": Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, grad_weight_high_precision=False),
    "rowwise": Recipe("rowwise", rowwise=True, grad_dtype=E4M3, grad_weight_high_precision=False),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", rowwise=True, grad_dtype=E4M3, grad_weight_high_precision=True),
}


def scaled_matmul(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                  emulate: bool) -> Tensor:
    """(a / a_scale) @ (b / b_scale) for float8 a (M, K) and b (K, N); scales broadcast like the operands
    (scalars, (M, 1) for a, (1, N) for b)."""
    if emulate:
        return (dequantize(a, a_scale) @ dequantize(b, b_scale)).to(out_dtype)
    # CUDA's rowwise kernel only writes bf16; cast afterwards for other output dtypes.
    mm_dtype = torch.bfloat16 if a_scale.dim() > 0 and a.is_cuda else out_dtype
    # _scaled_mm wants a row-major, b column-major, and the inverse (dequantizing) scales.
    out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                           scale_b=b_scale.reciprocal(), out_dtype=mm_dtype)
    return out.to(out_dtype)


def forward_matmul(x: Tensor, weight: Tensor, recipe: Recipe, emulate: bool) -> Tensor:
    """x (M, K) @ weight (N, K)^T in float8."""
    if recipe.rowwise:
        x_data, x_scale = rowwise_cast(x, E4M3, dim=-1)  # scale (M, 1)
        w_data, w_scale = rowwise_cast(weight, E4M3, dim=-1)  # scale (N, 1)
        return scaled_matmul(x_data, x_scale, w_data.t(), w_scale.t(), x.dtype, emulate)
    x_data, x_scale = tensorwise_cast(x, E4M3)
    w_data, w_scale = weight_float8_tensorwise(weight)
    return scaled_matmul(x_data, x_scale, w_data.t(), w_scale, x.dtype, emulate)


def grad_input_matmul(grad: Tensor, weight: Tensor, recipe: Recipe, emulate: bool) -> Tensor:
    """grad (M, N) @ weight (N, K) in float8."""
    if recipe.rowwise:
        g_data, g_scale = rowwise_cast(grad, recipe.grad_dtype, dim=-1)  # scale (M, 1)
        w_data, w_scale = rowwise_cast(weight, E4M3, dim=0)  # scale (1, K)
        return scaled_matmul(g_data, g_scale, w_data, w_scale, grad.dtype, emulate)
    g_data, g_scale = tensorwise_cast(grad, recipe.grad_dtype)
    w_data, w_scale = weight_float8_tensorwise(weight)
    return scaled_matmul(g_data, g_scale, w_data, w_scale, grad.dtype, emulate)


def grad_weight_matmul(grad: Tensor, x: Tensor, recipe: Recipe, emulate: bool, out_dtype: torch.dtype) -> Tensor:
    """grad (M, N)^T @ x (M, K), in float8 unless the recipe keeps it in high precision."""
    if recipe.grad_weight_high_precision:
        return (grad.t() @ x).to(out_dtype)
    if recipe.rowwise:
        g_data, g_scale = rowwise_cast(grad, recipe.grad_dtype, dim=0)  # scale (1, N)
        x_data, x_scale = rowwise_cast(x, E4M3, dim=0)  # scale (1, K)
        return scaled_matmul(g_data.t(), g_scale.t(), x_data, x_scale, out_dtype, emulate)
    g_data, g_scale = tensorwise_cast(grad, recipe.grad_dtype)
    x_data, x_scale = tensorwise_cast(x, E4M3)
    return scaled_matmul(g_data.t(), g_scale, x_data, x_scale, out_dtype, emulate)


class Float8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with all three matmuls in float8. Saves the high-precision input and
    weight (as nn.Linear does) and re-quantizes them along each backward matmul's contraction dim."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Recipe, emulate: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        return forward_matmul(x, weight, recipe, emulate)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad_input = grad_input_matmul(grad, weight, ctx.recipe, ctx.emulate)
        grad_weight = grad_weight_matmul(grad, x, ctx.recipe, ctx.emulate, weight.dtype)
        return grad_input, grad_weight, None, None


class Float8Linear(QuantizedLinear):
    """nn.Linear with float8 matmuls; the parameters stay in high precision for the optimizer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, recipe_name: str, emulate: bool,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = RECIPES[recipe_name]
        self.emulate = emulate

    def matmul(self, x_2d: Tensor) -> Tensor:
        return Float8Matmul.apply(x_2d, self.weight, self.recipe, self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8={self.recipe.name}{', emulated' if self.emulate else ''}"
