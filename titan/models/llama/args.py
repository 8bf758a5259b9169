"""Llama 3 shapes: ModelArgs, the flavor table, and the size rules that config validation needs
without building a model."""

from dataclasses import dataclass

from titan.models.common.args import DecoderArgs, RopeScaling

# Llama 3's tiktoken vocabulary (128000 BPE tokens + 256 special tokens). The flavor table uses it as a
# placeholder: the trainer replaces vocab_size with the real tokenizer's size before building.
LLAMA3_VOCAB_SIZE = 128256


LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0)
# Llama 3.2 1B/3B ship with factor 32 (their config.json), not 3.1's 8.
LLAMA32_ROPE_SCALING = RopeScaling(factor=32.0)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(DecoderArgs):
    """Shape of a Llama 3 transformer: the shared fields (DecoderArgs) with Llama's defaults, and the SwiGLU hidden
    size rule's two fields."""

    vocab_size: int = LLAMA3_VOCAB_SIZE
    """Real tokenizer size. The embedding and output have padded_vocab_size(...) rows."""
    multiple_of: int = 256
    """Round the SwiGLU hidden size up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scale applied to the SwiGLU hidden size 8*dim/3 before rounding. None: 1."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head: Llama splits dim evenly over its heads."""
        return self.dim // self.n_heads


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU hidden size, Meta's rule: 2/3 of 4*dim (so three matrices cost what two 4*dim ones would),
    times ffn_dim_multiplier, rounded up to multiple_of. 8B: 14336."""
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * (-(-hidden // args.multiple_of))


# vocab_size is a placeholder in every flavor: the trainer sets the tokenizer's size.
# 1B and 3B have Llama 3.2's dims; Meta ties their output to the embedding, but Titan trains them
# untied (a separate `output` matrix), which adds vocab*dim parameters: 1.50B and 3.61B with Llama 3's vocab.
LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, max_seq_len=2048),
    "debugmodel_mha": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, max_seq_len=2048),
    # ~100M parameters with the shipped tokenizer: big enough that its weights, not its activations, dominate memory
    # on CPU, as in real jobs; used to check the dry run's estimates against measured runs (docs/scale.md).
    "100M": ModelArgs(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, multiple_of=256, max_seq_len=2048),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                    rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                    rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=131072),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                     rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=131072),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=131072),
}

