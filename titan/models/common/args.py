"""The shape fields every decoder family shares, and the size rules that config validation needs without building a
model. A family's args extend DecoderArgs with its own fields and defaults."""

from dataclasses import dataclass
from typing import Literal

AttnBackend = Literal["sdpa", "flex"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (llama-models `apply_scaling`; HF rope_type "llama3").

    Wavelengths shorter than original_max_position_embeddings / high_freq_factor keep their frequency,
    those longer than original_max_position_embeddings / low_freq_factor are slowed down by `factor`,
    and the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class DecoderArgs:
    """Shape of a decoder-only transformer, the fields every family has. Frozen, so a shared flavor table can't be
    edited by accident: derive a variant with `dataclasses.replace(FLAVORS[name], vocab_size=..., ...)`. Keyword-only,
    so a family adds fields of its own, with or without defaults, in any order. vocab_size, norm_eps, rope_theta and
    max_seq_len have no default here: each family sets its own."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    """Real tokenizer size. The embedding and output have padded_vocab_size(...) rows."""
    vocab_size_multiple_of: int = 64
    """Pad the embedding and output rows up to a multiple of this, so later stages can split them evenly."""
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    """Llama 3.1-style long-context frequency scaling. None: plain RoPE."""
    max_seq_len: int
    """Longest sequence the rotary table covers."""
    depth_init: bool = True
    """Output projections of layer i get std 0.02/sqrt(2*(i+1)); False: 0.02/sqrt(2*n_layers) for all."""
    attn_backend: AttnBackend = "sdpa"
    """Attention kernel: sdpa (causal only) or flex (FlexAttention, causal or block-causal)."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the output layer and loss (OutputLoss); 0: the whole batch at once."""
    tie_embeddings: bool = False
    """The output layer reuses the token embedding's matrix (Qwen3 0.6B, 1.7B and 4B)."""


def padded_vocab_size(vocab_size: int, multiple_of: int) -> int:
    """Round vocab_size up to a multiple of multiple_of: 2256 with 64 gives 2304."""
    return -(-vocab_size // multiple_of) * multiple_of
