"""GPT-OSS transformer: the shared decoder and block, with the shared attention as each block's AttentionSpec says
(GptOssArgs.layer_attention: alternating sliding-window and full attention, learned sinks, biased projections) and a
mixture of experts in every block (a biased router, biased experts computing the clamped SwiGLU of experts.py). Pure
math on plain modules, built on meta and filled by init.py; transformers' GptOssForCausalLM is the reference for
every formula (tests/test_hf_gpt_oss.py)."""

from titan.models.common.attention import Attention
from titan.models.common.block import TransformerBlock
from titan.models.common.decoder import Decoder
from titan.models.gpt_oss.args import GptOssArgs


class Transformer(Decoder):
    """GPT-OSS decoder: embedding, one rotary table (every block shares YaRN's), blocks of attention and experts,
    final norm, untied output and chunked loss, one forward."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args, block=lambda args, layer_id: TransformerBlock(
            args, Attention(args, layer_id), args.moe.hidden_dim, args.moe))
