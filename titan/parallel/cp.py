"""Context parallel: the sequence of every sample is split over the `cp` ranks, and attention exchanges keys and
values so that each rank's rows equal those of causal or block-causal attention over the whole sequence.

Layout (head-tail, as torch's `_HeadTailLoadBalancer`): the sequence is cut into 2 * cp chunks and cp rank r holds
chunk r followed by chunk 2 * cp - 1 - r, so every rank gets the same share of the causal mask's work. Token ids,
labels, rotary positions and document ids are sharded alike with `shard_batch`, so rotary positions follow the
tokens.

`apply_cp` changes the model in place, as TP and FSDP do: each block's attention kernel is replaced by a
ContextParallelAttention module, and the model's attention mask by SequenceMasks (the whole sequence's document ids,
with each block's sliding window).
Attention: for causal attention on CUDA, torch's ring attention, by torch's own module style (`_ContextParallel`:
q/k/v become sequence-sharded DTensors, and its dispatcher sends their SDPA to the ring), which covers only the CUDA
SDPA kernels (flash, efficient, cudnn) and no document mask. Elsewhere (CPU, and block-causal attention), the same two
rotate methods written here with autograd-aware functional collectives. torch's style cannot carry that exchange: its
dispatcher hands each SDPA op to a handler as separate forward and backward ops (aten's flash-attention kernels and
their backward), where Titan's exchange is written once, in autograd-aware collectives (docs/parallelism.md).
"""

import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan.metrics.log import logger
from titan.models.common.args import AttentionSpec
from titan.models.common.attention import OutTransform, attention_with_lse, expand_kv_heads

ROTATE_METHODS = ("allgather", "alltoall")

# torch 2.13 renamed the all-gathers (the old names warn there); torch 2.11 has only the old ones.
all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)


