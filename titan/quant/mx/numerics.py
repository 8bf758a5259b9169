"""MX block quantization per the OCP Microscaling Formats (MX) Specification v1.0.

A block of `block_size` (32) consecutive elements along one dim shares an E8M0 scale X = 2**(code - 127)
(code 0xFF is NaN); each element is stored as P = V / X in the element type (E4M3 for MXFP8, or E5M2).

Conversion (spec section 6.3): shared_exp = floor(log2(amax of the block)) - emax_elem, clamped to E8M0's
[-127, 127], where emax_elem is the element type's largest normal exponent (8 for E4M3, 15 for E5M2); then every
element is V / X rounded to the element type, to nearest with ties to even, saturating to +-max.

Scale rounding, one of two (the recipe's, --mx.recipe_name):
  - floor (`mxfp8`, the spec's): the scale exponent is rounded down. The block's amax then lands in
    [2**emax_elem, 2**(emax_elem + 1)) after scaling, so for E4M3 an amax in (448, 512) * X saturates to 448 * X: up
    to 12.5% error on the block's largest element (torchao's ScaleCalculationMode.FLOOR).
  - rceil (`mxfp8_rceil`): X is amax / max_elem (in fp32) rounded up to a power of two, so no element saturates
    (torchao's ScaleCalculationMode.RCEIL, its MXFP8 training default; cuBLAS's "round up" UE8M0 conversion and
    Blackwell's cvt.rp.satfinite.ue8m0 compute the same). torchao's eager form takes ceil(log2(.)) in fp32, which
    for fp32 inputs can miss the round-up when amax / 448 is within an ulp above a power of two (its Triton kernel
    and the hardware do not); Titan rounds up on the bits, as the hardware does. A block whose amax / 448 is below
    2**-126 (an fp32 subnormal; amax < 5e-36) takes the power of two above it where torchao takes code 0 and leaves
    the elements unscaled (so they round to 0): the one other difference, tested.

Special values:
  - an all-zero block (or one whose amax is below 2**(emax_elem - 127)) takes the smallest scale, 2**-127 (code 0);
  - a block holding a NaN or an infinity gets the NaN scale 0xFF, so every value of it dequantizes to NaN. E4M3
    cannot represent inf, and a saturated block would read back as finite garbage; NaN lets the trainer's NaN stop
    see it (as the float8 casts do). Such a block's elements are NaN too;
  - subnormal inputs are exact after scaling (multiplying by a power of two), and elements below the element
    type's smallest subnormal round to zero, as any conversion does.

These plain torch ops run everywhere (CPU, CUDA, DTensor shards, under torch.compile); on eager CUDA `quantize`
calls the fused Triton kernel of titan/quant/kernels/mx_quantize.py, which reproduces them bit for bit.
"""

from typing import Literal

import torch
from torch import Tensor

from titan.quant.float8.casts import cast_to_float8, use_triton
from titan.quant.formats import E4M3, E8M0_NAN, MX_BLOCK_SIZE, check_blocks, float8_format

_FP32_MANTISSA_BITS = 23
_FP32_MANTISSA_MASK = 0x007FFFFF
_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000
_FP32_NAN_BITS = 0x7FC00000
_FP32_TWO_POW_MINUS_127_BITS = 0x00400000  # 2**-127: the one E8M0 value that is an fp32 subnormal


ScaleRounding = Literal["floor", "rceil"]


def scale_codes(amax: Tensor, elem_dtype: torch.dtype, rounding: ScaleRounding = "floor") -> Tensor:
    """E8M0 codes (int32, 0..255) of the blocks whose fp32 amaxes are `amax`.

    floor: floor(log2(amax)) + 127 is the biased exponent field of the fp32 amax for normal amaxes; for subnormal
    ones the field is 0 while the true exponent is lower, and both clamp to code 0, so the field is exact wherever it
    counts. rceil: the biased exponent of amax / max_elem, plus one unless that is a power of two (its mantissa 0); a
    subnormal quotient rounds up to 2**-127 (code 0) or 2**-126 (code 1).
    """
    amax_bits = amax.float().view(torch.int32) & _FP32_ABS_MASK
    if rounding == "floor":
        biased_exponent = amax_bits >> _FP32_MANTISSA_BITS
        codes = torch.clamp(biased_exponent - float8_format(elem_dtype).max_exponent, min=0)
    else:
        descale_bits = torch.div(amax.float().abs(), float8_format(elem_dtype).max).view(torch.int32)
        biased_exponent, mantissa = descale_bits >> _FP32_MANTISSA_BITS, descale_bits & _FP32_MANTISSA_MASK
        codes = torch.where(biased_exponent == 0, (mantissa > _FP32_TWO_POW_MINUS_127_BITS).int(),
                            biased_exponent + (mantissa != 0).int())
    return torch.where(amax_bits >= _FP32_INF_BITS, E8M0_NAN, codes)


