"""Fused Triton float8 casts, bit-exact with torch_tensorwise_cast / torch_rowwise_cast in titan/quant/float8/casts.py.

The torch path reads and writes the tensor once per op (abs, amax, upcast, multiply, clamp, convert); these kernels
read it twice (amax, then cast) and write float8 once.

Float8 codes are computed with integer bit operations and stored through a uint8 view rather than with Triton's
`.to(tl.float8e4nv)`: the same code then runs on every GPU (Triton converts to E4M3 only on sm_89+) and under
TRITON_INTERPRET=1, whose float8 conversion (triton 3.9) rounds ties away from zero, turns 500 and inf into 256
and nan into 384.
Every min/max that may see a nan keeps it (the GPU's default fp min/max return the non-nan operand), so a nan
input gives a nan scale exactly as on the torch path.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan.quant.formats import EPS, float8_format

TENSORWISE_BLOCK = 4096
"""Elements per program of the tensorwise kernels."""
MAX_PARTIALS = 512
"""Programs of the tensorwise amax kernel (each loops over blocks); every cast program re-reduces their partial
maxima, so this bounds that redundant work while leaving a few programs per SM."""
LAST_DIM_TILE = (4, 1024)
"""(kept, reduced) tile of the rowwise kernel reducing along the last, contiguous dim: 4 rows per program."""
FIRST_DIM_TILE = (32, 128)
"""(kept, reduced) tile when reducing along dim 0: only 32 columns per program, so a (tokens, dim) tensor still
spreads over dim / 32 programs, each reading 32 contiguous columns of every row."""

_EPS = tl.constexpr(EPS)


@triton.jit
def abs_bits(x):
    """|x| as int32 bits. Integer order is float order for non-negative floats, with nan above inf, so an integer
    max is an amax that keeps nan: fp max drops nan on the GPU (and in the interpreter's tl.max), and a custom
    nan-keeping combine fn would make the interpreter reduce element by element."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax_to_scale(amax, FP8_MAX: tl.constexpr, ROUND_TO_POWER_OF_2: tl.constexpr):
    """casts.amax_to_scale: div_rn because Triton's `/` on fp32 may be approximate on the GPU."""
    numerator = tl.full(amax.shape, FP8_MAX, tl.float32)
    scale = tl.div_rn(numerator, tl.maximum(amax, _EPS, propagate_nan=tl.PropagateNan.ALL))
    if ROUND_TO_POWER_OF_2:
        exponent_only = (scale.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale != scale, scale, exponent_only)  # nan, unequal to itself, would become inf
    return scale


@triton.jit
def to_float8_bits(x, scale, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, EXPONENT_BIAS: tl.constexpr):
    """uint8 codes of saturate(x * scale) rounded to nearest even, as casts.cast_to_float8 computes them."""
    scaled = tl.clamp(x.to(tl.float32) * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = scaled.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    DROPPED_BITS: tl.constexpr = 23 - MANTISSA_BITS
    # Normal range: round the fp32 mantissa to nearest even on the integer bits (a carry bumps the exponent),
    # then rebias the exponent from fp32's 127 to the float8 bias.
    lowest_kept_bit = (magnitude >> DROPPED_BITS) & 1
    rounded = (magnitude + ((1 << (DROPPED_BITS - 1)) - 1) + lowest_kept_bit) >> DROPPED_BITS
    normal = rounded - ((127 - EXPONENT_BIAS) << MANTISSA_BITS)
    # Subnormal range: adding 2**(24 - bias - mantissa_bits), whose fp32 ulp is the float8 subnormal step, makes
    # the fp32 adder round to nearest even at that step; the code is then the low bits (c10 does the same).
    MAGIC_BITS: tl.constexpr = (151 - EXPONENT_BIAS - MANTISSA_BITS) << 23
    magic = tl.full(magnitude.shape, MAGIC_BITS, tl.uint32).to(tl.float32, bitcast=True)
    subnormal = (magnitude.to(tl.float32, bitcast=True) + magic).to(tl.uint32, bitcast=True) - MAGIC_BITS
    MIN_NORMAL_BITS: tl.constexpr = (128 - EXPONENT_BIAS) << 23
    code = tl.where(magnitude < MIN_NORMAL_BITS, subnormal, normal)
    code = tl.where(magnitude > 0x7F800000, 0x7F, code)  # nan: S.1111.111 in E4M3, a nan of E5M2 too
    return (code | sign).to(tl.uint8)


@triton.jit
def _partial_amax_kernel(x_ptr, partial_amax_ptr, numel, BLOCK: tl.constexpr):
    """Program p writes the amax of blocks p, p + num_programs, ... to partial_amax[p]."""
    pid = tl.program_id(0)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    amax_bits = tl.zeros([BLOCK], tl.int32)
    for start in range(pid.to(tl.int64) * BLOCK, numel, step):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
        amax_bits = tl.maximum(amax_bits, abs_bits(x))
    tl.store(partial_amax_ptr + pid, tl.max(amax_bits, 0).to(tl.float32, bitcast=True))


@triton.jit
def _tensorwise_cast_kernel(x_ptr, data_ptr, partial_amax_ptr, scale_ptr, numel, num_partials,
                            FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, EXPONENT_BIAS: tl.constexpr,
                            ROUND_TO_POWER_OF_2: tl.constexpr, BLOCK: tl.constexpr, PARTIALS_BLOCK: tl.constexpr):
    """Every program reduces the partial maxima to the one scale (program 0 stores it), then casts its block."""
    pid = tl.program_id(0)
    partial_index = tl.arange(0, PARTIALS_BLOCK)
    partials = tl.load(partial_amax_ptr + partial_index, mask=partial_index < num_partials, other=0.0)
    amax = tl.max(abs_bits(partials), 0).to(tl.float32, bitcast=True)
    scale = _amax_to_scale(amax, FP8_MAX, ROUND_TO_POWER_OF_2)
    if pid == 0:
        tl.store(scale_ptr, scale)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(data_ptr + offsets, to_float8_bits(x, scale, FP8_MAX, MANTISSA_BITS, EXPONENT_BIAS), mask=mask)


@triton.jit
def _rowwise_cast_kernel(x_ptr, data_ptr, scale_ptr, num_kept, num_reduced,
                         x_stride_kept, x_stride_reduced, data_stride_kept, data_stride_reduced,
                         FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, EXPONENT_BIAS: tl.constexpr,
                         ROUND_TO_POWER_OF_2: tl.constexpr, BLOCK_KEPT: tl.constexpr, BLOCK_REDUCED: tl.constexpr):
    """One scale per index of the kept axis, from the amax over the reduced axis of a 2D view given by strides.

    Reducing rows (dim -1) and columns (dim 0) differ only in which stride is 1; Triton specializes a stride of 1
    as a constant, so either way the loads run along the contiguous axis without a transpose.
    """
    kept = tl.program_id(0).to(tl.int64) * BLOCK_KEPT + tl.arange(0, BLOCK_KEPT)
    kept_mask = kept < num_kept
    x_lines = x_ptr + kept[:, None] * x_stride_kept
    data_lines = data_ptr + kept[:, None] * data_stride_kept
    amax_bits = tl.zeros([BLOCK_KEPT, BLOCK_REDUCED], tl.int32)
    for start in range(0, num_reduced, BLOCK_REDUCED):
        reduced = start + tl.arange(0, BLOCK_REDUCED).to(tl.int64)
        mask = kept_mask[:, None] & (reduced[None, :] < num_reduced)
        x = tl.load(x_lines + reduced[None, :] * x_stride_reduced, mask=mask, other=0.0)
        amax_bits = tl.maximum(amax_bits, abs_bits(x))
    amax = tl.max(amax_bits, 1).to(tl.float32, bitcast=True)
    scale = _amax_to_scale(amax, FP8_MAX, ROUND_TO_POWER_OF_2)
    tl.store(scale_ptr + kept, scale, mask=kept_mask)
    for start in range(0, num_reduced, BLOCK_REDUCED):
        reduced = start + tl.arange(0, BLOCK_REDUCED).to(tl.int64)
        mask = kept_mask[:, None] & (reduced[None, :] < num_reduced)
        x = tl.load(x_lines + reduced[None, :] * x_stride_reduced, mask=mask)
        codes = to_float8_bits(x, scale[:, None], FP8_MAX, MANTISSA_BITS, EXPONENT_BIAS)
        tl.store(data_lines + reduced[None, :] * data_stride_reduced, codes, mask=mask)


def triton_tensorwise_cast(x: Tensor, float8_dtype: torch.dtype,
                           round_to_power_of_2: bool = False) -> tuple[Tensor, Tensor]:
    """casts.torch_tensorwise_cast in two kernels: partial maxima, then scale and cast. Data keeps x's strides
    when x is dense, as the torch path's elementwise ops do."""
    fmt = float8_format(float8_dtype)
    data = torch.empty_like(x, dtype=float8_dtype)
    if data.stride() != x.stride():
        x = x.contiguous()  # not dense (a slice, an expand): the kernels walk storage linearly, data's layout
    numel = x.numel()
    num_blocks = triton.cdiv(numel, TENSORWISE_BLOCK)
    num_partials = min(num_blocks, MAX_PARTIALS)
    partial_amax = torch.empty(num_partials, dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(num_partials,)](x, partial_amax, numel, BLOCK=TENSORWISE_BLOCK)
    _tensorwise_cast_kernel[(num_blocks,)](
        x, data.view(torch.uint8), partial_amax, scale, numel, num_partials,
        FP8_MAX=fmt.max, MANTISSA_BITS=fmt.mantissa_bits, EXPONENT_BIAS=fmt.exponent_bias,
        ROUND_TO_POWER_OF_2=round_to_power_of_2, BLOCK=TENSORWISE_BLOCK, PARTIALS_BLOCK=MAX_PARTIALS)
    return data, scale


def view_2d_along(x: Tensor, dim: int, kernel_name: str) -> tuple[Tensor, bool]:
    """(x as 2D, whether `dim` is the last): rows of the last dim for dim -1, columns of the first for dim 0. The
    kernels reduce along one axis of a 2D view, so other dims are an error naming the torch path to use."""
    along_last = dim % x.ndim == x.ndim - 1
    if not along_last and dim % x.ndim != 0:
        raise ValueError(f"{kernel_name} works along the first or the last dim of x (got dim={dim} for shape "
                         f"{tuple(x.shape)}); use the plain torch path for other dims.")
    return (x.reshape(-1, x.shape[-1]) if along_last else x.reshape(x.shape[0], -1)), along_last


def triton_rowwise_cast(x: Tensor, float8_dtype: torch.dtype, dim: int,
                        round_to_power_of_2: bool = True) -> tuple[Tensor, Tensor]:
    """casts.torch_rowwise_cast in one kernel, for `dim` the first or the last dim of x."""
    fmt = float8_format(float8_dtype)
    x_2d, reduce_last = view_2d_along(x, dim, "triton_rowwise_cast")
    data_2d = torch.empty_like(x_2d, dtype=float8_dtype)
    kept_axis, (block_kept, block_reduced) = (0, LAST_DIM_TILE) if reduce_last else (1, FIRST_DIM_TILE)
    reduced_axis = 1 - kept_axis
    scale = torch.empty(x_2d.shape[kept_axis], dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x_2d.shape[kept_axis], block_kept),)
    _rowwise_cast_kernel[grid](
        x_2d, data_2d.view(torch.uint8), scale, x_2d.shape[kept_axis], x_2d.shape[reduced_axis],
        x_2d.stride(kept_axis), x_2d.stride(reduced_axis), data_2d.stride(kept_axis), data_2d.stride(reduced_axis),
        FP8_MAX=fmt.max, MANTISSA_BITS=fmt.mantissa_bits, EXPONENT_BIAS=fmt.exponent_bias,
        ROUND_TO_POWER_OF_2=round_to_power_of_2, BLOCK_KEPT=block_kept, BLOCK_REDUCED=block_reduced)
    scale_shape = list(x.shape)
    scale_shape[dim] = 1
    return data_2d.view(x.shape), scale.view(scale_shape)