def _chunk_ids(cp_rank: int, cp_degree: int) -> tuple[int, int]:
    """The two sequence chunks (out of 2 * cp_degree) that `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_degree - 1 - cp_rank


def _positions(cp_rank: int, cp_degree: int, chunk_len: int, device: torch.device) -> Tensor:
    """Global sequence positions of the rows `cp_rank` holds, (2 * chunk_len,)."""
    return torch.cat([torch.arange(i * chunk_len, (i + 1) * chunk_len, device=device)
                      for i in _chunk_ids(cp_rank, cp_degree)])


def _gathered_positions(cp_degree: int, chunk_len: int, device: torch.device) -> Tensor:
    """Global positions of the rows of an all-gather over the cp ranks (rank-major), (2 * cp_degree * chunk_len,)."""
    return torch.cat([_positions(rank, cp_degree, chunk_len, device) for rank in range(cp_degree)])


def shard_sequence(tensor: Tensor, seq_dim: int, cp_rank: int, cp_degree: int) -> Tensor:
    """This rank's head-tail shard of `tensor` along `seq_dim`: chunk cp_rank then chunk 2 * cp_degree - 1 - cp_rank."""
    seq_len = tensor.size(seq_dim)
    assert seq_len % (2 * cp_degree) == 0, f"sequence length {seq_len} is not divisible by 2 * cp ({2 * cp_degree})"
    positions = _positions(cp_rank, cp_degree, seq_len // (2 * cp_degree), tensor.device)
    return tensor.index_select(seq_dim, positions)


def unshard_sequence(local: Tensor, seq_dim: int, cp_mesh: DeviceMesh) -> Tensor:
    """The whole sequence in natural order on every rank, from each rank's `shard_sequence` shard."""
    gathered = all_gather(local.contiguous(), gather_dim=seq_dim, group=cp_mesh)
    positions = _gathered_positions(cp_mesh.size(), local.size(seq_dim) // 2, local.device)
    return gathered.index_select(seq_dim, torch.argsort(positions))


def shard_batch(cp_mesh: DeviceMesh | None, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """This rank's head-tail shards of a batch's (bs, seq) tensors (None stays None); the tensors themselves
    without context parallel (`cp_mesh` None)."""
    if cp_mesh is None:
        return tensors
    rank, degree = cp_mesh.get_local_rank(), cp_mesh.size()
    return tuple(None if tensor is None else shard_sequence(tensor, 1, rank, degree) for tensor in tensors)


def uses_torch_context_parallel(device_type: str, block_causal: bool, spec: AttentionSpec) -> bool:
    """Whether torch's ring attention runs for a block that attends as `spec`: its SDPA dispatcher only handles the
    causal CUDA kernels, with no window and no log-sum-exp for sinks. On CPU, torch 2.13 stops with "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered", so every
    other device, block-causal attention, sliding windows and sinks run the implementation here."""
    return device_type == "cuda" and not block_causal and spec.window is None and not spec.sinks


def describe_cp_path(device_type: str, rotate_method: str, block_causal: bool, specs: list[AttentionSpec]) -> str:
    """One sentence saying which attention implementation context parallel runs for blocks attending as `specs`, for
    the startup log."""
    torch_ring = [uses_torch_context_parallel(device_type, block_causal, spec) for spec in specs]
    if all(torch_ring):
        return (f"Context parallel attention: torch's ring attention over the CUDA SDPA kernels, rotating K/V by "
                f"{rotate_method}.")
    if block_causal:
        reason = "it keeps documents apart, which torch's SDPA ring does not"
    elif device_type != "cuda":
        reason = f"torch's only covers the CUDA SDPA kernels and this device is {device_type}"
    else:
        reason = "sliding windows and sinks are beyond torch's SDPA ring"
    where = "" if not any(torch_ring) else " for the blocks with a window or sinks (torch's ring for the others)"
    return f"Context parallel attention: titan's {rotate_method} implementation{where}, since {reason}."


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, rotate_method: str, block_causal: bool) -> None:
    """Make `model` (a Transformer, or a pipeline stage of one) compute this rank's rows of every sequence, given
    its head-tail shard of the tokens, rotary positions and document ids (shard_batch): each block's attention
    kernel becomes a ContextParallelAttention for its AttentionSpec, and the model's attention mask the whole
    sequence's document ids with each block's window (SequenceMasks), which that attention reads."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"--parallelism.context_parallel_rotate_method {rotate_method!r} is not one of "
                         f"{ROTATE_METHODS}.")
    specs = {layer_id: model.args.layer_attention(int(layer_id)) for layer_id in model.layers}
    for layer_id, block in model.layers.items():
        block.attention.inner_attention = ContextParallelAttention(cp_mesh, rotate_method, block_causal,
                                                                   specs[layer_id])
    model.attention_mask = SequenceMasks(cp_mesh, [spec.window for spec in model.args.attention_specs()])
    logger.info(f"Applied context parallel over {cp_mesh.size()} ranks: each holds 2 of {2 * cp_mesh.size()} chunks "
                f"of every sequence. "
                f"{describe_cp_path(cp_mesh.device_type, rotate_method, block_causal, list(specs.values()))}")


class SequenceMask(NamedTuple):
    """What context-parallel attention reads for a block besides q, k and v: the whole sequence's document ids (bs,
    seq) in natural order (None: causal attention), and the block's sliding window (None: every earlier key)."""

    document_ids: Tensor | None
    window: int | None


class SequenceMasks(nn.Module):
    """The attention masks of a context-parallel model, one SequenceMask per distinct window of its blocks: the
    document ids gathered once per forward from every rank's shard."""

    def __init__(self, cp_mesh: DeviceMesh, windows: list[int | None]) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.windows = list(dict.fromkeys(windows))

    def forward(self, h: Tensor, document_ids: Tensor | None) -> dict[int | None, SequenceMask]:
        gathered = None if document_ids is None else unshard_sequence(document_ids, 1, self.cp_mesh)
        return {window: SequenceMask(gathered, window) for window in self.windows}


class ContextParallelAttention(nn.Module):
    """Attention of this rank's head-tail shards of q (bs, heads, local_seq, head_dim) and k, v (bs, kv_heads,
    local_seq, head_dim) as a block attending as `spec` computes it: this rank's rows of causal or block-causal
    attention over the whole sequence, within the block's window, given a SequenceMask. An `out_transform` (the
    block's sinks) gets the softmax's log-sum-exp over the whole sequence, once the ranks' partial softmaxes have
    merged. Replaces the model's attention kernel in every block under context parallel."""

    def __init__(self, cp_mesh: DeviceMesh, rotate_method: str, block_causal: bool, spec: AttentionSpec) -> None:
        super().__init__()
        self.torch_ring = uses_torch_context_parallel(cp_mesh.device_type, block_causal, spec)
        if self.torch_ring:
            self.kernel = build_torch_ring_attention(cp_mesh, rotate_method)
        else:
            self.kernel = TitanRingAttention(cp_mesh, rotate_method)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: SequenceMask,
                out_transform: OutTransform | None = None) -> Tensor:
        # Neither ring attention takes grouped kv heads: give each query head its kv head (h // n_rep), as SDPA's
        # enable_gqa reads them.
        n_rep = query.size(1) // key.size(1)
        key, value = expand_kv_heads(key, n_rep), expand_kv_heads(value, n_rep)
        if self.torch_ring:
            return self.kernel(query, key, value)
        return self.kernel(query, key, value, mask, out_transform)


