"""Llama 3 transformer: the shared decoder (titan/models/common/decoder.py) with Llama's blocks, pure math on plain
nn.Linear / nn.Embedding, built on meta and filled by init.py."""

from torch import Tensor, nn

from titan.models.common.attention import Attention, Mask
from titan.models.common.decoder import Decoder
from titan.models.common.feed_forward import FeedForward
from titan.models.common.norms import RMSNorm
from titan.models.llama.args import ModelArgs, ffn_hidden_dim


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward network."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: Tensor, rope_cache: Tensor, mask: Mask) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    """Llama 3 decoder with an untied output layer: the shared decoder of Llama's blocks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, block=lambda args, layer_id: TransformerBlock(args))