def scale_values(codes: Tensor) -> Tensor:
    """X = 2**(code - 127) in fp32 for integer E8M0 codes, built from bits so it is exact (2**-127 included)."""
    codes = codes.to(torch.int32)
    bits = torch.where(codes == 0, _FP32_TWO_POW_MINUS_127_BITS, codes << _FP32_MANTISSA_BITS)
    return torch.where(codes == E8M0_NAN, _FP32_NAN_BITS, bits).view(torch.float32)


def inverse_scale_values(codes: Tensor) -> Tensor:
    """1 / X = 2**(127 - code) in fp32, NaN for the NaN code. Finite blocks have code <= 254 - emax_elem (the amax
    is at most fp32 max, biased exponent 254), so 254 - code is a normal exponent field and the value is exact."""
    codes = codes.to(torch.int32)
    bits = torch.clamp(254 - codes, min=0) << _FP32_MANTISSA_BITS
    return torch.where(codes == E8M0_NAN, _FP32_NAN_BITS, bits).view(torch.float32)


def torch_quantize(x: Tensor, block_size: int, elem_dtype: torch.dtype, dim: int,
                   rounding: ScaleRounding = "floor") -> tuple[Tensor, Tensor]:
    """(uint8 scale codes, data) in plain torch ops, blocks along `dim`. Data has x's shape; the codes have x's
    shape with `dim` divided by block_size."""
    x_fp32 = x.float().movedim(dim, -1)
    blocks = x_fp32.unflatten(-1, (-1, block_size))  # (..., num_blocks, block_size)
    codes = scale_codes(blocks.abs().amax(dim=-1, keepdim=True), elem_dtype, rounding)  # (..., num_blocks, 1)
    data = cast_to_float8(blocks, elem_dtype, inverse_scale_values(codes))
    data = data.flatten(-2).movedim(-1, dim)  # x's shape
    return codes.squeeze(-1).movedim(-1, dim).to(torch.uint8), data


def quantize(x: Tensor, block_size: int = MX_BLOCK_SIZE, elem_dtype: torch.dtype = E4M3, dim: int = -1,
             rounding: ScaleRounding = "floor") -> tuple[Tensor, Tensor]:
    """(scales, data): x in MX blocks of `block_size` elements along `dim` (the last by default), scales rounded as
    `rounding` says.

    scales are torch.float8_e8m0fnu with x's shape except dim, which is divided by block_size; data is `elem_dtype`
    with x's shape. dequantize(scales, data, ...) gives back the values they stand for.
    """
    check_blocks(x, block_size, dim)
    codes, data = quantize_codes(x, block_size, elem_dtype, dim, rounding)
    return codes.view(torch.float8_e8m0fnu), data


def quantize_codes(x: Tensor, block_size: int, elem_dtype: torch.dtype, dim: int,
                   rounding: ScaleRounding = "floor") -> tuple[Tensor, Tensor]:
    """quantize with uint8 codes: the fused Triton kernel on a plain eager CUDA tensor (the float8 casts' rule,
    titan/quant/float8/casts.py use_triton), torch ops elsewhere."""
    if use_triton(x) and dim % x.ndim in (0, x.ndim - 1):
        # Imported on first use so that this module imports where triton does not (CPU-only installs, macOS).
        from titan.quant.kernels.mx_quantize import triton_quantize

        return triton_quantize(x, block_size, elem_dtype, dim, rounding)
    return torch_quantize(x, block_size, elem_dtype, dim, rounding)


def dequantize(scales: Tensor, data: Tensor, block_size: int = MX_BLOCK_SIZE,
               out_dtype: torch.dtype = torch.float32, dim: int = -1) -> Tensor:
    """The values MX blocks stand for, data * X, as `out_dtype`. `scales` may be float8_e8m0fnu or uint8 codes."""
    codes = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    blocks = data.float().movedim(dim, -1).unflatten(-1, (-1, block_size))  # (..., num_blocks, block_size)
    block_scales = scale_values(codes).movedim(dim, -1).unsqueeze(-1)  # (..., num_blocks, 1)
    return (blocks * block_scales).flatten(-2).movedim(-1, dim).to(out_dtype)
