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

Blocks may attend differently (AttentionSpec, titan/models/common/args.py): a sliding window of recent keys, learned
sinks that join each softmax's denominator, biased projections. The decoder builds one mask per distinct window, and a
kernel may hand its output with the softmax's log-sum-exp to an epilogue (`out_transform`), which is how sinks apply:
out * exp(lse) / (exp(lse) + exp(sink)) is attention with the sink as one more, valueless, key.

FlexAttention has no backward on CPU (torch 2.13 raises NotImplementedError), so CPU training masks documents with
SDPA and a dense mask (titan/train/rules.py says so before step 1); on CUDA FlexAttention skips the masked blocks.
"""

import math
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.common.args import AttentionSpec, AttnBackend, DecoderArgs
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


OutTransform = Callable[[Tensor, Tensor], Tensor]
"""An attention epilogue: (out (bs, heads, seq, head_dim), the softmax's natural log-sum-exp (bs, heads, seq), fp32)
-> out. torchtitan's FlexAttention `out_transform`; GPT-OSS's attention sinks are one (sink_transform)."""


def sink_transform(sinks: Tensor) -> OutTransform:
    """Attention sinks (arXiv:2309.17453; GPT-OSS): each query head h's softmax has one more logit, sinks[h], with a
    zero value, so out becomes out * exp(lse) / (exp(lse) + exp(sinks[h])) = out * sigmoid(lse - sinks[h]).
    sinks (local heads,)."""
    def transform(out: Tensor, lse: Tensor) -> Tensor:
        kept = torch.sigmoid(lse - sinks.float()[None, :, None])  # (bs, heads, seq): the share the keys keep
        return out * kept.unsqueeze(-1).to(out.dtype)
    return transform


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Softmax attention written out, for an epilogue that needs the log-sum-exp, which SDPA's kernels do not return:
    out (bs, heads, seq, head_dim) in q's dtype and lse (bs, heads, seq) fp32, causal or under a dense boolean mask
    (bs, 1, seq, seq). It holds the (bs, heads, seq, seq) scores, as a dense mask does already; on a GPU
    FlexAttention hands over the log-sum-exp without them (--model.attn_backend flex)."""
    n_rep = q.size(1) // k.size(1)  # a ratio of local counts: sharding heads divides both by the same degree
    k, v = expand_kv_heads(k, n_rep), expand_kv_heads(v, n_rep)
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.size(-1))  # (bs, heads, seq, seq)
    if mask is None:
        seq = q.size(2)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)  # (bs, heads, seq): every row reads at least its own key
    out = (scores - lse.unsqueeze(-1)).exp() @ v.float()
    return out.type_as(q), lse


class SDPAAttention(nn.Module):
    """Attention of q (bs, heads, seq, head_dim) over k, v (bs, kv_heads, seq, head_dim) by
    F.scaled_dot_product_attention, causal or under a boolean mask (bs, 1, seq, seq) of the keys each query may
    read (build_dense_mask): query head h reads kv head h // (heads // kv_heads).

    SDPA's enable_gqa reads the kv heads in place, where expanding them copies heads // kv_heads times their size.
    On CUDA only the flash kernel takes enable_gqa, and only causal, in fp16/bf16: there an fp32 or masked call
    would fall back to SDPA's slow math kernel, so those expand the kv heads for the memory-efficient kernel.
    With an `out_transform`, which needs the log-sum-exp, the attention is written out (attention_with_lse)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                out_transform: OutTransform | None = None) -> Tensor:
        if out_transform is not None:
            return out_transform(*attention_with_lse(q, k, v, mask))
        n_rep = q.size(1) // k.size(1)  # a ratio of local counts: sharding heads divides both by the same degree
        if n_rep > 1 and q.device.type == "cuda" and (mask is not None or q.dtype not in (torch.float16,
                                                                                         torch.bfloat16)):
            k, v, n_rep = expand_kv_heads(k, n_rep), expand_kv_heads(v, n_rep), 1
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_rep > 1)


def build_dense_mask(document_ids: Tensor, window: int | None = None) -> Tensor:
    """The block-causal mask of document ids (bs, seq) as SDPA reads it: (bs, 1, seq, seq), True where a query
    (row) may read a key (column), the earlier tokens of its own document and itself, and with a `window` only the
    keys less than `window` positions back."""
    same_document = document_ids[:, :, None] == document_ids[:, None, :]  # (bs, seq, seq)
    return (same_document & causal_window(document_ids.size(1), window, document_ids.device))[:, None]


def causal_window(seq: int, window: int | None, device: torch.device) -> Tensor:
    """(seq, seq) bool: query q (row) reads key kv (column) where kv <= q, and kv > q - window with a window."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return causal if window is None else causal.triu(-(window - 1))


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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: "BlockMask",
                out_transform: OutTransform | None = None) -> Tensor:
        """With an `out_transform`, FlexAttention returns the log-sum-exp too (AuxRequest(lse=True)) for it."""
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        aux = {} if out_transform is None else {"return_aux": AuxRequest(lse=True)}
        if q.device.type == "cuda":
            result = compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1), **aux)
        else:
            # Inductor's CPU FlexAttention lowering (torch 2.13) reads the shape of the buffer under a view: q and k
            # are views of RoPE's 5-D output, so a compiled block fails with "too many values to unpack (expected
            # 4)". Contiguous inputs are 4-D buffers of their own.
            result = flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask,
                                    enable_gqa=q.size(1) != k.size(1), **aux)
        if out_transform is None:
            return result
        out, outputs = result
        return out_transform(out, outputs.lse)