class _CausalSDPA(nn.Module):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) as a module, for torch's _ContextParallel style."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True)


def build_torch_ring_attention(cp_mesh: DeviceMesh, rotate_method: str) -> nn.Module:
    """Causal SDPA wrapped by torch's _ContextParallel style: its hooks make q/k/v DTensors sharded on the sequence
    (dim 2) and its DTensor dispatcher runs them through ring attention. Imported here: the CUDA path's torch
    internals are only needed on CUDA."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
        set_rotate_method,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    set_rotate_method(rotate_method)
    # The ring must assume the layout shard_batch makes: head-tail, which torch calls load balancing.
    _cp_options.enable_load_balance = True
    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    return parallelize_module(_CausalSDPA(), cp_mesh, style)


class TitanRingAttention(nn.Module):
    """Causal attention over head-tail shards with the collectives of `rotate_method`, for any device, within the
    documents and the window of a SequenceMask, with an optional epilogue on the merged output and log-sum-exp."""

    def __init__(self, cp_mesh: DeviceMesh, rotate_method: str) -> None:
        super().__init__()
        self.group_name = cp_mesh.get_group().group_name  # a string, so torch.compile can trace the collectives
        self.cp_rank, self.cp_degree = cp_mesh.get_local_rank(), cp_mesh.size()
        self.method = _allgather_attention if rotate_method == "allgather" else _ring_attention

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: SequenceMask,
                out_transform: OutTransform | None) -> Tensor:
        assert query.size(2) == key.size(2) and query.size(2) % 2 == 0, "q/k must be head-tail shards of one sequence"
        scale = 1.0 / math.sqrt(query.size(-1))  # SDPA's default
        out, lse = self.method(query, key, value, mask, scale, self.group_name, self.cp_rank, self.cp_degree,
                               with_lse=out_transform is not None)
        return out if out_transform is None else out_transform(out, lse)


def _visible(query_positions: Tensor, key_positions: Tensor, mask: SequenceMask) -> Tensor:
    """Which keys (global positions `key_positions`) each query (`query_positions`) reads: causal, within the window
    and document of `mask`; (queries, keys) or (bs, 1, queries, keys) with document ids."""
    visible = key_positions[None, :] <= query_positions[:, None]
    if mask.window is not None:
        visible = visible & (key_positions[None, :] > query_positions[:, None] - mask.window)
    if mask.document_ids is not None:
        same_document = mask.document_ids[:, query_positions, None] == mask.document_ids[:, None, key_positions]
        visible = (visible & same_document)[:, None]
    return visible


def _allgather_attention(query: Tensor, key: Tensor, value: Tensor, mask: SequenceMask, scale: float,
                         group_name: str, cp_rank: int, cp_degree: int,
                         with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Gather all keys and values (their gradients reduce-scatter back), and mask each local query row to the
    keys at or before its global position (and in its document and window): (out, its log-sum-exp (bs, heads,
    local_seq) where `with_lse`, else None). Every row sees at least its own key, so none is fully masked."""
    chunk_len = query.size(2) // 2
    # (bs, heads, seq, head_dim), rows in rank-major head-tail order: the mask below follows that order.
    all_keys = all_gather_autograd(key.contiguous(), gather_dim=2, group=group_name)
    all_values = all_gather_autograd(value.contiguous(), gather_dim=2, group=group_name)
    visible = _visible(_positions(cp_rank, cp_degree, chunk_len, query.device),
                       _gathered_positions(cp_degree, chunk_len, query.device), mask)
    if with_lse:
        return attention_with_lse(query, all_keys, all_values, visible)
    return F.scaled_dot_product_attention(query, all_keys, all_values, attn_mask=visible, scale=scale), None


