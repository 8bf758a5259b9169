"""Context parallel: the head-tail sharding matches torch's, causal and block-causal attention over sequence shards
(2 gloo ranks, both rotate methods, eager and compiled), with and without a sliding window and sinks, equals
single-process attention over the whole sequence, forward and gradients, and a model that apply_cp changed gives each
rank its rows of the whole model's logits."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

from titan.data.micro_batch import document_layout
from titan.models.common.args import AttentionSpec, RopeSpec
from titan.models.common.attention import SDPAAttention, build_dense_mask, causal_window, sink_transform
from titan.models.llama.args import ModelArgs
from titan.models.llama.model import Transformer
from titan.parallel.cp import (
    ROTATE_METHODS,
    ContextParallelAttention,
    SequenceMask,
    apply_cp,
    describe_cp_path,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    uses_torch_context_parallel,
)
from titan.parallel.dims import destroy_distributed

from harness.models import build_model
from harness.torchrun import spawn_ranks
from reference.attention_ref import attention_with_sink_column

CP = 2
BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8
# fp32 on both sides; the sharded paths sum the same products in another order (and the ring merges blocks
# through their log-sum-exps), so they differ from the full kernel by rounding only.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
MODEL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=64)
EOS = 99
# Document ids of each row: row 0 has documents that start in either half of the sequence (so that, sharded, some
# query chunks see no key of an earlier key chunk), row 1 is one document.
DOCUMENT_IDS = torch.tensor([[0] * 3 + [1] * 6 + [2] * 1 + [3] * 6, [0] * SEQ])
# A window shorter than a rank's chunk (4 rows at CP 2): some key chunks lie wholly before a query chunk's window.
WINDOW = 3
FULL = AttentionSpec(rope=RopeSpec(10000.0))
WINDOWED_WITH_SINKS = AttentionSpec(rope=RopeSpec(10000.0), window=WINDOW, sinks=True)


@pytest.mark.parametrize("cp_degree", [2, 4])
def test_shard_sequence_is_head_tail_like_torch(cp_degree: int) -> None:
    seq_len = 4 * cp_degree
    tokens = torch.arange(seq_len)
    chunks = tokens.chunk(2 * cp_degree)
    torch_order = tokens[_HeadTailLoadBalancer(seq_len, cp_degree, "cpu")._generate_indices()[0]]
    freqs_cis = torch.polar(torch.ones(seq_len, 2), tokens[:, None].float().expand(seq_len, 2))  # complex64
    for rank in range(cp_degree):
        shard = shard_sequence(tokens[None, :], 1, rank, cp_degree)[0]
        assert torch.equal(shard, torch.cat([chunks[rank], chunks[2 * cp_degree - 1 - rank]]))
        # torch's context_parallel then hands rank r the r-th equal slice of its reordered sequence.
        assert torch.equal(shard, torch_order.chunk(cp_degree)[rank])
        # Rotary positions sharded along dim 0 follow the tokens.
        assert torch.equal(shard_sequence(freqs_cis, 0, rank, cp_degree), freqs_cis[shard])


def test_cp_path_follows_device_and_mask() -> None:
    assert uses_torch_context_parallel("cuda", block_causal=False, spec=FULL)
    assert not uses_torch_context_parallel("cpu", block_causal=False, spec=FULL)
    assert not uses_torch_context_parallel("cuda", block_causal=True, spec=FULL)
    assert not uses_torch_context_parallel("cuda", block_causal=False, spec=WINDOWED_WITH_SINKS)
    assert "titan's alltoall" in describe_cp_path("cpu", "alltoall", False, [FULL])
    assert "torch's ring attention" in describe_cp_path("cuda", "allgather", False, [FULL])
    assert "keeps documents apart" in describe_cp_path("cuda", "allgather", True, [FULL])
    mixed = describe_cp_path("cuda", "allgather", False, [WINDOWED_WITH_SINKS, FULL])
    assert "for the blocks with a window or sinks (torch's ring for the others)" in mixed


def init_cp_mesh(rank: int, folder: str) -> DeviceMesh:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=CP)
    return init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))


def attention_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (bs, heads, seq, head_dim), k and v with KV_HEADS grouped heads as the model passes them, and the weights
    of the loss; the same on every rank (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    key, value = torch.randn(2, BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator)
    return query, key, value, torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)


def output_and_grads(attend: Callable[..., Tensor], query: Tensor, key: Tensor, value: Tensor,
                     loss_weights: Tensor, sinks: Tensor | None = None) -> list[Tensor]:
    """attend(q, k, v, sinks)'s output and the gradients of a weighted sum of it for q, k and v, and for the sinks
    where there are some."""
    inputs = [x.detach().requires_grad_() for x in (query, key, value)]
    if sinks is not None:
        inputs.append(sinks.detach().requires_grad_())
    out = attend(*inputs[:3], inputs[3] if sinks is not None else None)
    (out * loss_weights).sum().backward()
    return [out.detach()] + [x.grad for x in inputs]  # type: ignore[misc]


def with_mask(attend: nn.Module, mask: object) -> Callable[..., Tensor]:
    """attend(q, k, v, mask) with `mask` (SDPA's dense mask, context parallel's SequenceMask), and the sinks as its
    out_transform where given."""
    def run(query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None) -> Tensor:
        if sinks is None:
            return attend(query, key, value, mask)
        return attend(query, key, value, mask, out_transform=sink_transform(sinks))
    return run


def check_sharded_attention(mesh: DeviceMesh, block_causal: bool, window: int | None = None,
                            sinks: Tensor | None = None) -> None:
    """Sharded attention, unsharded, equals full attention (causal, or block-causal over DOCUMENT_IDS, within
    `window`, with `sinks` as an explicit softmax's extra column), forward and gradients, for each rotate method
    eagerly, and block-causal alltoall also compiled by inductor (allgather is traced by aot_eager in
    test_parallel.py's cp2_compiled_selective_ac, the trainer's blocks under context parallel). The sinks' gradient
    is each rank's share of the full one: their sum is it."""
    rank = mesh.get_local_rank()
    query, key, value, loss_weights = attention_inputs()
    document_ids = DOCUMENT_IDS if block_causal else None
    full_mask = (build_dense_mask(DOCUMENT_IDS, window) if block_causal else
                 causal_window(SEQ, window, query.device) if window is not None else None)
    if sinks is None and window is None:
        want = output_and_grads(with_mask(SDPAAttention(), full_mask), query, key, value, loss_weights)
    else:
        want = output_and_grads(lambda *qkv_sinks: attention_with_sink_column(*qkv_sinks[:3], full_mask,
                                                                              qkv_sinks[3]),
                                query, key, value, loss_weights, sinks)
    shards = [shard_sequence(x, 2, rank, CP) for x in (query, key, value, loss_weights)]
    spec = WINDOWED_WITH_SINKS if sinks is not None or window is not None else FULL
    cases = [(method, mode, ContextParallelAttention(mesh, method, block_causal, spec))
             for method in ROTATE_METHODS
             for mode in (("eager", "compiled") if block_causal and method == "alltoall" else ("eager",))]
    names = ("output", "query grad", "key grad", "value grad", "sinks grad")
    for rotate_method, mode, attend in cases:
        if mode == "compiled":
            attend.compile(fullgraph=True)
        got = output_and_grads(with_mask(attend, SequenceMask(document_ids, window)), *shards, sinks)
        if sinks is not None:
            dist.all_reduce(got[-1])
        for name, got_part, want_full in zip(names, got, want):
            assert got_part.isfinite().all()
            got_full = got_part if name == "sinks grad" else unshard_sequence(got_part, 2, mesh)
            torch.testing.assert_close(got_full, want_full, **TOLERANCE,
                                       msg=lambda m: f"{block_causal=} {window=} {rotate_method} {mode} {name}: {m}")


def check_model_rows(mesh: DeviceMesh) -> None:
    """A block-causal model changed by apply_cp, given this rank's shard of the tokens, positions and document ids,
    returns this rank's rows of the unchanged model's logits: attention sees the whole sequence's documents, and
    the rotary table the positions of this rank's rows."""
    full = build_model(MODEL)
    sharded = Transformer(MODEL)
    sharded.load_state_dict(full.state_dict())
    apply_cp(sharded, mesh, "alltoall", block_causal=True)
    assert all(isinstance(block.attention.inner_attention, ContextParallelAttention)
               for block in sharded.layers.values())
    tokens = torch.randint(0, EOS, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    tokens[0, [3, 9, 10]] = EOS
    layout = document_layout(tokens == EOS)
    local = shard_batch(mesh, tokens, *layout)
    torch.testing.assert_close(sharded(*local), shard_sequence(full(tokens, *layout), 1, mesh.get_local_rank(), CP),
                               **TOLERANCE)


def check_on_two_ranks(rank: int, folder: str) -> None:
    """One spawn for every two-rank check, since starting two ranks costs more than the checks."""
    mesh = init_cp_mesh(rank, folder)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(2))
    for block_causal in (False, True):
        check_sharded_attention(mesh, block_causal)
        check_sharded_attention(mesh, block_causal, WINDOW, sinks)
    check_model_rows(mesh)
    destroy_distributed(wait_for_peers=True)


def test_sharded_attention_and_model_match_full(tmp_path: Path) -> None:
    spawn_ranks(check_on_two_ranks, CP, str(tmp_path))


def test_shard_batch_without_context_parallel_is_the_batch() -> None:
    tokens = torch.arange(8).view(1, 8)
    inputs, labels, document_ids = shard_batch(None, tokens, tokens + 1, None)
    assert inputs is tokens and torch.equal(labels, tokens + 1) and document_ids is None


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch's context parallel runs on CUDA only; the CPU tests cover the layout and contract")
@pytest.mark.parametrize("rotate_method", ROTATE_METHODS)
def test_torch_path_on_cuda_matches_full(rotate_method: str, tmp_path: Path) -> None:
    """torch's ring attention through the _ContextParallel style: one rank, so it checks the wiring (the style's
    hooks, the dispatcher, the load balancing), not the exchange."""
    dist.init_process_group(init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        inputs = [x.cuda() for x in attention_inputs()]
        want = output_and_grads(with_mask(SDPAAttention(), None), *inputs)
        got = output_and_grads(with_mask(ContextParallelAttention(mesh, rotate_method, block_causal=False, spec=FULL),
                                         SequenceMask(None, None)), *inputs)
    finally:
        dist.destroy_process_group()
    # The ring merges its blocks in fp32 after a CUDA kernel that may differ from the reference's.
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor, want_tensor, rtol=1e-4, atol=1e-4)
