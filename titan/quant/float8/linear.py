"""Float8Linear: nn.Linear whose matmuls run in float8 with dynamic scaling, as torchao's float8 training recipes
define them.

For y = x @ W^T with input x (M, K), weight W (N, K) and grad_output g (M, N), the three matmuls are
  output       x @ W^T   contracts K
  grad_input   g @ W     contracts N
  grad_weight  g^T @ x   contracts M (tokens)
A recipe gives each operand of each matmul a float8 dtype and a scale granularity, tensorwise (one scale for the
operand) or axiswise (one scale per slice along that matmul's contraction dim: per row of the left operand, per
column of the right one), with scales rounded down to a power of 2 or not; or it keeps a matmul in high
precision. Each matmul re-casts the high-precision x, W and g it is given, as torchao does.
Native matmuls use torch._scaled_mm (CUDA SM89+, and torch's CPU kernels); with emulate the same
quantized values are dequantized and multiplied in high precision.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from titan.quant.float8.casts import dequantize, rowwise_cast, tensorwise_cast
from titan.quant.float8.gathered import Float8GatheredWeight
from titan.quant.formats import E4M3, E5M2
from titan.quant.quantized_linear import QuantizedLinear, in_dtype


@dataclass(frozen=True)
class OperandCast:
    """How one matmul operand is cast to float8: torchao's CastConfig with its round_scales_to_power_of_2."""

    dtype: torch.dtype
    granularity: Literal["tensorwise", "axiswise"]
    """tensorwise: one scale for the whole operand. axiswise: one per slice along the matmul's contraction dim."""
    power_of_2: bool
    """Scales rounded down to a power of 2, so scaling and unscaling only shift exponents."""


@dataclass(frozen=True)
class Recipe:
    """The (left, right) operand casts of each matmul; None keeps that matmul in high precision."""

    name: str
    output: tuple[OperandCast, OperandCast]
    """input @ weight^T"""
    grad_input: tuple[OperandCast, OperandCast]
    """grad_output @ weight"""
    grad_weight: tuple[OperandCast, OperandCast] | None
    """grad_output^T @ input"""


TENSORWISE_E4M3 = OperandCast(E4M3, "tensorwise", power_of_2=False)
"""Also the cast of FSDP's float8 all-gather, which recipes casting the weight this way in both its matmuls allow."""
TENSORWISE_E5M2 = OperandCast(E5M2, "tensorwise", power_of_2=False)
TENSORWISE_E4M3_POWER_OF_2 = OperandCast(E4M3, "tensorwise", power_of_2=True)
AXISWISE_E4M3_POWER_OF_2 = OperandCast(E4M3, "axiswise", power_of_2=True)

# torchao's recipes: Float8LinearConfig.from_recipe_name in torchao/float8/config.py (pytorch/ao), with the defaults
# that Float8LinearConfig.__post_init__ fills in: e4m3 for input and weight, e5m2 for grad_output. Its
# round_scales_to_power_of_2 is one flag for the whole linear, off by default; rowwise and rowwise_with_gw_hp turn it
# on, so it applies to every float8 cast of those recipes, gw_hp's tensorwise weight scale included.
# torchao/float8/float8_linear.py takes every axiswise scale along the matmul's contraction dim.
# tests/test_float8_torchao.py checks this table against torchao itself.
RECIPES = {
    "tensorwise": Recipe("tensorwise",
                         output=(TENSORWISE_E4M3, TENSORWISE_E4M3),
                         grad_input=(TENSORWISE_E5M2, TENSORWISE_E4M3),
                         grad_weight=(TENSORWISE_E5M2, TENSORWISE_E4M3)),
    "rowwise": Recipe("rowwise",
                      output=(AXISWISE_E4M3_POWER_OF_2, AXISWISE_E4M3_POWER_OF_2),
                      grad_input=(AXISWISE_E4M3_POWER_OF_2, AXISWISE_E4M3_POWER_OF_2),
                      grad_weight=(AXISWISE_E4M3_POWER_OF_2, AXISWISE_E4M3_POWER_OF_2)),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp",
                                 output=(AXISWISE_E4M3_POWER_OF_2, AXISWISE_E4M3_POWER_OF_2),
                                 grad_input=(AXISWISE_E4M3_POWER_OF_2, TENSORWISE_E4M3_POWER_OF_2),
                                 grad_weight=None),
}


