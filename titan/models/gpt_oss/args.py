"""GPT-OSS shapes: GptOssArgs and the flavor table (openai/gpt-oss-20b and -120b's config.json), without building a
model. Every block is a mixture of experts; blocks alternate a 128-token sliding window (the first block) and full
attention, each with learned sinks and biased projections."""

from dataclasses import dataclass, field

from titan.models.common.args import AttentionSpec, DecoderArgs, RopeSpec, YarnScaling
from titan.models.common.moe import MoEArgs
from titan.models.gpt_oss.experts import ClampedSwiGLU

# o200k_harmony's 201,088 tokens, a multiple of 64: the flavor table's placeholder, which the trainer replaces with
# the real tokenizer's size before building.
GPT_OSS_VOCAB_SIZE = 201088

# YaRN as the release configures it (rope_type yarn, factor 32 over 4,096 positions, beta_fast 32, beta_slow 1,
# truncate false). Without mscale fields, transformers scales the rotary table by YaRN's default attention factor,
# 0.1 ln(factor) + 1: mscale 1 over mscale_all_dim 0 is that factor in Titan's YarnScaling, and leaves the softmax's
# scale alone.
GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                           mscale=1.0, mscale_all_dim=0.0, truncate=False)


def gpt_oss_moe(num_experts: int, top_k: int = 4, hidden_dim: int = 2880) -> MoEArgs:
    """GPT-OSS's mixture of experts: a biased router whose top_k logits' softmax weighs the experts, and biased
    experts computing the clamped SwiGLU."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, norm_topk_prob=False,
                   score_func="topk_softmax", router_bias=True, expert_linear_bias=True,
                   expert_function=ClampedSwiGLU())


@dataclass(frozen=True, kw_only=True)
class GptOssArgs(DecoderArgs):
    """Shape of a GPT-OSS transformer: the shared fields (DecoderArgs) with GPT-OSS's defaults, and its own."""

    head_dim: int = 64
    """Channels per attention head, apart from dim (64 heads of 64 against a width of 2,880)."""
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32))
    sliding_window: int = 128
    """Keys an even-numbered block reads: its own and the 127 before it (transformers keeps kv > q - window)."""
    vocab_size: int = GPT_OSS_VOCAB_SIZE
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = GPT_OSS_YARN
    max_seq_len: int = 131072
    """Longest sequence the rotary table covers (HF's max_position_embeddings)."""

    def layer_attention(self, layer_id: int) -> AttentionSpec:
        """Even blocks (the first among them) attend over a sliding window, odd ones over every earlier key; all with
        sinks and biases, under one rotary table."""
        window = self.sliding_window if layer_id % 2 == 0 else None
        return AttentionSpec(rope=RopeSpec(self.rope_theta, self.rope_scaling), window=window, sinks=True, bias=True)


# vocab_size is a placeholder in every flavor: the trainer sets the tokenizer's size. 20B and 120B are the release's
# config.json; the debug flavor keeps every part (alternating windows, sinks, biases, top-4 routing over biased,
# clamped experts) at CPU sizes, its window shorter than the debug job's 256-token sequences and than the parity
# tests' 64 (a context-parallel rank's 16-token chunks then lie wholly before some queries' windows).
GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                             moe=gpt_oss_moe(8, top_k=4, hidden_dim=256), sliding_window=16),
    "20B": GptOssArgs(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, moe=gpt_oss_moe(32)),
    "120B": GptOssArgs(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, moe=gpt_oss_moe(128)),
}
