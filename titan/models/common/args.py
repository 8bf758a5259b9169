"""The shape fields every decoder family shares, and the size rules that config validation needs without building a
model. A family's args extend DecoderArgs with its own fields and defaults."""

import math
from dataclasses import dataclass
from typing import Literal

AttnBackend = Literal["sdpa", "flex", "causal_flash"]
"""The attention kernel a model builds: SDPA, FlexAttention, or the dry run's stand-in for FlexAttention on its fake
GPU tensors, causal flash attention in every block (titan/models/common/attention.py CausalFlashStandIn)."""


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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE frequency scaling (arXiv:2309.00071; HF rope_type "yarn", as DeepSeek-V2 and V3 publish it).

    Channel pairs that turn more than beta_fast times over original_max_position_embeddings keep their frequency,
    those that turn fewer than beta_slow times are slowed down by `factor`, with a linear ramp between. The cosines
    and sines are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 when both are equal), and
    attention's softmax scale by mscale(factor, mscale_all_dim) ** 2, where mscale(s, m) = 0.1 m ln(s) + 1."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True
    """Round the ramp's ends out to whole channel pairs (DeepSeek's YaRN); False keeps them fractional (GPT-OSS,
    HF's `truncate: false`)."""


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term 0.1 mscale ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: its base and long-context scaling. Blocks whose specs are equal share one table."""

    theta: float
    scaling: RopeScaling | YarnScaling | None = None


@dataclass(frozen=True)
class AttentionSpec:
    """How one block attends, as data the decoder reads (titan/models/common/decoder.py): one mask per distinct
    window and one rotary table per distinct RopeSpec, each handed to the blocks that use it."""

    rope: RopeSpec
    window: int | None = None
    """Sliding window: a query reads the keys less than `window` positions back (transformers keeps kv > q - window),
    itself included. None: every earlier key."""
    sinks: bool = False
    """A learned logit per query head that joins every softmax's denominator and writes no value (GPT-OSS's attention
    sinks), so a head may attend to nothing."""
    bias: bool = False
    """Biases on the query, key, value and output projections."""


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
    rope_scaling: RopeScaling | YarnScaling | None = None
    """Long-context frequency scaling, Llama 3.1's or YaRN. None: plain RoPE."""
    max_seq_len: int
    """Longest sequence the rotary table covers."""
    depth_init: bool = True
    """Output projections of layer i get std 0.02/sqrt(2*(i+1)); False: 0.02/sqrt(2*n_layers) for all."""
    attn_backend: AttnBackend = "sdpa"
    """Attention kernel: sdpa (a dense mask for documents and windows) or flex (FlexAttention, block-sparse), or the
    dry run's causal_flash."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the output layer and loss (OutputLoss); 0: the whole batch at once."""
    tie_embeddings: bool = False
    """The output layer reuses the token embedding's matrix (Qwen3 0.6B, 1.7B and 4B)."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3 section 2.2, titan/models/common/mtp.py): module k predicts the
    token k + 1 places after the next one. 0: none."""
    mtp_loss_weight: float = 0.0
    """lambda: the modules' mean loss over the depths enters the gradient times this (the reported loss stays the
    next-token loss)."""

    def layer_attention(self, layer_id: int) -> AttentionSpec:
        """How block `layer_id` attends (layer ids n_layers and up: the multi-token prediction blocks). Here every
        block alike, full causal attention under rope_theta and rope_scaling; a family with per-layer attention
        (GPT-OSS's alternating windows) overrides this."""
        return AttentionSpec(rope=RopeSpec(self.rope_theta, self.rope_scaling))

    def attention_specs(self) -> list[AttentionSpec]:
        """layer_attention of every block, the multi-token prediction blocks' after the trunk's."""
        return [self.layer_attention(layer_id) for layer_id in range(self.n_layers + self.mtp_depth)]


def padded_vocab_size(vocab_size: int, multiple_of: int) -> int:
    """Round vocab_size up to a multiple of multiple_of: 2256 with 64 gives 2304."""
    return -(-vocab_size // multiple_of) * multiple_of
