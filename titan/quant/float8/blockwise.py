"""Blockwise float8 (--float8.recipe_name blockwise): DeepSeek-V3's recipe (arXiv:2412.19437, section 3.3) as
torchao's prototype defines it (torchao/prototype/blockwise_fp8_training): E4M3 in every matmul; activations and
gradients in tiles of 1 x 128 along the matmul's contraction dim, weights in blocks of 128 x 128; each tile's scale
maps its amax onto 448 (not rounded to a power of 2). Scales are kept as their inverses, what the kernels and
DeepSeek's checkpoints (`weight_scale_inv`) multiply by.

For y = x @ W^T with x (M, K), W (N, K) and grad_output g (M, N):
  output       x (tiles along K) @ W^T (blocks)
  grad_input   g (tiles along N) @ W (blocks)
  grad_weight  g^T (tiles along M) @ x (tiles along M, down each column)
The contraction dims K and N are multiples of 128 (the converter keeps other layers in high precision); the tokens M
of grad_weight are zero-padded to one, which changes no tile's amax and adds nothing (torchao asks for a multiple).

A tile or block that the grid's edge cuts (a dim that is not a multiple of 128: DeepSeek-V3's 576-row wkv_a in its
checkpoints) takes the amax of the elements it holds: the grid is ceil-sized, as DeepSeek's `weight_scale_inv` is.

Native: torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 scales, cuBLASLt's DeepSeek-style
kernels, which torch builds for Hopper alone (compute capability 9.x, cuBLASLt 12.9+) and which write bf16. Emulated
(--float8.emulate): the same float8 values, dequantized (data x inverse scale, in fp32) and multiplied in fp32.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from titan.quant.float8.casts import amax_to_scale, cast_to_float8
from titan.quant.formats import E4M3, FLOAT8_BLOCK_SIZE
from titan.quant.quantized_linear import QuantizedLinear, in_dtype, multiply_shards

BLOCK = FLOAT8_BLOCK_SIZE


def padded_to_blocks(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """x zero-padded at the end of each of `dims` (negative: of its last two) to a multiple of 128."""
    pad = [0, 0, 0, 0]  # F.pad's (last dim's left, right, the one before's left, right)
    for dim in dims:
        pad[1 if dim % x.dim() == x.dim() - 1 else 3] = -x.shape[dim] % BLOCK
    return F.pad(x, pad) if any(pad) else x


def tile_cast(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """(E4M3 data of x's shape, fp32 inverse scales) of a 2-D x in tiles of 1 x 128 running along `dim` (0 or 1):
    the scales are (rows, ceil(cols / 128)) along dim 1 and (ceil(rows / 128), cols) along dim 0."""
    dim %= 2
    padded = padded_to_blocks(x.float(), (dim - 2,))
    tiles = padded.movedim(dim, -1).unflatten(-1, (-1, BLOCK))  # (kept, tiles, 128)
    scale = amax_to_scale(tiles.abs().amax(dim=-1, keepdim=True), E4M3, round_to_power_of_2=False)
    data = cast_to_float8(tiles, E4M3, scale).flatten(-2).movedim(-1, dim)
    return data[:x.shape[0], :x.shape[1]], scale.reciprocal().squeeze(-1).movedim(-1, dim)


def block_cast(x: Tensor) -> tuple[Tensor, Tensor]:
    """(E4M3 data of x's shape, fp32 inverse scales (..., ceil(rows / 128), ceil(cols / 128))) of x (..., rows,
    cols), a matrix or a stack of them, in blocks of 128 x 128 of each matrix."""
    rows, cols = x.shape[-2:]
    padded = padded_to_blocks(x.float(), (-2, -1))
    blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # (..., row blocks, 128, col blocks, 128)
    scale = amax_to_scale(blocks.abs().amax(dim=(-3, -1), keepdim=True), E4M3, round_to_power_of_2=False)
    data = cast_to_float8(blocks, E4M3, scale).flatten(-2).flatten(-3, -2)
    return data[..., :rows, :cols], scale.reciprocal()[..., 0, :, 0]


def expand_scales(scale_inv: Tensor, shape: torch.Size, rows_per_scale: int, cols_per_scale: int,
                  first: tuple[int, int] = (0, 0)) -> Tensor:
    """Each inverse scale (..., row groups, column groups) repeated over the elements it covers, cut to a box of
    `shape` that starts `first` (row, column) elements into the first group (a shard's box of a matrix whose groups
    the shard's edges cut)."""
    expanded = scale_inv.repeat_interleave(rows_per_scale, -2).repeat_interleave(cols_per_scale, -1)
    return expanded[..., first[0]:first[0] + shape[-2], first[1]:first[1] + shape[-1]]


def dequantize_tiles(data: Tensor, scale_inv: Tensor, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values of tile_cast's (data, scale_inv) along `dim`, data x scale_inv as the kernels multiply, in `dtype`
    (fp32, or bf16 as torchao's emulated grouped matmul multiplies them: the scale rounded to bf16 first)."""
    rows, cols = (1, BLOCK) if dim % 2 else (BLOCK, 1)
    return data.to(dtype) * expand_scales(scale_inv, data.shape, rows, cols).to(dtype)


def dequantize_blocks(data: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values of block_cast's (data, scale_inv), of a matrix or a stack of them, in `dtype` (as
    dequantize_tiles)."""
    return data.to(dtype) * expand_scales(scale_inv, data.shape, BLOCK, BLOCK).to(dtype)


def column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


def kernel_block_scales(scale_inv: Tensor) -> Tensor:
    """A right operand's 128 x 128 inverse scales (contraction blocks, output blocks) as cuBLASLt reads them: the
    contraction's block count padded to a multiple of 4 (with 1.0, which no block reads), column-major."""
    padding = -scale_inv.shape[0] % 4
    return column_major(F.pad(scale_inv, (0, 0, 0, padding), value=1.0))


def local_blockwise_mm(a: Tensor, b: Tensor, b_blocks: bool, emulate: bool) -> Tensor:
    """a (M, C) @ b (C, N) for plain tensors: a in tiles along C, b in 128 x 128 blocks (`b_blocks`, a weight) or in
    tiles down its columns; in fp32 (emulated) or bf16 (native). C is zero-padded to a multiple of 128."""
    a, b = padded_to_blocks(a, (1,)), padded_to_blocks(b, (0,))
    a_data, a_scale = tile_cast(a, 1)  # scales (M, C / 128)
    b_data, b_scale = block_cast(b) if b_blocks else tile_cast(b, 0)  # (C / 128, N / 128) or (C / 128, N)
    if emulate:
        b_values = dequantize_blocks(b_data, b_scale) if b_blocks else dequantize_tiles(b_data, b_scale, 0)
        return dequantize_tiles(a_data, a_scale, 1) @ b_values
    recipe_b = F.ScalingType.BlockWise128x128 if b_blocks else F.ScalingType.BlockWise1x128
    # cuBLASLt reads a's scales and b's tile scales (N, C / 128) column-major, b's block scales padded.
    # grad_weight's a is g^T, a transposed view, whose float8 copy comes out column-major: the kernel wants rows.
    return F.scaled_mm(a_data.contiguous(), column_major(b_data), scale_a=column_major(a_scale),
                       scale_recipe_a=F.ScalingType.BlockWise1x128,
                       scale_b=kernel_block_scales(b_scale) if b_blocks else column_major(b_scale.t()),
                       scale_recipe_b=recipe_b,
                       output_dtype=torch.bfloat16)


def blockwise_mm(a: Tensor, b: Tensor, b_blocks: bool, emulate: bool) -> Tensor:
    """local_blockwise_mm for plain tensors or tensor-parallel DTensors (shard by shard)."""
    return multiply_shards(a, b, partial(local_blockwise_mm, b_blocks=b_blocks, emulate=emulate), "Blockwise float8")


class BlockwiseMatmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with all three matmuls in blockwise float8. Saves the high-precision input and
    weight (as nn.Linear does) and quantizes them again for each backward matmul, as torchao does."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, emulate: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.emulate = emulate
        return in_dtype(blockwise_mm(x, weight.t(), b_blocks=True, emulate=emulate), x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_input = blockwise_mm(grad, weight, b_blocks=True, emulate=ctx.emulate)
        grad_weight = blockwise_mm(grad.t(), x, b_blocks=False, emulate=ctx.emulate)
        return grad_input.to(grad.dtype), grad_weight.to(weight.dtype), None


class Float8BlockwiseLinear(QuantizedLinear):
    """nn.Linear with blockwise float8 matmuls; the parameters stay in high precision for the optimizer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, emulate: bool,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        if in_features % BLOCK or out_features % BLOCK:
            raise ValueError(f"Float8BlockwiseLinear needs in_features and out_features divisible by {BLOCK}, since "
                             f"each is some matmul's contraction dim (got {out_features}x{in_features}); keep this "
                             f"layer in high precision.")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.emulate = emulate

    def matmul(self, x_2d: Tensor) -> Tensor:
        return BlockwiseMatmul.apply(x_2d, self.weight, self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8=blockwise{', emulated' if self.emulate else ''}"
