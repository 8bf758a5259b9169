"""Facts about the low-precision formats that the casts, the Triton kernels, the MX and NVFP4 numerics and the
converter all use: the float8 dtypes and their bit layout, the amax floor of dynamic scaling, the MX block and E8M0
scale, and the NVFP4 block and its E2M1 elements.

It imports nothing from titan, so titan/quant's layers import one way:
formats <- kernels <- float8 casts and MX numerics <- linears <- FSDP's float8 all-gather and the converter.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12
"""Floor on amax, so an all-zero tensor (a zero-initialised weight, the gradient of an unused branch) scales by
max / EPS instead of max / 0 = inf, whose 0 * inf would make every element nan. Applied to the fp32 amax, so the
floor in effect is 1e-12 rounded to fp32. max / EPS (< 6e16 for E5M2) stays far inside fp32 range."""

FLOAT8_BLOCK_SIZE = 128
"""Side of blockwise float8's tiles (1 x 128 for activations and gradients) and blocks (128 x 128 for weights):
DeepSeek-V3's recipe, torchao's blockwise_fp8_training, and the weight_scale_inv grid of DeepSeek's FP8 checkpoints."""

MX_BLOCK_SIZE = 32
"""Elements per shared scale: the MX spec's block size k for every concrete MX format."""
E8M0_NAN = 0xFF
"""The E8M0 code that is NaN; every other code c stands for the scale 2**(c - 127) (MX spec section 5.4)."""

NVFP4_BLOCK_SIZE = 16
"""Elements per E4M3 block scale in NVFP4, along the matmul's contraction dim; also the side of the 16x16 weight
tiles and the length of the random Hadamard transform of torchao's (and NVIDIA's) NVFP4 training recipe."""
NVFP4_CONTRACTION_MULTIPLE = 32
"""What an NVFP4 matmul's contraction dim must be a multiple of: two FP4 elements a byte, and the block-scaled GEMMs
read each operand row in 16-byte units (torch's shape rule for scaled_mm asks the packed sizes to be multiples of 16,
in torch 2.11 to 2.13, as torchao's tests ask K to be of 32)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of FP4 E2M1 (NVFP4's element), indexed by the 3 low bits of its code; bit 3 is the sign."""
E2M1_MAX = E2M1_VALUES[-1]


@dataclass(frozen=True)
class Float8Format:
    """What the bit-level conversions need to know about a float8 dtype."""

    max: float
    mantissa_bits: int
    exponent_bias: int
    max_exponent: int
    """Exponent of the largest normal value, the MX spec's emax_elem: 448 = 1.75 * 2**8, 57344 = 1.75 * 2**15."""


def float8_format(float8_dtype: torch.dtype) -> Float8Format:
    if float8_dtype not in (E4M3, E5M2):
        raise ValueError(f"Titan's float8 casts and MX elements take torch.float8_e4m3fn or torch.float8_e5m2 "
                         f"(got {float8_dtype}); the fnuz variants encode nan and zero differently.")
    finfo = torch.finfo(float8_dtype)
    # eps = 2**-mantissa_bits and smallest_normal = 2**(1 - bias), by definition of both.
    return Float8Format(max=finfo.max, mantissa_bits=-round(math.log2(finfo.eps)),
                        exponent_bias=1 - round(math.log2(finfo.smallest_normal)),
                        max_exponent=int(finfo.max).bit_length() - 1)


def check_blocks(x: Tensor, block_size: int, dim: int) -> None:
    """Raise unless dim `dim` of x splits into whole MX blocks of `block_size` elements."""
    if x.shape[dim] % block_size:
        raise ValueError(f"MX quantization needs dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) to be "
                         f"a multiple of block_size {block_size}; pad it or use a dim that is.")
