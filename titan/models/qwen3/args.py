"""Qwen3 shapes: Qwen3Args, MoEArgs and the flavor table (the published configs of Qwen/Qwen3-*), without building a
model."""

from dataclasses import dataclass

from titan.models.common.args import DecoderArgs
from titan.models.common.moe import MoEArgs

# Qwen3's vocabulary as its checkpoints store it: 151,669 tokens padded to 151,936 rows. The flavor table uses it as a
# placeholder: the trainer replaces vocab_size with the real tokenizer's size before building.
QWEN3_VOCAB_SIZE = 151936


@dataclass(frozen=True, kw_only=True)
class Qwen3Args(DecoderArgs):
    """Shape of a Qwen3 transformer, dense (moe None) or mixture-of-experts: the shared fields (DecoderArgs) with
    Qwen3's defaults (plain RoPE), and its own."""

    head_dim: int
    """Channels per attention head: Qwen3 sets it apart from dim (128 in every published size)."""
    hidden_dim: int
    """Hidden units of the dense SwiGLU feed-forward (HF's intermediate_size); unused by MoE blocks."""
    moe: MoEArgs | None = None
    vocab_size: int = QWEN3_VOCAB_SIZE
    """Real tokenizer size. The embedding and output have padded_vocab_size(...) rows."""
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    """Longest sequence the rotary table covers (HF's max_position_embeddings)."""


def qwen3_moe(dim: int, n_layers: int, n_heads: int, dense_hidden: int, num_experts: int, top_k: int,
              expert_hidden: int) -> Qwen3Args:
    """A Qwen3-MoE shape: 4 kv heads of 128 channels, every block's feed-forward a mixture of experts. dense_hidden is
    the config's intermediate_size, which no block uses (there are no dense blocks); exports write it back."""
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, hidden_dim=dense_hidden,
                     moe=MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=expert_hidden))


# vocab_size is a placeholder in every flavor: the trainer sets the tokenizer's size. Shapes are the config.json of
# each Qwen/Qwen3-<size> checkpoint. The debug flavors keep Qwen3's traits (head_dim apart from dim / heads, QK-norm)
# at CPU sizes; all but debugmodel_tied untied, so that pipeline parallel can split them.
QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768),
    # Tied like the small Qwen3s, to test the tie through TP, FSDP, checkpoints and export.
    "debugmodel_tied": Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                                 tie_embeddings=True),
    "debugmodel_moe": Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                                moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256)),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072,
                      tie_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=6144,
                      tie_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=9728,
                    tie_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, hidden_dim=25600),
    "30B-A3B": qwen3_moe(dim=2048, n_layers=48, n_heads=32, dense_hidden=6144, num_experts=128, top_k=8,
                         expert_hidden=768),
    "235B-A22B": qwen3_moe(dim=4096, n_layers=94, n_heads=64, dense_hidden=12288, num_experts=128, top_k=8,
                           expert_hidden=1536),
}
