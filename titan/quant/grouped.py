"""What the low-precision expert matmuls share: padding each expert's block of tokens to the kernels' alignment, the
grouped SwiGLU that runs a recipe's grouped matmul on the padded blocks, and the high-precision grouped matmul that
emulated recipes multiply their dequantized operands with.

Tokens arrive sorted by expert (titan/models/common/moe.py): expert e's counts[e] rows, then expert e + 1's. Scaled
grouped kernels need every block to start at a multiple of the alignment (16 rows for float8, 32 for MX, whose
weight-gradient blocks of 32 run along the tokens and must not span two experts). So each block is copied to a
zero-padded layout whose blocks start at multiples of the alignment; zero rows change no amax, quantize to zero and
add nothing to any product, so padding changes no number of the result. The layout is sized by an upper bound, not
by reading the counts on the host, so a step never waits for the device here.
"""

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from titan.models.common.moe import ExpertFunction, TokenCounts, grouped_mm_supported, matmul_dtype


@dataclass(frozen=True)
class PaddedGroups:
    """Where each token row goes in the padded layout, and that layout's expert blocks."""

    rows: Tensor
    """(tokens,) int64: the padded row of each token row."""
    offsets: Tensor
    """(experts,) int32: where each expert's padded block ends (torch._grouped_mm's offs)."""
    expert_of_row: Tensor
    """(num_rows,) int64: each padded row's expert; num_experts for the rows after the last block."""
    num_rows: int
    """Rows of the padded layout: tokens + experts x (alignment - 1), rounded up to the alignment. Rows after the
    last block belong to no expert: the kernels leave them undefined, so a recipe's grouped matmul sets them to
    zero before any cast of a whole tensor reads them."""

    def pad(self, x: Tensor) -> Tensor:
        """x (tokens, dim) -> (num_rows, dim), zeros between the blocks."""
        return x.new_zeros(self.num_rows, x.size(1)).index_copy(0, self.rows, x)

    def unpad(self, x: Tensor) -> Tensor:
        """(num_rows, dim) -> (tokens, dim): the token rows, in their original order."""
        return x.index_select(0, self.rows)

    def bias_rows(self, bias: Tensor) -> Tensor:
        """bias (experts, out) -> (num_rows, out): each token row's expert's bias, zero on the padding rows, which
        must stay zero rows."""
        num_experts = bias.size(0)
        token_row = torch.zeros(self.num_rows, dtype=torch.bool, device=bias.device).index_fill_(0, self.rows, True)
        rows = bias[self.expert_of_row.clamp(max=num_experts - 1)]  # (num_rows, out)
        return rows.masked_fill(~token_row[:, None], 0)


def pad_groups(counts: Tensor, num_tokens: int, alignment: int) -> PaddedGroups:
    """The padded layout of `num_tokens` rows sorted by expert, counts (experts,) of them per expert, with every
    expert's block starting at a multiple of `alignment`. Computed on the device, without reading counts."""
    num_experts = counts.size(0)
    padded_counts = (counts + alignment - 1) // alignment * alignment
    padded_ends = padded_counts.cumsum(0)
    shift = (padded_ends - padded_counts) - (counts.cumsum(0) - counts)  # (experts,): padded start - start
    expert = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts,
                                     output_size=num_tokens)  # (tokens,)
    rows = torch.arange(num_tokens, device=counts.device) + shift[expert]
    upper_bound = num_tokens + num_experts * (alignment - 1)
    num_rows = -(-upper_bound // alignment) * alignment
    offsets = padded_ends.to(torch.int32)
    expert_of_row = torch.bucketize(torch.arange(num_rows, device=counts.device, dtype=torch.int32), offsets,
                                    right=True)
    return PaddedGroups(rows, offsets, expert_of_row, num_rows)


GroupedMatmul = Callable[[Tensor, Tensor, PaddedGroups, TokenCounts], Tensor]
"""A recipe's differentiable grouped matmul: x (rows, in) in the padded layout @ each expert's weight (experts, out,
in) transposed -> (rows, out), with how the emulated per-expert matmuls learn the blocks' sizes."""


def padded_experts(x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                   token_counts: TokenCounts, grouped_mm: GroupedMatmul, alignment: int) -> Tensor:
    """The experts' `function` (titan/models/common/moe.py ExpertMatmuls) with `grouped_mm` for its matmuls, on token
    blocks padded to `alignment` rows, biases added to the token rows alone; in autocast's dtype where it is on, as
    the high-precision experts."""
    dtype = matmul_dtype(x)
    groups = pad_groups(counts, x.size(0), alignment)

    def linear(h: Tensor, name: str) -> Tensor:
        out = grouped_mm(h, params[name].to(dtype), groups, token_counts)
        bias = params.get(f"{name}_bias")
        return out if bias is None else out + groups.bias_rows(bias.to(out.dtype))
    return groups.unpad(function(groups.pad(x.to(dtype)), linear))


def high_precision_grouped_mm(a: Tensor, b: Tensor, offsets: Tensor, token_counts: TokenCounts) -> Tensor:
    """torch._grouped_mm's two layouts in a's dtype, where the op runs for it, else one matmul per group:
    a (rows, K) @ b (experts, K, N) -> (rows, N), block e of a's rows by b[e]; or a (M, rows) @ b (rows, N) ->
    (experts, M, N), block e of the contracted rows (a weight gradient). Rows after the last block are left zero
    (2-D x 3-D) or ignored (2-D x 2-D). `token_counts`: how the per-group matmuls learn the blocks' ends on the host
    (an even split of the rows for the dry run's)."""
    if grouped_mm_supported(a, token_counts):
        return torch._grouped_mm(a, b, offs=offsets)
    # Emulation where the op does not run (fp32 under compile, GPUs before Hopper) reads the blocks' ends.
    if token_counts.even:
        rows = a.size(0) if b.dim() == 3 else a.size(1)
        ends = list(itertools.accumulate(token_counts.read(offsets, rows)))
    else:
        ends = offsets.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        blocks = [a[start:end] @ b[e] for e, (start, end) in enumerate(zip(starts, ends))]
        return torch.cat(blocks + [a.new_zeros(a.size(0) - ends[-1], b.size(-1))])
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in zip(starts, ends)])