def _ring_attention(query: Tensor, key: Tensor, value: Tensor, mask: SequenceMask, scale: float, group_name: str,
                    cp_rank: int, cp_degree: int, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Pass K/V around the ring (cp_degree - 1 hops) and merge each block's partial attention by its log-sum-exp:
    (out, the merged log-sum-exp (bs, heads, local_seq) where `with_lse`, else None).

    Work goes by (query chunk, key chunk) pair: full attention when the key chunk comes first, causal on the
    diagonal, nothing when it comes later or lies wholly before the window of every query of the chunk. Causal, no
    computed row is ever fully masked; block-causal or windowed, a row whose document starts after a key chunk, or
    whose window ends before it, is, and _block_attention keeps it finite.
    """
    chunk_len = query.size(2) // 2
    query_chunks = query.split(chunk_len, dim=2)
    query_ids = _chunk_ids(cp_rank, cp_degree)
    merged: dict[int, tuple[Tensor, Tensor]] = {}  # per local query chunk: (attention so far, its log-sum-exp)
    # One buffer, so one collective per hop: (bs, heads, local_seq, key_dim + value_dim), since multi-head latent
    # attention's values are narrower than its keys.
    kv = torch.cat([key, value], dim=-1)
    key_dim = key.size(-1)
    for hop in range(cp_degree):
        if hop > 0:
            kv = _pass_to_next_rank(kv, group_name, cp_rank, cp_degree)
        key_ids = _chunk_ids((cp_rank - hop) % cp_degree, cp_degree)
        for key_id, kv_chunk in zip(key_ids, kv.split(chunk_len, dim=2)):
            key_chunk, value_chunk = kv_chunk.split([key_dim, kv_chunk.size(-1) - key_dim], dim=-1)
            for i, (query_id, query_chunk) in enumerate(zip(query_ids, query_chunks)):
                if key_id <= query_id and not _before_window(query_id, key_id, chunk_len, mask.window):
                    visible = _block_mask(query_id, key_id, chunk_len, mask, query.device)
                    block = _block_attention(query_chunk, key_chunk, value_chunk, visible, scale)
                    merged[i] = _merge(merged.get(i), block)
    # Both chunks have entries: at hop 0 each query chunk meets its own chunk.
    out = torch.cat([merged[i][0] for i in range(2)], dim=2).to(query.dtype)
    return out, (torch.cat([merged[i][1] for i in range(2)], dim=2).squeeze(-1) if with_lse else None)


def _before_window(query_id: int, key_id: int, chunk_len: int, window: int | None) -> bool:
    """Whether every key of chunk `key_id` lies before the window of every query of chunk `query_id`: the first
    query is `window` or more positions past the last key."""
    return window is not None and query_id * chunk_len - (key_id * chunk_len + chunk_len - 1) >= window


def _pass_to_next_rank(kv: Tensor, group_name: str, cp_rank: int, cp_degree: int) -> Tensor:
    """Send the whole buffer to cp rank + 1 and receive rank - 1's, as an all-to-all whose other splits are
    empty: autograd-aware, so gradients travel back the other way."""
    send_sizes, receive_sizes = [0] * cp_degree, [0] * cp_degree
    send_sizes[(cp_rank + 1) % cp_degree] = kv.size(0)
    receive_sizes[(cp_rank - 1) % cp_degree] = kv.size(0)
    return funcol.all_to_all_single_autograd(kv, receive_sizes, send_sizes, group=group_name)


def _block_mask(query_id: int, key_id: int, chunk_len: int, mask: SequenceMask, device: torch.device) -> Tensor | None:
    """Which keys of chunk `key_id` each query of chunk `query_id` reads (_visible of their positions): (chunk,
    chunk) or (bs, 1, chunk, chunk), or None for all of them (an earlier chunk, no documents, no window)."""
    if key_id < query_id and mask.document_ids is None and mask.window is None:
        return None
    positions = torch.arange(chunk_len, device=device)
    return _visible(query_id * chunk_len + positions, key_id * chunk_len + positions, mask)


def _block_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None,
                     scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one query chunk over the `visible` keys of one key chunk in fp32, and each row's log-sum-exp
    (bs, heads, chunk, 1). Masked scores are the lowest finite float, not -inf: a row with no visible key then gets
    a finite log-sum-exp far below any real one, so merging weighs it zero, where -inf would give NaN."""
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale  # (bs, heads, chunk, chunk)
    if visible is not None:
        scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), value.float()), lse


def _merge(merged: tuple[Tensor, Tensor] | None, block: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Online softmax: reweight the attention so far and the new block's by their share of the combined
    normaliser, exactly (and differentiably through both log-sum-exps)."""
    if merged is None:
        return block
    (out, lse), (block_out, block_lse) = merged, block
    new_lse = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse), new_lse
