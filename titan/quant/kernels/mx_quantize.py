"""Fused Triton MX quantize (block amax, E8M0 scale, element cast) along rows or columns, bit-exact with
torch_quantize in titan/quant/mx/numerics.py.

One pass: each program loads a tile holding whole blocks, reduces each block's amax in registers, and writes the
element codes and the scale codes; the torch path reads x once for the amax and again for the cast. Element codes
come from the float8 casts' integer-bit conversion (titan/quant/kernels/float8_cast.py), which runs on every GPU
and under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan.quant.formats import E8M0_NAN, check_blocks, float8_format
from titan.quant.kernels.float8_cast import abs_bits, to_float8_bits, view_2d_along

ROWS_TILE = (16, 4)
"""(kept rows, blocks per row) per program when blocks run along the last, contiguous dim: 16 x 128 elements."""
COLUMNS_TILE = (64, 2)
"""(kept columns, blocks per column) per program when blocks run along dim 0: 64 contiguous columns of 64 rows,
so a (tokens, dim) tensor spreads over (dim / 64) x (tokens / 64) programs."""

# Compiled Triton reads module globals only as constexprs (the interpreter reads any global, so CPU tests missed it).
_E8M0_NAN = tl.constexpr(E8M0_NAN)


@triton.jit
def _mx_quantize_kernel(x_ptr, data_ptr, scale_ptr, num_kept, num_reduced,
                        x_stride_kept, x_stride_reduced, data_stride_kept, data_stride_reduced,
                        scale_stride_kept, scale_stride_reduced,
                        EMAX: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                        EXPONENT_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_KEPT: tl.constexpr,
                        BLOCKS_PER_PROGRAM: tl.constexpr, ROUND_UP: tl.constexpr):
    """Blocks of BLOCK_SIZE along the reduced axis of a 2D view given by strides; program (i, j) handles kept
    indices i * BLOCK_KEPT + [0, BLOCK_KEPT) and blocks j * BLOCKS_PER_PROGRAM + [0, BLOCKS_PER_PROGRAM)."""
    kept = tl.program_id(0).to(tl.int64) * BLOCK_KEPT + tl.arange(0, BLOCK_KEPT)
    TILE_REDUCED: tl.constexpr = BLOCKS_PER_PROGRAM * BLOCK_SIZE
    reduced = tl.program_id(1).to(tl.int64) * TILE_REDUCED + tl.arange(0, TILE_REDUCED)
    # num_reduced is a multiple of BLOCK_SIZE, so the mask covers whole blocks
    mask = (kept[:, None] < num_kept) & (reduced[None, :] < num_reduced)
    x = tl.load(x_ptr + kept[:, None] * x_stride_kept + reduced[None, :] * x_stride_reduced, mask=mask, other=0.0)
    blocks_bits = tl.reshape(abs_bits(x), (BLOCK_KEPT, BLOCKS_PER_PROGRAM, BLOCK_SIZE))
    amax_bits = tl.max(blocks_bits, 2)  # (BLOCK_KEPT, BLOCKS_PER_PROGRAM); nan's bits sort above inf's
    if ROUND_UP:  # numerics.scale_codes, rceil: amax / FP8_MAX rounded up to a power of two
        descale = tl.div_rn(amax_bits.to(tl.float32, bitcast=True), tl.full(amax_bits.shape, FP8_MAX, tl.float32))
        descale_bits = descale.to(tl.int32, bitcast=True)
        exponent, mantissa = descale_bits >> 23, descale_bits & 0x7FFFFF
        codes = tl.where(exponent == 0, (mantissa > 0x400000).to(tl.int32), exponent + (mantissa != 0).to(tl.int32))
    else:  # numerics.scale_codes, floor
        codes = tl.maximum((amax_bits >> 23) - EMAX, 0)
    codes = tl.where(amax_bits >= 0x7F800000, _E8M0_NAN, codes)
    inverse_scale = (tl.maximum(254 - codes, 0) << 23).to(tl.float32, bitcast=True)  # numerics.inverse_scale_values
    inverse_scale = tl.where(codes == _E8M0_NAN, float("nan"), inverse_scale)
    x_blocks = tl.reshape(x, (BLOCK_KEPT, BLOCKS_PER_PROGRAM, BLOCK_SIZE))
    elements = to_float8_bits(x_blocks, inverse_scale[:, :, None], FP8_MAX, MANTISSA_BITS, EXPONENT_BIAS)
    elements = tl.reshape(elements, (BLOCK_KEPT, TILE_REDUCED))
    tl.store(data_ptr + kept[:, None] * data_stride_kept + reduced[None, :] * data_stride_reduced, elements, mask=mask)
    block = tl.program_id(1).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    scale_mask = (kept[:, None] < num_kept) & (block[None, :] < num_reduced // BLOCK_SIZE)
    scale_offsets = kept[:, None] * scale_stride_kept + block[None, :] * scale_stride_reduced
    tl.store(scale_ptr + scale_offsets, codes.to(tl.uint8), mask=scale_mask)


def triton_quantize(x: Tensor, block_size: int, elem_dtype: torch.dtype, dim: int,
                    rounding: str = "floor") -> tuple[Tensor, Tensor]:
    """numerics.torch_quantize in one kernel, for `dim` the first or the last dim of x: (uint8 codes, data), scales
    rounded as `rounding` ("floor" or "rceil") says."""
    check_blocks(x, block_size, dim)
    fmt = float8_format(elem_dtype)
    x_2d, along_last = view_2d_along(x, dim, "triton_quantize")
    data_2d = torch.empty_like(x_2d, dtype=elem_dtype, memory_format=torch.contiguous_format)
    kept_axis, (block_kept, blocks_per_program) = (0, ROWS_TILE) if along_last else (1, COLUMNS_TILE)
    reduced_axis = 1 - kept_axis
    scale_shape = list(x_2d.shape)
    scale_shape[reduced_axis] //= block_size
    codes_2d = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    num_kept, num_reduced = x_2d.shape[kept_axis], x_2d.shape[reduced_axis]
    grid = (triton.cdiv(num_kept, block_kept), triton.cdiv(num_reduced, block_size * blocks_per_program))
    _mx_quantize_kernel[grid](
        x_2d, data_2d.view(torch.uint8), codes_2d, num_kept, num_reduced,
        x_2d.stride(kept_axis), x_2d.stride(reduced_axis), data_2d.stride(kept_axis), data_2d.stride(reduced_axis),
        codes_2d.stride(kept_axis), codes_2d.stride(reduced_axis),
        EMAX=fmt.max_exponent, FP8_MAX=fmt.max, MANTISSA_BITS=fmt.mantissa_bits,
        EXPONENT_BIAS=fmt.exponent_bias, BLOCK_SIZE=block_size, BLOCK_KEPT=block_kept,
        BLOCKS_PER_PROGRAM=blocks_per_program, ROUND_UP=rounding == "rceil")
    codes_shape = list(x.shape)
    codes_shape[dim] //= block_size
    return codes_2d.view(codes_shape), data_2d.view(x.shape)