def scaled_matmul(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                  emulate: bool) -> Tensor:
    """(a / a_scale) @ (b / b_scale) for float8 a (M, K) and b (K, N); scales broadcast like the operands
    (0-dim, (M, 1) for a, (1, N) for b)."""
    if emulate:
        return in_dtype(dequantize(a, a_scale) @ dequantize(b, b_scale), out_dtype)
    # _scaled_mm takes two tensorwise or two rowwise scales: one tensorwise scale with a rowwise partner (the weight
    # in rowwise_with_gw_hp's grad_input) is repeated along the rows or columns, as torchao does.
    if a_scale.dim() != b_scale.dim():
        a_scale = a_scale.expand(a.shape[0], 1).contiguous()
        b_scale = b_scale.expand(1, b.shape[1]).contiguous()
    # CUDA's rowwise kernels write only bf16 (CUTLASS's f8f8bf16_rowwise on SM89 and SM100; cuBLAS's fp32 output is
    # SM90 only), so rowwise products are rounded to bf16 and cast afterwards. The CPU kernel could write fp32, but
    # rounds the same way, so that an fp32 run computes the same numbers on every device (and as torchao does).
    mm_dtype = torch.bfloat16 if a_scale.dim() > 0 else out_dtype
    # _scaled_mm wants a row-major, b column-major, and the inverse (dequantizing) scales.
    out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                           scale_b=b_scale.reciprocal(), out_dtype=mm_dtype)
    return in_dtype(out, out_dtype)


def cast_operand(operand: Tensor, cast: OperandCast, contraction_dim: int) -> tuple[Tensor, Tensor]:
    """(float8 data, fp32 scale) of one matmul operand: the scale is 0-dim when tensorwise, and has the operand's
    shape with `contraction_dim` set to 1 when axiswise."""
    if isinstance(operand, Float8GatheredWeight):
        # FSDP's float8 all-gather cast this weight already; apply_float8_all_gather wraps only the weights of
        # recipes that cast the weight this way in both of its matmuls.
        assert cast == TENSORWISE_E4M3, f"a weight all-gathered in float8 cannot be cast as {cast}"
        return operand._data, operand._scale
    if cast.granularity == "tensorwise":
        return tensorwise_cast(operand, cast.dtype, cast.power_of_2)
    return rowwise_cast(operand, cast.dtype, contraction_dim, cast.power_of_2)


def cast_operands(a: Tensor, b: Tensor,
                  casts: tuple[OperandCast, OperandCast]) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """a (M, K) and b (K, N) cast for a @ b, which contracts a's last dim and b's first: axiswise scales are
    (M, 1) for a and (1, N) for b."""
    return cast_operand(a, casts[0], contraction_dim=-1), cast_operand(b, casts[1], contraction_dim=0)


def float8_mm(a: Tensor, b: Tensor, casts: tuple[OperandCast, OperandCast] | None, out_dtype: torch.dtype,
              emulate: bool) -> Tensor:
    """a (M, K) @ b (K, N) with each operand cast as `casts` says, or in high precision when `casts` is None."""
    if casts is None:
        return in_dtype(a @ b, out_dtype)
    (a_data, a_scale), (b_data, b_scale) = cast_operands(a, b, casts)
    return scaled_matmul(a_data, a_scale, b_data, b_scale, out_dtype, emulate)


class Float8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with the recipe's casts in each of the three matmuls. Saves the high-precision
    input and weight (as nn.Linear does) and casts them again for each backward matmul."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Recipe, emulate: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        return float8_mm(x, weight.t(), recipe.output, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad_input = float8_mm(grad, weight, ctx.recipe.grad_input, grad.dtype, ctx.emulate)
        grad_weight = float8_mm(grad.t(), x, ctx.recipe.grad_weight, weight.dtype, ctx.emulate)
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
