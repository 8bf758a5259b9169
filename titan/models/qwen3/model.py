"""Qwen3 transformer, dense and mixture-of-experts: Llama's block with per-head RMSNorm on queries and keys
(QK-norm), a head size of its own, optionally an output tied to the embedding, and in MoE flavors a mixture of
experts in place of every feed-forward. Pure math on plain modules, built on meta and filled by init.py.

Module names follow Titan's Llama (tok_embeddings, layers.<i>.attention.wq, feed_forward.w1, norm, output), so the
stages that find modules by name (converters, TP, CP, AC, FSDP, pipeline stages) read both families alike.
Rotary embeddings use Meta's adjacent-pair layout; importing Hugging Face's rotate-half weights permutes wq, wk and
the QK-norm weights (titan/checkpoint/hf.py).
"""

from torch import Tensor

from titan.models.common.attention import Attention as GroupedQueryAttention
from titan.models.common.block import TransformerBlock as Block
from titan.models.common.decoder import Decoder
from titan.models.common.norms import RMSNorm
from titan.models.qwen3.args import Qwen3Args


class Attention(GroupedQueryAttention):
    """The shared grouped-query attention with a head size of its own and each query and key head RMS-normalised before
    the rotation (QK-norm)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v


class TransformerBlock(Block):
    """Qwen3's block: the shared block of QK-normed attention and the dense SwiGLU, or in MoE flavors the mixture of
    experts in every block."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, Attention(args), args.hidden_dim, args.moe, norms_before_ffn=True)


class Transformer(Decoder):
    """Qwen3 decoder: the shared decoder (embedding, rotary table, blocks, final norm, output and chunked loss, one
    forward) of Qwen3's blocks, and with tie_embeddings one matrix for the embedding and the output."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, block=lambda args, layer_id: TransformerBlock(args))
