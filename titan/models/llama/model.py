"""Llama 3 transformer: pure math on plain nn.Linear / nn.Embedding, built on meta and filled by init.py.

Rotary embeddings use Meta's layout: adjacent channels (2i, 2i+1) of each head form one rotated pair.
Hugging Face checkpoints use the rotate-half layout, so importing them needs wq/wk rows permuted.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.llama.args import ModelArgs, RopeScaling, ffn_hidden_dim, padded_vocab_size
from titan.models.llama.attention import AttentionMask, Mask, build_inner_attention, sequence_positions
from titan.models.llama.loss import OutputLoss


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that normalises in fp32 and scales in the input dtype, as Meta's reference does:
    the mean of squares over dim in bf16 loses too many bits."""

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).type_as(x)
        return normed * self.weight


def scale_rope_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1 long-context scaling (llama-models `apply_scaling`): keep high frequencies, divide low
    ones by `factor`, and interpolate between them by wavelength."""
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    low_scaled = torch.where(wavelen > context / scaling.low_freq_factor, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < context / scaling.high_freq_factor, freqs, low_scaled)


def precompute_rope_cache(args: ModelArgs) -> Tensor:
    """cos and sin of position * freq for every position up to max_seq_len and every channel pair of a head:
    fp32 (max_seq_len, head_dim // 2, 2), cosines at [..., 0] and sines at [..., 1], on the current default device.
    Real tables rather than Meta's complex e^(i * position * freq): inductor generates no code for complex ops."""
    head_dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if args.rope_scaling is not None:
        freqs = scale_rope_frequencies(freqs, args.rope_scaling)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (max_seq_len, head_dim // 2, 2)


class RotaryEmbedding(nn.Module):
    """The rotary table of precompute_rope_cache, read by token position: the model's input positions (restarting at
    each document under block-causal attention, this rank's rows under context parallel), or 0 .. seq - 1. A
    module, so that its table moves and materialises with the model (init_weights rebuilds it)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Not persistent: it is a function of args, so checkpoints needn't carry it; init_weights rebuilds it.
        self.register_buffer("cache", precompute_rope_cache(args), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """positions (seq,) or (bs, seq) -> their rows of the table, (seq, head_dim // 2, 2) or
        (bs, seq, head_dim // 2, 2)."""
        return self.cache[positions]


def apply_rotary_emb(x: Tensor, rope_cache: Tensor) -> Tensor:
    """Rotate each channel pair (2i, 2i+1) of x (bs, seq, heads, head_dim) by its position's angle, in fp32:
    (a, b) -> (a cos - b sin, a sin + b cos), Meta's complex product written out in reals. rope_cache: the rows of
    each sample's positions (bs, seq, head_dim // 2, 2), or rows shared by every sample whose first seq rows are
    x's positions (RotaryEmbedding's output for (seq,) positions, or a whole table for positions 0 .. seq - 1)."""
    bs, seq, heads, head_dim = x.shape
    # Each (bs, seq, heads, head_dim // 2): the first and second channel of every pair.
    first, second = x.float().unflatten(-1, (head_dim // 2, 2)).unbind(-1)
    # Each (bs or 1, seq, 1, head_dim // 2): the same rotation for every head.
    rows = rope_cache if rope_cache.dim() == 4 else rope_cache[None, :seq]  # (bs or 1, seq, head_dim // 2, 2)
    cos, sin = rows.unsqueeze(2).unbind(-1)
    rotated = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.flatten(3).type_as(x)  # (bs, seq, heads, head_dim // 2, 2) -> (bs, seq, heads, head_dim)


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads and rotary positions, causal or block-causal
    (args.attn_backend's kernel, `inner_attention`, under the mask Transformer.attention_mask builds)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = build_inner_attention(args.attn_backend)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (bs, seq, dim) -> q, k, v, each (bs, seq, its local heads, head_dim), before the rotation."""
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_heads, head_dim): -1 since TP may shard heads
        k = self.wk(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_kv_heads, head_dim): -1, as for q
        v = self.wv(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_kv_heads, head_dim): -1, as for q
        return q, k, v

    def forward(self, x: Tensor, rope_cache: Tensor, mask: Mask) -> Tensor:
        bs, seq, _ = x.shape
        q, k, v = self.heads(x)
        q, k = apply_rotary_emb(q, rope_cache), apply_rotary_emb(k, rope_cache)
        # SDPA wants heads before seq: (bs, local_heads, seq, head_dim).
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(bs, seq, -1)  # (bs, seq, local_heads * head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class Transformer(nn.Module):
    """Llama 3 decoder with an untied output layer.

    The embedding and output have padded_vocab_size(vocab_size, vocab_size_multiple_of) rows so their
    shapes split evenly. forward() returns logits over that padded vocab; the padded columns are
    meaningless, so the losses and user_logits drop them.
    """

    def __init__(self, args: ModelArgs, block: Callable[[ModelArgs], nn.Module] = TransformerBlock) -> None:
        """`block` builds each block from args: another family's decoder (Qwen3's) is this one with its own."""
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        padded_vocab = padded_vocab_size(args.vocab_size, args.vocab_size_multiple_of)
        self.tok_embeddings = nn.Embedding(padded_vocab, args.dim)
        self.rope = RotaryEmbedding(args)
        self.layers = nn.ModuleDict({str(layer_id): block(args) for layer_id in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, padded_vocab, bias=False)
        self.attention_mask = AttentionMask(args.attn_backend)
        self.output_loss = OutputLoss(args.vocab_size, args.loss_chunk_size)

    def forward(self, tokens: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, padded_vocab); with labels (bs, seq), the summed loss of the valid
        targets instead (output_loss), without the whole logits. positions (bs, seq): each token's rotary position
        (None: 0 .. seq - 1). document_ids (bs, seq): attention stays within a document (block-causal); None:
        causal over the sequence. attention.document_layout reads both from token ids."""
        h = self.tok_embeddings(tokens)  # (bs, seq, dim)
        rope = self.rope(sequence_positions(tokens) if positions is None else positions)
        mask = self.attention_mask(h, document_ids)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        h = self.norm(h)
        return self.output(h) if labels is None else self.output_loss(h, labels, self.output)

    def user_logits(self, tokens: Tensor) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, vocab_size) over real token ids, for generation and export."""
        return self(tokens)[..., : self.vocab_size]

