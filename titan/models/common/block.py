"""The pre-norm residual block every family stacks: its attention (the family's), then a dense SwiGLU or a mixture of
experts, each after an RMSNorm of its own."""

from torch import Tensor, nn

from titan.models.common.args import DecoderArgs
from titan.models.common.attention import Mask
from titan.models.common.feed_forward import FeedForward
from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.norms import RMSNorm


class TransformerBlock(nn.Module):
    """x + attention(attention_norm(x)), then h + ffn(ffn_norm(h)), where ffn is a mixture of experts (`moe`) when
    `moe` is given, else a dense SwiGLU of hidden_dim units (`feed_forward`); `uses_moe` says which. A family builds
    it with its own attention, and for each layer its choice of feed-forward (DeepSeek-V3's first blocks are dense)."""

    def __init__(self, args: DecoderArgs, attention: nn.Module, hidden_dim: int, moe: MoEArgs | None = None,
                 norms_before_ffn: bool = False) -> None:
        """`norms_before_ffn`: register the norms before the feed-forward. Only the order of named_parameters()
        changes, which the gradient norm sums in: Qwen3 and DeepSeek-V3 keep the order their losses had before
        they shared this block, Llama its own."""
        super().__init__()
        self.attention = attention
        self.uses_moe = moe is not None
        if norms_before_ffn:
            self.add_norms(args)
        if moe is None:
            self.feed_forward = FeedForward(args.dim, hidden_dim)
        else:
            self.moe = MoE(args.dim, moe)
        if not norms_before_ffn:
            self.add_norms(args)

    def add_norms(self, args: DecoderArgs) -> None:
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: Tensor, rope_cache: Tensor, mask: Mask) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, mask)
        ffn = self.moe if self.uses_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))
