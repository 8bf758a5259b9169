"""DeepSeek-V3 shapes: DeepSeekV3Args and the flavor table (DeepSeek-V3's published config, DeepSeek-V2-Lite's
shape as torchtitan's 16B, and CPU-sized debug flavors), without building a model."""

from dataclasses import dataclass, replace

from titan.models.common.args import DecoderArgs, YarnScaling
from titan.models.common.moe import MoEArgs

# DeepSeek-V3's vocabulary as its checkpoints store it (128,815 tokens padded to 129,280 rows). The flavor table uses
# it as a placeholder: the trainer replaces vocab_size with the real tokenizer's size before building.
DEEPSEEK_V3_VOCAB_SIZE = 129280


@dataclass(frozen=True, kw_only=True)
class DeepSeekV3Args(DecoderArgs):
    """Shape of a DeepSeek-V3 transformer: multi-head latent attention in every block, a dense feed-forward in the
    first first_k_dense_replace blocks and a mixture of experts (with shared experts) in the others, and optionally
    multi-token prediction modules (mtp_depth). n_kv_heads equals n_heads: every head has keys and values of its own,
    expanded from one latent per token."""

    q_lora_rank: int
    """Rank of the query's low-rank path (wq_a, q_norm, wq_b); 0: one projection wq (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    """Channels of the latent that keys and values are expanded from (what inference caches)."""
    qk_nope_head_dim: int
    """Channels of each query and key head that RoPE leaves alone."""
    qk_rope_head_dim: int
    """Channels of each query and key head that RoPE rotates; the key's are shared by all heads."""
    v_head_dim: int
    hidden_dim: int
    """Hidden units of the dense blocks' SwiGLU (HF's intermediate_size)."""
    first_k_dense_replace: int
    """Blocks 0 .. first_k_dense_replace - 1 are dense; the rest hold the mixture of experts."""
    moe: MoEArgs
    vocab_size: int = DEEPSEEK_V3_VOCAB_SIZE
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096

    @property
    def head_dim(self) -> int:
        """The rotated channels of a head, which the rotary table covers (HF's config calls them head_dim too)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# The published checkpoints' YaRN (their config.json rope_scaling): DeepSeek-V3's, and DeepSeek-V2-Lite's, whose
# attention temperature is smaller.
V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                      mscale_all_dim=1.0)
V2_LITE_YARN = replace(V3_YARN, mscale=0.707, mscale_all_dim=0.707)

# The debug flavors keep DeepSeek-V3's traits at CPU sizes: MLA with YaRN, one dense block before two MoE blocks,
# sigmoid routing over 4 groups of which a token may use 2, scaled weights and a shared expert.
DEBUG = DeepSeekV3Args(
    dim=256, n_layers=3, n_heads=8, n_kv_heads=8, q_lora_rank=0, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, hidden_dim=768, first_k_dense_replace=1, rope_scaling=V2_LITE_YARN,
    moe=MoEArgs(num_experts=8, top_k=3, hidden_dim=256, score_func="sigmoid", n_group=4, topk_group=2,
                routed_scaling_factor=2.5, num_shared_experts=1, expert_bias=True))

# vocab_size is a placeholder in every flavor: the trainer sets the tokenizer's size.
DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": DEBUG,
    "debugmodel_mtp": replace(DEBUG, mtp_depth=1),
    # DeepSeek-V2-Lite's shape with softmax routing, as torchtitan's 16B config.
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_dim=10944, first_k_dense_replace=1, vocab_size=102400,
        rope_scaling=V2_LITE_YARN,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, norm_topk_prob=False, num_shared_experts=2,
                    expert_bias=True)),
    # deepseek-ai/DeepSeek-V3's config.json. Its release adds one MTP module (layer 61), which the 671B parameters
    # leave out; training with it is --model.flavor 671B_mtp.
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_dim=18432, first_k_dense_replace=3, rope_scaling=V3_YARN,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, score_func="sigmoid", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, num_shared_experts=1, expert_bias=True)),
}
DEEPSEEK_V3_FLAVORS["671B_mtp"] = replace(DEEPSEEK_V3_FLAVORS["671B"], mtp_depth=1)

