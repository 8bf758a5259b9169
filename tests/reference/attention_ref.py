"""Softmax attention written out as GPT-OSS's eager attention in transformers computes it: scaled scores, masked keys
at -inf, each head's learned sink appended as one more logit column, the softmax over keys and sink together, and
the sink's column dropped before the values (it writes nothing). Without sinks, plain masked softmax attention."""

import math

import torch
from torch import Tensor


def attention_with_sink_column(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                               sinks: Tensor | None) -> Tensor:
    """q (bs, heads, seq_q, head_dim), k, v (bs, kv_heads, seq_k, head_dim), `visible` a boolean mask broadcastable
    to (bs, heads, seq_q, seq_k) (None: causal), sinks (heads,) or None -> (bs, heads, seq_q, head_dim), in float64
    and back in q's dtype."""
    n_rep = q.size(1) // k.size(1)
    k, v = k.double().repeat_interleave(n_rep, dim=1), v.double().repeat_interleave(n_rep, dim=1)
    scores = q.double() @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (bs, heads, seq_q, seq_k)
    if visible is None:
        visible = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs @ v).to(q.dtype)
