"""DeepSeek-V3 transformer: multi-head latent attention (DeepSeek-V2 section 2.1) in every block, dense SwiGLU
feed-forwards in the first blocks and the shared mixture of experts (sigmoid group-limited routing, shared experts)
in the others, and optionally multi-token prediction modules (titan/models/common/mtp.py). Pure math on plain
modules, built on meta and filled by init.py.

Module names follow torchtitan's DeepSeek-V3 (attention.wq or wq_a/q_norm/wq_b, wkv_a, kv_norm, wkv_b, wo), and the
block's other parts Titan's other families (attention_norm, ffn_norm, feed_forward, moe), so the stages that find
modules by name read it alike. RoPE rotates adjacent channel pairs, which is the layout of DeepSeek's checkpoints
(rope_interleave), so their weights load unpermuted.
"""

import torch
from torch import Tensor, nn

from titan.models.common.args import YarnScaling, yarn_mscale
from titan.models.common.attention import Mask, build_inner_attention
from titan.models.common.block import TransformerBlock as Block
from titan.models.common.decoder import Decoder
from titan.models.common.moe import MoEArgs
from titan.models.common.norms import RMSNorm
from titan.models.common.rotary import apply_rotary_emb
from titan.models.deepseek_v3.args import DeepSeekV3Args


class MultiHeadLatentAttention(nn.Module):
    """Attention whose keys and values come from one compressed latent per token (kv_lora_rank channels, expanded
    per head by wkv_b), and whose heads each have a part RoPE leaves alone (qk_nope_head_dim) and a rotated part
    (qk_rope_head_dim; the key's is one per token, shared by the heads). The query takes a low-rank path where
    q_lora_rank > 0. Causal or block-causal under args.attn_backend's kernel, like the other families' attention."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * args.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # YaRN raises the softmax's temperature by mscale(factor, mscale_all_dim)**2 over the kernels' default
        # 1/sqrt(qk_head_dim); the queries carry it.
        yarn = args.rope_scaling
        self.query_scale = yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2 if isinstance(yarn, YarnScaling) else 1.0
        self.inner_attention = build_inner_attention(args.attn_backend)

    def queries(self, x: Tensor) -> Tensor:
        """x (bs, seq, dim) -> q (bs, seq, local_heads, qk_head_dim), before the rotation."""
        bs, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        return q.view(bs, seq, -1, self.qk_head_dim)  # (bs, seq, local_heads, qk_head_dim): -1, heads may be sharded

    def forward(self, x: Tensor, rope_cache: Tensor, mask: Mask) -> Tensor:
        bs, seq, _ = x.shape
        q_nope, q_rope = self.queries(x).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rotary_emb(k_rope.unsqueeze(2), rope_cache)  # (bs, seq, 1, qk_rope_head_dim): one per token
        kv = self.wkv_b(self.kv_norm(latent))
        kv = kv.view(bs, seq, -1, self.qk_nope_head_dim + self.v_head_dim)  # (bs, seq, local_heads, nope + v)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_rope, rope_cache)], dim=-1)  # (bs, seq, local_heads, qk_head_dim)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.size(2), -1)], dim=-1)  # as q
        if self.query_scale != 1.0:
            q = q * self.query_scale
        # The kernels want heads before seq: (bs, local_heads, seq, head dims).
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(bs, seq, -1)  # (bs, seq, local_heads * v_head_dim)
        return self.wo(out)


class TransformerBlock(Block):
    """DeepSeek-V3's block: the shared block of latent attention and a dense SwiGLU, or with `moe` the mixture of
    experts."""

    def __init__(self, args: DeepSeekV3Args, moe: MoEArgs | None) -> None:
        super().__init__(args, MultiHeadLatentAttention(args), args.hidden_dim, moe, norms_before_ffn=True)


def decoder_block(args: DeepSeekV3Args, layer_id: int) -> TransformerBlock:
    """Blocks 0 .. first_k_dense_replace - 1 are dense, the others hold the mixture of experts."""
    return TransformerBlock(args, moe=None if layer_id < args.first_k_dense_replace else args.moe)


def mtp_block(args: DeepSeekV3Args) -> TransformerBlock:
    """An MTP module's block is dense: its experts would sit outside `layers`, where expert parallel and the
    balancer look for them. (DeepSeek-V3's released MTP module has a mixture of experts.)"""
    return TransformerBlock(args, moe=None)


class Transformer(Decoder):
    """DeepSeek-V3 decoder: the shared decoder (embedding, rotary table over the rotated channels, blocks, final
    norm, untied output, chunked loss and multi-token prediction, one forward) of DeepSeek-V3's blocks."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args, block=decoder_block, mtp_block=mtp_block)
