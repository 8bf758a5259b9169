"""Llama 3 transformer: pure math on plain nn.Linear / nn.Embedding, built on meta and filled by init.py.

Rotary embeddings use Meta's layout: adjacent channels (2i, 2i+1) of each head form one complex pair.
Hugging Face checkpoints use the rotate-half layout, so importing them needs wq/wk rows permuted.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.llama.args import ModelArgs, RopeScaling, ffn_hidden_dim, padded_vocab_size


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


def precompute_freqs_cis(args: ModelArgs) -> Tensor:
    """Rotation e^(i * position * freq) for every position up to max_seq_len and every channel pair of a
    head: complex64 of shape (max_seq_len, head_dim // 2), on the current default device."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if args.rope_scaling is not None:
        freqs = scale_rope_frequencies(freqs, args.rope_scaling)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate each channel pair of x (bs, seq, heads, head_dim) by its position's angle, in fp32."""
    bs, seq, heads, head_dim = x.shape
    # (bs, seq, heads, head_dim // 2, 2) -> complex (bs, seq, heads, head_dim // 2)
    pairs = torch.view_as_complex(x.float().reshape(bs, seq, heads, head_dim // 2, 2))
    rotation = freqs_cis[:seq].view(1, seq, 1, head_dim // 2)  # (1, seq, 1, head_dim // 2): same for every head
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)  # (bs, seq, heads, head_dim)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Grouped-query attention: kv head j serves query heads j*n_rep ... j*n_rep + n_rep - 1."""
    bs, seq, kv_heads, head_dim = x.shape
    expanded = x[:, :, :, None, :].expand(bs, seq, kv_heads, n_rep, head_dim)  # (bs, seq, kv_heads, n_rep, head_dim)
    return expanded.reshape(bs, seq, kv_heads * n_rep, head_dim)  # (bs, seq, kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query key/value heads and rotary positions."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        # The ratio, not the counts: sharding heads divides both counts by the same degree.
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_heads, head_dim): -1 since TP may shard heads
        k = self.wk(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_kv_heads, head_dim): -1, as for q
        v = self.wv(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, local_kv_heads, head_dim): -1, as for q
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (bs, seq, local_heads, head_dim)
        # SDPA wants heads before seq: (bs, local_heads, seq, head_dim).
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
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

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder with an untied output layer.

    The embedding and output have padded_vocab_size(vocab_size, vocab_size_multiple_of) rows so their
    shapes split evenly. forward() returns logits over that padded vocab; the padded columns are
    meaningless, so cross_entropy_loss and user_logits drop them.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        padded_vocab = padded_vocab_size(args.vocab_size, args.vocab_size_multiple_of)
        self.tok_embeddings = nn.Embedding(padded_vocab, args.dim)
        # Not persistent: it is a function of args, so checkpoints needn't carry it; init_weights rebuilds it.
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        self.layers = nn.ModuleDict({str(layer_id): TransformerBlock(args) for layer_id in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, padded_vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, padded_vocab)."""
        h = self.tok_embeddings(tokens)  # (bs, seq, dim)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    def user_logits(self, tokens: Tensor) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, vocab_size) over real token ids, for generation and export."""
        return self(tokens)[..., : self.vocab_size]
