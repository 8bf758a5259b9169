"""Where Blackwell's block-scaled matmuls read each E8M0 scale: the "blocked" layouts of `torch._scaled_mm` (cuBLAS)
and of the MXFP8 `torch._scaled_grouped_mm` (a CUTLASS grouped GEMM: mx8mx8bf16_grouped_mm, FBGEMM's, now MSLK's).

Both read a matrix's scales (rows, K / 32) in tiles of 128 rows x 4 scale columns ("1D block scaling factors
layout", cuBLAS docs): padded with zeros to whole tiles, tiles in row-major order, 512 contiguous bytes each. A
grouped matmul reads one such tiled matrix per group, from a start that its argument kernel computes on the device
from `offs` (MSLK's set_grouped_gemm_args_kernel, include/mslk/gemm/cutlass/grouped_common.cuh):
  2d x 3d (output, grad_input): a's groups are blocks of rows; group g's tiles start at row
      sum over earlier groups of round_up(rows, 128), so each group starts a new tile. b is one matrix per expert,
      expert e's tiles at e * round_up(N, 128) * round_up(K / 32, 4).
  2d x 2d (grad_weight): the groups run along the contraction dim (the tokens); both operands' group g tiles start
      at round_up(rows, 128) * sum over earlier groups of round_up(tokens / 32, 4).
The group sizes live on the device, so the grouped layouts never read them on the host (a sync, and a graph break
under torch.compile and CUDA graphs): they gather into buffers sized by an upper bound, each group adding at most
one tile of padding. The layouts equal torchao's torch references (tests/test_mx_blocked.py).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from titan.quant.formats import MX_BLOCK_SIZE

SCALE_TILE = (128, 4)
"""Block-scaled GEMMs read scales in tiles of 128 rows x 4 scale columns, each tile 512 contiguous bytes."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def to_blocked(codes: Tensor) -> Tensor:
    """Scales (..., rows, K / 32) laid out as cuBLAS's block-scaled GEMMs read them ("1D block scaling factors
    layout", cuBLAS docs): padded to whole 128 x 4 tiles, tiles in row-major order, and inside a tile the scale of
    row r and column c at byte (r % 32) * 16 + (r // 32) * 4 + c. Returns (..., tile bytes): for one matrix the flat
    buffer `torch._scaled_mm` takes, for a stack of matrices one flat buffer each."""
    *batch, rows, cols = codes.shape
    tile_rows, tile_cols = SCALE_TILE
    padded = F.pad(codes, (0, -cols % tile_cols, 0, -rows % tile_rows))
    num_row_tiles, num_col_tiles = padded.shape[-2] // tile_rows, padded.shape[-1] // tile_cols
    # (..., tile_row, r // 32, r % 32, tile_col, c): row = tile_row * 128 + r, col = tile_col * 4 + c
    tiles = padded.view(*batch, num_row_tiles, 4, 32, num_col_tiles, tile_cols)
    return tiles.transpose(-4, -2).flatten(-5)  # (..., tile_row, tile_col, r % 32, r // 32, c) flattened


def to_blocked_per_expert(codes: Tensor) -> Tensor:
    """Scales (E, rows, K / 32) of a stack of expert weights, each laid out by `to_blocked`: (E, round_up(rows, 128) *
    round_up(K / 32, 4)) uint8. scale_b of the 2d x 3d grouped matmuls: the output's weight W (E, N, K) in blocks
    along K (rows = N), and grad_input's W in blocks along N, its scales (E, K, N / 32) (rows = K)."""
    return to_blocked(codes)


def padded_positions(offsets: Tensor, multiple: int, length: int, padding_index: int) -> tuple[Tensor, Tensor]:
    """Where the items of a dim land when each group of them starts at a multiple of `multiple`, groups given by their
    end offsets (num_groups,) along the dim. For each of the first `length` positions: the index of the item it holds,
    or `padding_index` where it holds padding; and its group, num_groups past the last group."""
    ends = offsets.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_sizes = (sizes + multiple - 1) // multiple * multiple
    padded_ends = torch.cumsum(padded_sizes, dim=0)
    position = torch.arange(length, device=offsets.device)
    # The first group ending after the position: an empty group ends where it starts, so it never matches.
    group = torch.searchsorted(padded_ends, position, right=True)
    last_group = group.clamp(max=offsets.shape[0] - 1)
    local = position - (padded_ends - padded_sizes)[last_group]
    # Past the last group, local >= its padded size >= its size, so those positions read padding too.
    index = torch.where(local < sizes[last_group], (ends - sizes)[last_group] + local, padding_index)
    return index, group


def to_blocked_m_groups(codes: Tensor, offsets: Tensor) -> Tensor:
    """Scales (rows, K / 32) of a matrix whose groups are blocks of rows, ending at `offsets` (num_groups,) on the
    device, each group laid out by `to_blocked` from a new 128-row tile; rows past the last group are left out.
    Returns (round_up(rows + num_groups * 128, 128), round_up(K / 32, 4)) uint8, zeros past the last group's tiles.
    scale_a of the 2d x 3d grouped matmuls: the output's tokens x (rows, K) and grad_input's grad_output (rows, N)."""
    rows, _ = codes.shape
    out_rows = round_up(rows + offsets.shape[0] * SCALE_TILE[0], SCALE_TILE[0])
    row, _ = padded_positions(offsets, SCALE_TILE[0], out_rows, padding_index=rows)
    # (out_rows, K / 32): each group from a multiple of 128 rows, the appended zero row between
    padded = F.pad(codes, (0, 0, 0, 1))[row]
    return to_blocked(padded).view(out_rows, -1)  # (out_rows, round_up(K / 32, 4))


def to_blocked_k_groups(codes: Tensor, offsets: Tensor) -> Tensor:
    """Scales (rows, tokens / 32) of a matrix whose contraction dim, the tokens, is split into groups ending at
    `offsets` (num_groups,) on the device, each a multiple of 32 tokens; each group's columns laid out by `to_blocked`
    as its own matrix, one after another; tokens past the last group are left out. Returns (round_up(rows, 128),
    round_up(tokens / 32 + num_groups * 4, 4)) uint8, zeros past the last group's tiles. scale_a and scale_b of the
    2d x 2d grouped matmul grad_weight = grad_output^T @ x: grad_output^T (N, tokens) and x^T (K, tokens)."""
    rows, num_scale_cols = codes.shape
    tile_rows, tile_cols = SCALE_TILE
    out_cols = round_up(num_scale_cols + offsets.shape[0] * tile_cols, tile_cols)
    col, group = padded_positions(offsets // MX_BLOCK_SIZE, tile_cols, out_cols, padding_index=num_scale_cols)
    # (rows, out_cols): each group from a multiple of 4 columns, the appended zero column between
    padded = F.pad(codes, (0, 1))[:, col]
    tiles = to_blocked(padded).view(-1, tile_rows * tile_cols)  # (row tiles * col tiles, 512), row-tile major
    # The kernel reads group after group, each group's tiles row-tile major: a stable sort by group keeps that order
    # within each group. Tiles past the last group (group num_groups) hold zeros and sort last.
    tile_group = group[::tile_cols].expand(round_up(rows, tile_rows) // tile_rows, -1)  # (row tiles, col tiles)
    order = torch.argsort(tile_group.flatten(), stable=True)
    return tiles[order].view(-1, out_cols)  # (round_up(rows, 128), out_cols)