def build_block_mask(document_ids: Tensor | None, seq: int, device: torch.device,
                     window: int | None = None) -> "BlockMask":
    """The FlexAttention mask of one batch: causal, with `document_ids` (bs, seq) also within documents, and with a
    `window` only over the keys less than `window` positions back. Block-sparse: the blocks a window leaves out are
    skipped, so a window of 128 costs what it computes. On CUDA the mask is built by compiled code, as torchtitan
    does: eagerly it evaluates the mask for every (query, key) pair, which costs a small model's step tens of
    milliseconds."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        keep = kv <= q
        if window is not None:
            keep = keep & (kv > q - window)
        if document_ids is not None:
            keep = keep & (document_ids[b, q] == document_ids[b, kv])
        return keep

    batch = None if document_ids is None else document_ids.size(0)
    return create_block_mask(visible, batch, None, seq, seq, device=device, _compile=device.type == "cuda")


Mask = Union["BlockMask", Tensor, None]
"""What a block's attention kernel reads besides q, k and v (AttentionMask's output)."""


class AttentionMask(nn.Module):
    """What the blocks' attention kernels read besides q, k and v, built once per forward and window (the distinct
    AttentionSpec.window of the blocks) from the batch's document ids (None for causal attention): a BlockMask for
    FlexAttention; for SDPA nothing (causal without a window) or a dense boolean mask."""

    def __init__(self, backend: AttnBackend, windows: list[int | None]) -> None:
        super().__init__()
        self.backend = backend
        self.windows = list(dict.fromkeys(windows))

    def forward(self, h: Tensor, document_ids: Tensor | None) -> dict[int | None, Mask]:
        """h (bs, seq, dim): the hidden states, for the sequence length and device -> each window's mask."""
        return {window: self.build(h, document_ids, window) for window in self.windows}

    def build(self, h: Tensor, document_ids: Tensor | None, window: int | None) -> Mask:
        seq = h.size(1)
        if self.backend == "causal_flash":
            return None
        if self.backend == "flex":
            return build_block_mask(document_ids, seq, h.device, window)
        if document_ids is not None:
            return build_dense_mask(document_ids, window)
        return None if window is None else causal_window(seq, window, h.device)[None, None]


class CausalFlashStandIn(SDPAAttention):
    """The dry run's stand-in for FlexAttention on its simulated GPU (attn_backend causal_flash), where a BlockMask
    cannot be built (its blocks come from the batch's values, which fake tensors have none of): causal flash attention
    in every block, which has FlexAttention's memory (outputs and log-sum-exps) and bounds its work from above
    (FlexAttention skips the blocks that documents and windows leave out). An epilogue gets the flash kernel's
    log-sum-exp, which carries no gradient: the dry run prices the step, it does not train."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: None,
                out_transform: OutTransform | None = None) -> Tensor:
        assert q.device.type == "cuda", "causal_flash stands in for FlexAttention on the dry run's simulated GPU only"
        if out_transform is None:
            return super().forward(q, k, v, None)
        n_rep = q.size(1) // k.size(1)  # a ratio of local counts: sharding heads divides both by the same degree
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, expand_kv_heads(k, n_rep), expand_kv_heads(v, n_rep), is_causal=True)[:2]
        return out_transform(out, lse)


def build_inner_attention(backend: AttnBackend) -> nn.Module:
    """The attention kernel module of `backend`, for each block's `attention.inner_attention`."""
    return {"sdpa": SDPAAttention, "flex": FlexAttention, "causal_flash": CausalFlashStandIn}[backend]()


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads and rotary positions, causal or block-causal
    (args.attn_backend's kernel, `inner_attention`, under the mask Decoder.attention_mask builds for its window), as
    block `layer_id`'s AttentionSpec says: biased projections, and learned sinks (`sinks`, one per query head)."""

    def __init__(self, args: DecoderArgs, layer_id: int = 0) -> None:
        super().__init__()
        spec: AttentionSpec = args.layer_attention(layer_id)
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=spec.bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=spec.bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=spec.bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=spec.bias)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if spec.sinks else None
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
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sinks is None:
            out = self.inner_attention(q, k, v, mask)
        else:
            out = self.inner_attention(q, k, v, mask, out_transform=sink_transform(self.sinks))
        out = out.transpose(1, 2).reshape(bs, seq, -1)  # (bs, seq, local_heads * head_dim)
        return self.wo(out)
