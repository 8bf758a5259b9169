"""MXLinear: nn.Linear whose three matmuls run in MXFP8, each operand quantized in blocks of 32 along that matmul's
contraction dim (OCP MX blocks must run along the dot product).

For y = x @ W^T with x (M, K), W (N, K), grad_output g (M, N):
  output       x @ W^T   contracts K: x and W in blocks along their rows.
  grad_input   g @ W     contracts N: g along its rows, W along its columns.
  grad_weight  g^T @ x   contracts M (tokens): g and x along their columns.
So the weight and the activations are each quantized twice, once per direction, from the high-precision copies
that autograd saves (as nn.Linear saves them).

Native: torch._scaled_mm with E8M0 scales on CUDA SM100+ (Blackwell's block-scaled tensor cores, via cuBLAS).
Emulated (`--mx.emulate`): the same quantized values, dequantized and multiplied in the input's dtype, which holds
every MXFP8 value exactly (a 4-bit significand times a power of two); for CPU and pre-Blackwell GPUs.

Under tensor parallelism the operands are DTensors; each rank quantizes and multiplies its own shards
(titan/quant/quantized_linear.py multiply_shards).
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from titan.quant.formats import E4M3, MX_BLOCK_SIZE
from titan.quant.mx.blocked import to_blocked
from titan.quant.mx.numerics import ScaleRounding, dequantize, quantize_codes
from titan.quant.quantized_linear import QuantizedLinear, in_dtype, multiply_shards

RECIPES: dict[str, ScaleRounding] = {"mxfp8": "floor", "mxfp8_rceil": "rceil"}
"""MX recipes, by their scale rounding (titan/quant/mx/numerics.py): E4M3 elements in all three matmuls, blocks of
32, E8M0 scales rounded down (mxfp8, the OCP spec's) or up (mxfp8_rceil, torchao's training default)."""


def native_mx_mm(a_codes: Tensor, a_data: Tensor, b_codes: Tensor, b_data: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a (M, K) @ b (K, N) on block-scaled tensor cores; a's scales (M, K / 32), b's (K / 32, N)."""
    e8m0 = torch.float8_e8m0fnu
    a_scales = to_blocked(a_codes).view(e8m0)
    b_scales = to_blocked(b_codes.t()).view(e8m0)  # cuBLAS reads b as (N, K) rows: scales (N, K / 32)
    b_column_major = b_data.t().contiguous().t()
    # Block-scaled cuBLAS GEMMs write bf16; cast afterwards for fp32 training.
    out = torch._scaled_mm(a_data.contiguous(), b_column_major, a_scales, b_scales, out_dtype=torch.bfloat16)
    return in_dtype(out, out_dtype)


def local_mx_mm(a: Tensor, b: Tensor, emulate: bool, rounding: ScaleRounding) -> Tensor:
    """a (M, K) @ b (K, N) in MXFP8 for plain tensors, output in a's dtype. A contraction dim that is not a
    multiple of 32 (the tokens of grad_weight) is zero-padded: zeros change no block's amax and add nothing."""
    pad = -a.shape[1] % MX_BLOCK_SIZE
    if pad:
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
    a_codes, a_data = quantize_codes(a, MX_BLOCK_SIZE, E4M3, -1, rounding)  # codes (M, K / 32)
    b_codes, b_data = quantize_codes(b, MX_BLOCK_SIZE, E4M3, 0, rounding)  # codes (K / 32, N)
    if emulate:
        a_values = dequantize(a_codes, a_data, MX_BLOCK_SIZE, a.dtype, dim=-1)
        b_values = dequantize(b_codes, b_data, MX_BLOCK_SIZE, a.dtype, dim=0)
        return a_values @ b_values
    return native_mx_mm(a_codes, a_data, b_codes, b_data, a.dtype)


def mx_mm(a: Tensor, b: Tensor, emulate: bool, rounding: ScaleRounding) -> Tensor:
    """a (M, K) @ b (K, N) in MXFP8, for plain tensors or DTensors on one TP mesh dim (multiplied shard by shard)."""
    return multiply_shards(a, b, partial(local_mx_mm, emulate=emulate, rounding=rounding), "MX")


class MXMatmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with all three matmuls in MXFP8, re-quantizing the saved high-precision input
    and weight along each backward matmul's contraction dim."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, emulate: bool, rounding: ScaleRounding) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.emulate, ctx.rounding = emulate, rounding
        return mx_mm(x, weight.t(), emulate, rounding)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad_input = mx_mm(grad, weight, ctx.emulate, ctx.rounding)
        grad_weight = mx_mm(grad.t(), x, ctx.emulate, ctx.rounding)
        return grad_input, grad_weight, None, None


class MXLinear(QuantizedLinear):
    """nn.Linear with MXFP8 matmuls; the parameters stay in high precision for the optimizer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, recipe_name: str, emulate: bool,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe_name not in RECIPES:
            raise ValueError(f"Unknown MX recipe {recipe_name!r}; available: {', '.join(RECIPES)}.")
        self.recipe_name = recipe_name
        self.emulate = emulate

    def matmul(self, x_2d: Tensor) -> Tensor:
        # In the input's dtype, as the native kernels multiply (autocast's bf16 x with an fp32 weight); autograd
        # casts the weight's gradient back.
        return MXMatmul.apply(x_2d, self.weight.to(x_2d.dtype), self.emulate, RECIPES[self.recipe_name])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mx={self.recipe_name}{', emulated' if self.emulate else ''}"
