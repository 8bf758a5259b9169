"""A decoder block's grouped-query attention, its kernels, and the documents of a packed sequence they may keep apart.

Sequences are windows of documents (or conversations) packed back to back; the loader says which token ends each
document, from the token store's document offsets rather than from token ids (a chat template may write the EOS id
inside a conversation). Causal attention lets a token read every earlier token of its sequence; block-causal
attention only the earlier tokens of its own document (Llama 3's recipe), with rotary positions that restart at every
document. The micro-batch (titan/data/micro_batch.py document_layout) makes both from the document ends; the model
takes them as inputs, so a later stage can
shard them with the tokens (context parallel) or hand them to every pipeline stage.

Each block's kernel is a parameter-free module, `attention.inner_attention`, and the model builds what the kernel
reads once per forward (`Decoder.attention_mask`), shared by every block: a FlexAttention BlockMask, or for SDPA
a dense boolean mask. Context parallel replaces both.

FlexAttention has no backward on CPU (torch 2.13 raises NotImplementedError), so CPU training masks documents with
SDPA and a dense mask (titan/train/rules.py says so before step 1); on CUDA FlexAttention skips the masked blocks.
"""

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.common.args import AttnBackend, DecoderArgs
from titan.models.common.rotary import apply_rotary_emb

# torch.nn.attention.flex_attention imports dynamo and inductor (about 2 s): it is imported where a FlexAttention
# kernel or mask is first used, so that a process that only checks a config (the launcher, `--help`) starts without it.
if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

def sequence_positions(tokens: Tensor) -> Tensor:
    """Positions 0 .. seq - 1 of every row of token ids (bs, seq): the causal mask's positions, (bs, seq)."""
    bs, seq = tokens.shape
    return torch.arange(seq, device=tokens.device).expand(bs, seq)


def expand_kv_heads(x: Tensor, n_rep: int) -> Tensor:
    """A copy of keys or values x (bs, kv_heads, seq, head_dim) with kv head j repeated for query heads j*n_rep ...
    j*n_rep + n_rep - 1: (bs, kv_heads * n_rep, seq, head_dim)."""
    bs, kv_heads, seq, head_dim = x.shape
    expanded = x[:, :, None].expand(bs, kv_heads, n_rep, seq, head_dim)  # (bs, kv_heads, n_rep, seq, head_dim)
    return expanded.reshape(bs, kv_heads * n_rep, seq, head_dim)


class SDPAAttention(nn.Module):
    """Attention of q (bs, heads, seq, head_dim) over k, v (bs, kv_heads, seq, head_dim) by
    F.scaled_dot_product_attention, causal or under a boolean mask (bs, 1, seq, seq) of the keys each query may
    read (build_dense_mask): query head h reads kv head h // (heads // kv_heads).

    SDPA's enable_gqa reads the kv heads in place, where expanding them copies heads // kv_heads times their size.
    On CUDA only the flash kernel takes enable_gqa, and only causal, in fp16/bf16: there an fp32 or masked call
    would fall back to SDPA's slow math kernel, so those expand the kv heads for the memory-efficient kernel."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        n_rep = q.size(1) // k.size(1)  # a ratio of local counts: sharding heads divides both by the same degree
        if n_rep > 1 and q.device.type == "cuda" and (mask is not None or q.dtype not in (torch.float16,
                                                                                         torch.bfloat16)):
            k, v, n_rep = expand_kv_heads(k, n_rep), expand_kv_heads(v, n_rep), 1
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_rep > 1)


def build_dense_mask(document_ids: Tensor) -> Tensor:
    """The block-causal mask of document ids (bs, seq) as SDPA reads it: (bs, 1, seq, seq), True where a query
    (row) may read a key (column), the earlier tokens of its own document and itself."""
    seq = document_ids.size(1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]  # (bs, seq, seq)
    return (same_document & causal)[:, None]


VISIBLE_REGION_OPTIONS = {"wrap_inductor_compiled_regions": True}
"""Inductor options of a region compiled on its own inside eager code: run its compiled code as torch's
inductor_compiled_code higher-order op, which dispatch modes see as one op. Without it the region's kernels are
invisible to selective activation checkpointing's policy (titan/parallel/ac.py), which then cannot save the region's
output, and the backward runs the whole region again (torchtitan compiles its FlexAttention so too)."""


def compile_visible_region(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` compiled on its own, for static shapes, as one op that dispatch modes see (VISIBLE_REGION_OPTIONS)."""
    return torch.compile(fn, dynamic=False, options=VISIBLE_REGION_OPTIONS)


@cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled, once per process. torch's fused FlexAttention kernels exist only in compiled code:
    called eagerly, flex_attention runs an unfused reference that holds the whole score matrix. On CUDA it is always
    compiled, on its own in eager blocks (as torchtitan does; a region selective checkpointing saves, not recomputes)
    and with the block under --compile.enable. On CPU, where torch has no FlexAttention backward and it only runs
    forward (evaluation, tests), eager blocks take the reference."""
    from torch.nn.attention.flex_attention import flex_attention

    return compile_visible_region(flex_attention)


class FlexAttention(nn.Module):
    """Attention of q (bs, heads, seq, head_dim) over k, v (bs, kv_heads, seq, head_dim) under a BlockMask
    (build_block_mask), by torch's FlexAttention, grouped kv heads read in place."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: "BlockMask") -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        if q.device.type == "cuda":
            return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
        # Inductor's CPU FlexAttention lowering (torch 2.13) reads the shape of the buffer under a view: q and k are
        # views of RoPE's 5-D output, so a compiled block fails with "too many values to unpack (expected 4)".
        # Contiguous inputs are 4-D buffers of their own.
        return flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask,
                              enable_gqa=q.size(1) != k.size(1))


def build_block_mask(document_ids: Tensor | None, seq: int, device: torch.device) -> "BlockMask":
    """The FlexAttention mask of one batch: causal, and with `document_ids` (bs, seq) also within documents. On CUDA
    the mask is built by compiled code, as torchtitan does: eagerly it evaluates the mask for every (query, key)
    pair, which costs a small model's step tens of milliseconds."""
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = device.type == "cuda"
    if document_ids is None:
        def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return kv <= q
        return create_block_mask(causal, None, None, seq, seq, device=device, _compile=compiled)

    def block_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & (document_ids[b, q] == document_ids[b, kv])
    return create_block_mask(block_causal, document_ids.size(0), None, seq, seq, device=device, _compile=compiled)


Mask = Union["BlockMask", Tensor, None]
"""What a block's attention kernel reads besides q, k and v (AttentionMask's output)."""


class AttentionMask(nn.Module):
    """What every block's attention kernel reads besides q, k and v, built once per forward from the batch's
    document ids (None for causal attention): a BlockMask for FlexAttention; for SDPA nothing (causal) or a dense
    boolean mask (block-causal)."""

    def __init__(self, backend: AttnBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, h: Tensor, document_ids: Tensor | None) -> Mask:
        """h (bs, seq, dim): the hidden states, for the sequence length and device."""
        if self.backend == "flex":
            return build_block_mask(document_ids, h.size(1), h.device)
        return None if document_ids is None else build_dense_mask(document_ids)


def build_inner_attention(backend: AttnBackend) -> nn.Module:
    """The attention kernel module of `backend`, for each block's `attention.inner_attention`."""
    return SDPAAttention() if backend == "sdpa" else FlexAttention()


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads and rotary positions, causal or block-causal
    (args.attn_backend's kernel, `inner_attention`, under the mask Decoder.attention_mask builds)."""

    def __init__(self, args: DecoderArgs) -> None:
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
