"""Rotary embeddings as Meta's llama reference computes them (RoFormer, Su et al. 2021, eq. 34, in complex form):
channels (2i, 2i+1) of a head are one complex number, multiplied in fp32 by e^(i * position * theta^(-2i/head_dim)).
Titan computed RoPE this way until it moved to real cos/sin tables (inductor has no complex codegen)."""

import torch
from torch import Tensor


def complex_rotation_table(head_dim: int, max_seq_len: int, theta: float, freqs: Tensor | None = None) -> Tensor:
    """complex64 (max_seq_len, head_dim // 2): e^(i * position * freq); `freqs` replaces theta's when given (scaled
    frequencies)."""
    if freqs is None:
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)  # (max_seq_len, head_dim // 2)
    return torch.polar(torch.ones_like(angles), angles)


def complex_rope(x: Tensor, table: Tensor) -> Tensor:
    """x (bs, seq, heads, head_dim) rotated pairwise by the table's first seq rows, in fp32, back in x's dtype."""
    bs, seq, heads, head_dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(bs, seq, heads, head_dim // 2, 2))  # (bs, seq, heads, hd // 2)
    rotation = table[:seq].view(1, seq, 1, head_dim // 2)  # (1, seq, 1, head_dim // 2)
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)  # (bs, seq, heads, head_dim)
