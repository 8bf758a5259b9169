"""NVFP4 quantization, NVIDIA's 4-bit training format, in torchao 0.18's arithmetic.

A block of 16 consecutive elements along the matmul's contraction dim shares an E4M3 scale s, and the whole tensor
an fp32 scale S; an element stands for e * s * S, e in E2M1 (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}). The two levels are
NVIDIA's ("Pretraining Large Language Models with NVFP4", arXiv:2509.25149): S = amax / (448 * 6) puts the tensor's
amax at the top of E4M3 times the top of E2M1, so that block scales, unlike MX's powers of two, keep E4M3's 3
mantissa bits over the tensor's range.

Conversion, op for op as torchao's nvfp4_quantize (torchao/prototype/mx_formats/nvfp4_tensor.py) with
per_tensor_scale = per_tensor_amax_to_scale(amax), so that the bytes match it:
  s = E4M3(clamp((block amax / 6) / S, 2**-6, 448)), to nearest even;
  e = E2M1(clamp(x * ((1 / S) / s), -6, 6)), to nearest even, or stochastically (below).
Rounding s to nearest can put the block's amax up to 1/16 above 6 after scaling, where it saturates to 6. The Triton
kernels of torchao's training recipe (torchao/prototype/moe_training/nvfp4_training) compute the same quantities in
another order, with g = 2688 / amax: (block amax / 6) * g and x * (1 / (s * (1 / g))), and with Triton's fp32
division, which need not round correctly. Their fp32 intermediates can differ from these in the last bit, which
changes a scale or an element only where that bit decides its rounding.

Special values:
  - a block whose amax is below amax / 28672 (an all-zero block, say) takes the clamp's floor 2**-6, E4M3's
    smallest normal: its elements lose precision and the smallest round to zero;
  - an all-zero tensor takes S = 1, as torchao's Triton kernels do (their encode scale is 1 when amax is 0), where
    nvfp4_quantize would divide 0 by 0: its blocks take 2**-6 and its elements are zeros;
  - a NaN or an infinity anywhere makes S NaN or infinite, so every value dequantizes to NaN (an infinite S times a
    zero element included): the matmul's output is NaN and the trainer's NaN stop sees it.

Stochastic rounding (of gradients): a scaled magnitude m between neighbouring E2M1 values lo < hi rounds to hi with
probability (m - lo) / (hi - lo), so that its expected value is m. torchao's kernels draw it in hardware
(cvt.rs.satfinite.e2m1x4.f32 fed Philox bits); here the same rule draws from uniform noise that the caller
passes: the same distribution, up to how many random bits the instruction uses, but not the same draws.

Two elements pack into a byte, the even-indexed one in the low nibble: torchao's pack_uint4, the layout that
torch.float4_e2m1fn_x2 views and the block-scaled GEMMs read.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from titan.quant.formats import E2M1_MAX, E2M1_VALUES, E4M3, NVFP4_BLOCK_SIZE

E4M3_MAX = torch.finfo(E4M3).max
E4M3_SMALLEST_NORMAL = torch.finfo(E4M3).tiny
"""2**-6: torchao's floor on block scales (its E4M3_EPS), so that they never use E4M3's subnormals."""
_E2M1_SIGN = 0x8
_E2M1_MAGNITUDE = 0x7


class NVFP4(NamedTuple):
    """A tensor (..., K) quantized in blocks along its last dim."""

    data: Tensor
    """uint8 (..., K / 2): E2M1 codes, two a byte."""
    block_scales: Tensor
    """float8_e4m3fn (..., K / 16)."""
    tensor_scale: Tensor
    """fp32 scalar S."""


def check_shape(x: Tensor, dims: tuple[int, ...]) -> None:
    """Raise unless each of `dims` of x splits into whole NVFP4 blocks of 16."""
    bad = [dim for dim in dims if x.shape[dim] % NVFP4_BLOCK_SIZE]
    if bad:
        raise ValueError(f"NVFP4 quantization needs dims {dims} of shape {tuple(x.shape)} to be multiples of "
                         f"{NVFP4_BLOCK_SIZE} (dims {bad} are not); pad them or keep this tensor in high precision.")


def tensor_scale(amax: Tensor) -> Tensor:
    """S = amax / (448 * 6) in fp32 (torchao's per_tensor_amax_to_scale), and 1 for an all-zero tensor."""
    amax = amax.float()
    return torch.where(amax == 0, 1.0, amax / (E4M3_MAX * E2M1_MAX))


def e2m1_grid(device: torch.device) -> Tensor:
    """The E2M1 magnitudes by code, E2M1_VALUES, in fp32 on `device`, built from arange: a list copied to a GPU
    (torch.tensor) would make the host wait for the device, and the dry run's fake GPU cannot take one."""
    code = torch.arange(len(E2M1_VALUES), device=device, dtype=torch.float32)
    # Codes 0 and 1 are 0 and the subnormal 0.5; from code 2 on, 2 ** (code // 2 - 1) x (1 + mantissa bit / 2).
    normal = torch.exp2(torch.floor(code / 2) - 1) * (1 + torch.remainder(code, 2) / 2)
    return torch.where(code < 2, code / 2, normal)


def e2m1_codes(scaled: Tensor) -> Tensor:
    """uint8 E2M1 codes of fp32 values in [-6, 6], to nearest with ties to even: a magnitude's code counts the
    midpoints between neighbouring E2M1 values below it, a midpoint it equals counting when the code above is even."""
    magnitude = scaled.abs().contiguous()  # bucketize copies a non-contiguous input
    grid = e2m1_grid(scaled.device)
    midpoints = (grid[:-1] + grid[1:]) / 2  # midpoint i lies below code i + 1
    below = torch.bucketize(magnitude, midpoints)  # midpoints < magnitude
    tie = torch.bucketize(magnitude, midpoints, right=True) > below  # magnitude equals midpoint `below`
    codes = below + (tie & (below % 2 == 1))  # a tie rounds up when the code above, below + 1, is even
    return codes.to(torch.uint8) | (torch.signbit(scaled).to(torch.uint8) << 3)


def e2m1_values(codes: Tensor) -> Tensor:
    """The fp32 values of uint8 E2M1 codes (code 8 is -0.0)."""
    magnitudes = e2m1_grid(codes.device)[(codes & _E2M1_MAGNITUDE).long()]
    return torch.where((codes & _E2M1_SIGN) != 0, -magnitudes, magnitudes)


def round_stochastically(scaled: Tensor, noise: Tensor) -> Tensor:
    """fp32 values in [-6, 6] moved to the E2M1 value just below or just above their magnitude, above with
    probability (magnitude - below) / (above - below) given `noise` uniform in [0, 1): unbiased."""
    grid = e2m1_grid(scaled.device)
    magnitude = scaled.abs()
    below = torch.bucketize(magnitude, grid, right=True) - 1  # grid[below] <= magnitude < grid[below + 1]
    lower = grid[below]
    gap = grid[(below + 1).clamp(max=len(E2M1_VALUES) - 1)] - lower  # 0 only at 6, the top
    return torch.copysign(torch.where(noise * gap < magnitude - lower, lower + gap, lower), scaled)


def pack(codes: Tensor) -> Tensor:
    """uint8 codes (..., K) two a byte (..., K / 2), the even-indexed code in the low nibble."""
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def unpack(data: Tensor) -> Tensor:
    """The codes (..., K) of packed bytes (..., K / 2)."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def quantize_blocks(blocks: Tensor, block_amax: Tensor, scale: Tensor,
                    noise: Tensor | None) -> tuple[Tensor, Tensor]:
    """(uint8 E2M1 codes, E4M3 scales) of fp32 blocks (..., 16) whose amaxes are `block_amax` (..., 1) under the
    tensor scale `scale`; `noise` (blocks' shape) rounds elements stochastically, None to nearest."""
    block_scales = torch.clamp((block_amax / E2M1_MAX) / scale, min=E4M3_SMALLEST_NORMAL, max=E4M3_MAX).to(E4M3)
    scaled = torch.clamp(blocks * ((1.0 / scale) / block_scales.float()), -E2M1_MAX, E2M1_MAX)
    if noise is not None:
        scaled = round_stochastically(scaled, noise)
    return e2m1_codes(scaled), block_scales


def quantize(x: Tensor, noise: Tensor | None = None) -> NVFP4:
    """x (..., K) in NVFP4, blocks of 16 along the last dim, S from x's amax. `noise` (x's shape, uniform in [0, 1))
    rounds the elements stochastically; None rounds them to nearest."""
    check_shape(x, (-1,))
    x_fp32 = x.float()
    blocks = x_fp32.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # (..., K / 16, 16)
    block_noise = None if noise is None else noise.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    scale = tensor_scale(x_fp32.abs().amax())
    codes, block_scales = quantize_blocks(blocks, blocks.abs().amax(dim=-1, keepdim=True), scale, block_noise)
    return NVFP4(pack(codes.flatten(-2)), block_scales.squeeze(-1), scale)


def quantize_2d(x: Tensor) -> NVFP4:
    """x (rows, cols) in 16x16 tiles that share a scale (NVIDIA's 2D weight scaling), rounded to nearest: as
    `quantize` with the blocks along the last dim, each block scaled by its tile's amax. A tile's amax is its
    transpose's, so quantize_2d(x.t()) holds x's values transposed: a weight quantizes to the same values for the
    output (blocks along K) and for grad_input (blocks along N)."""
    check_shape(x, (0, 1))
    rows, cols = x.shape
    # (rows / 16, 16, cols / 16, 16): the last dim holds the blocks, dims 0 and 2 number the tiles
    tiles = x.float().unflatten(0, (-1, NVFP4_BLOCK_SIZE)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    tile_amax = tiles.abs().amax(dim=(1, 3), keepdim=True)  # (rows / 16, 1, cols / 16, 1)
    scale = tensor_scale(tile_amax.amax())
    codes, tile_scales = quantize_blocks(tiles, tile_amax, scale, noise=None)  # tile_scales like tile_amax
    block_scales = tile_scales.expand(-1, NVFP4_BLOCK_SIZE, -1, -1).reshape(rows, cols // NVFP4_BLOCK_SIZE)
    return NVFP4(pack(codes.reshape(rows, cols)), block_scales, scale)


def dequantize(q: NVFP4, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The values (..., K) that `q` stands for, e * s * S, as `out_dtype`. e * s is exact (at most 2 + 4 significant
    bits), so only the product with S rounds, as in torchao's _nvfp4_dequantize."""
    values = e2m1_values(unpack(q.data)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # (..., K / 16, 16)
    values = values * q.block_scales.float().unsqueeze(-1) * q.tensor_scale
    return values.flatten(-2).to(out_dtype)


def hadamard_rotation(signs: tuple[int, ...], device: torch.device) -> Tensor:
    """diag(signs) @ H / sqrt(16), fp32 (16, 16) on `device`, H the 16x16 Sylvester Hadamard matrix: orthogonal, since
    H @ H^T = 16 I; torchao's get_rht_matrix. `signs` are 16 values of +-1. Built from arange, as e2m1_grid is."""
    index = torch.arange(NVFP4_BLOCK_SIZE, device=device)
    both = index[:, None] & index[None, :]  # (16, 16)
    # Sylvester's H[i, j] = (-1) ** popcount(i & j), the Kronecker powers of [[1, 1], [1, -1]]
    parity = sum((both >> bit) & 1 for bit in range(NVFP4_BLOCK_SIZE.bit_length() - 1)) % 2
    negative = sum((index == row).int() for row, sign in enumerate(signs) if sign < 0)  # (16,): 1 where sign is -1
    return (1 - 2 * parity).float() * (1 - 2 * negative).float()[:, None] / NVFP4_BLOCK_SIZE**0.5


def rotate(x: Tensor, signs: tuple[int, ...]) -> Tensor:
    """x (..., L) with each run of 16 along the last dim multiplied by hadamard_rotation(signs), in x's dtype: the
    products summed in fp32 and rounded once, as torchao's kernels apply the transform (a bf16 tl.dot into fp32,
    then cast to bf16)."""
    check_shape(x, (-1,))
    # One (runs, 16) @ (16, 16) matmul: a batched one over a transposed x is orders of magnitude slower on the CPU.
    blocks = x.float().reshape(-1, NVFP4_BLOCK_SIZE)  # (runs of 16, 16)
    return (blocks @ hadamard_rotation(signs, x.device)).to(x.dtype).reshape(x.shape)
