"""Float8 casts with dynamic scaling, as torchao's float8 training recipes do: scale = max / amax, computed from
the tensor being cast, so its largest magnitude lands on the float8 format's largest finite value.

These plain torch ops are the path for CPU, for DTensors (the amax reduction becomes a cross-rank max) and under
torch.compile (inductor fuses them). In eager mode on CUDA, `tensorwise_cast` and `rowwise_cast` call the fused
Triton kernels of titan/quant/kernels/float8_cast.py instead, which reproduce `torch_tensorwise_cast` and
`torch_rowwise_cast` bit for bit.

Non-finite inputs: an inf anywhere in the scaled group makes amax inf and the scale 0; a nan makes amax and the
scale nan. Either way every dequantized value of that group (the whole tensor, or one row) is nan, so the trainer's
NaN guard stops the run instead of training on finite garbage (a saturated inf would read back as +-max / scale).
"""

import torch
from torch import Tensor

from titan.quant.formats import EPS

_FP32_EXPONENT_BITS = 0x7F800000


def amax_to_scale(amax: Tensor, float8_dtype: torch.dtype, round_to_power_of_2: bool) -> Tensor:
    """fp32 scale that maps `amax` onto the largest finite `float8_dtype` value: max / clamp(amax, min=EPS).

    amax = inf gives scale 0 and amax = nan gives scale nan; see the module docstring for why both are kept.
    With `round_to_power_of_2` the scale is rounded down to a power of two, so multiplying by it only shifts the
    exponent and dequantizing is exact.
    """
    # torch.div with a Python number first divides with one IEEE rounding; `max / tensor` would compute
    # reciprocal(tensor) * max, rounding twice, and then the Triton kernels could not match it bit for bit.
    # clamp keeps nan.
    scale = torch.div(torch.finfo(float8_dtype).max, torch.clamp(amax.float(), min=EPS))
    if round_to_power_of_2:
        scale = _round_down_to_power_of_2(scale)
    return scale


def _round_down_to_power_of_2(scale: Tensor) -> Tensor:
    """exp2(floor(log2(scale))) computed exactly, by clearing the mantissa bits of the fp32 scale.

    fp32 log2 of a scale just below 2**k rounds up to exactly k, so exp2(floor(log2(.))) would return 2**k,
    above the scale, and the scaled amax would overflow the float8 range. The scale is never subnormal
    (amax <= fp32 max, so scale >= 448 / 3.4e38 > 2**-126), so clearing the mantissa is exact for every value but
    nan, whose mantissa bits are what make it nan; 0 stays 0.
    """
    exponent_only = (scale.view(torch.int32) & _FP32_EXPONENT_BITS).view(torch.float32)
    return torch.where(scale.isnan(), scale, exponent_only)


def cast_to_float8(x: Tensor, float8_dtype: torch.dtype, scale: Tensor) -> Tensor:
    """Saturating cast of x * scale (in fp32, broadcasting `scale`) to `float8_dtype`, rounding to nearest even.

    The clamp is what makes it saturating: torch's own `.to(float8)` rounds E5M2 overflow to inf, and its E4M3
    overflow behaviour has changed between releases (nan in older ones). clamp keeps nan, which converts to nan.
    """
    float8_max = torch.finfo(float8_dtype).max
    return (x.float() * scale).clamp(-float8_max, float8_max).to(float8_dtype)


def torch_tensorwise_cast(x: Tensor, float8_dtype: torch.dtype,
                          round_to_power_of_2: bool = False) -> tuple[Tensor, Tensor]:
    """(data, scale) with one 0-dim fp32 scale from the amax of the whole tensor, in plain torch ops."""
    x_fp32 = x.float()  # upcast once: the amax and the cast share it in eager mode, inductor fuses both
    scale = amax_to_scale(x_fp32.abs().amax(), float8_dtype, round_to_power_of_2)
    return cast_to_float8(x_fp32, float8_dtype, scale), scale


def torch_rowwise_cast(x: Tensor, float8_dtype: torch.dtype, dim: int,
                       round_to_power_of_2: bool = True) -> tuple[Tensor, Tensor]:
    """(data, scale) with one fp32 scale per slice along `dim` (the matmul's contraction dim), in plain torch ops.

    The scale keeps `dim` with size 1: for x of shape (M, K), dim=-1 gives scales of shape (M, 1) and dim=0 (1, K).
    """
    # The amax is exact in any dtype, but reducing a bf16 x trips a torch 2.13 inductor C++ bug: two column amaxes
    # of one bf16 tensor in one kernel declare the same accumulator twice and fail to compile.
    x_fp32 = x.float()
    scale = amax_to_scale(x_fp32.abs().amax(dim=dim, keepdim=True), float8_dtype, round_to_power_of_2)
    return cast_to_float8(x_fp32, float8_dtype, scale), scale


def use_triton(x: Tensor) -> bool:
    """Whether to cast `x` with the fused Triton kernels: only a plain CUDA tensor in eager mode, outside autograd.

    Under torch.compile, inductor fuses the torch path itself. A DTensor has no single buffer to hand a kernel, and
    its amax must be reduced across ranks, which the torch ops do. The kernels record no autograd history, so a
    cast that autograd would track takes the torch path (inside an autograd.Function's forward nothing is tracked).
    CPU has no Triton backend.
    """
    tracked = torch.is_grad_enabled() and x.requires_grad
    return (not torch.compiler.is_compiling() and x.is_cuda and type(x) in (torch.Tensor, torch.nn.Parameter)
            and not tracked)


def tensorwise_cast(x: Tensor, float8_dtype: torch.dtype, round_to_power_of_2: bool = False) -> tuple[Tensor, Tensor]:
    """(data, scale) with one 0-dim fp32 scale for the whole tensor; data = saturate(x * scale) in `float8_dtype`."""
    if use_triton(x):
        # Imported on first use so that casts.py imports where triton does not (CPU-only installs, macOS).
        from titan.quant.kernels.float8_cast import triton_tensorwise_cast

        return triton_tensorwise_cast(x, float8_dtype, round_to_power_of_2)
    return torch_tensorwise_cast(x, float8_dtype, round_to_power_of_2)


def rowwise_cast(x: Tensor, float8_dtype: torch.dtype, dim: int,
                 round_to_power_of_2: bool = True) -> tuple[Tensor, Tensor]:
    """(data, scale) with one fp32 scale per slice along `dim`; the scale has x's shape with `dim` set to 1."""
    # The kernels reduce over the first or the last dim, the two a matmul contracts over; others take the torch path.
    if use_triton(x) and dim % x.ndim in (0, x.ndim - 1):
        from titan.quant.kernels.float8_cast import triton_rowwise_cast

        return triton_rowwise_cast(x, float8_dtype, dim, round_to_power_of_2)
    return torch_rowwise_cast(x, float8_dtype, dim, round_to_power_of_2)


def dequantize(data: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """data / scale in fp32, returned as `out_dtype`: the value each float8 element stands for."""
    return (data.to(torch.float32) / scale).to(out_dtype)
