"""Llama 3 transformer: the shared decoder (titan/models/common/decoder.py) of shared blocks with grouped-query
attention and a dense SwiGLU, pure math on plain nn.Linear / nn.Embedding, built on meta and filled by init.py."""

from titan.models.common.attention import Attention
from titan.models.common.block import TransformerBlock as Block
from titan.models.common.decoder import Decoder
from titan.models.llama.args import ModelArgs, ffn_hidden_dim


class TransformerBlock(Block):
    """Llama's block: the shared block of grouped-query attention and a dense SwiGLU of ffn_hidden_dim units."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention(args), ffn_hidden_dim(args))


class Transformer(Decoder):
    """Llama 3 decoder with an untied output layer: the shared decoder of Llama's blocks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, block=lambda args, layer_id: TransformerBlock(args))
