"""Context parallel: the head-tail sharding matches torch's, and causal attention over sequence shards (2 gloo
ranks, both rotate methods, eager and compiled) equals single-process attention over the whole sequence,
forward and gradients."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

from titan.parallel.cp import (
    ROTATE_METHODS,
    context_parallel_attention,
    describe_cp_path,
    shard_sequence,
    unshard_sequence,
    uses_torch_context_parallel,
)
from titan.parallel.dims import destroy_distributed

CP = 2
BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8
# fp32 on both sides; the sharded paths sum the same products in another order (and the ring merges blocks
# through their log-sum-exps), so they differ from the full kernel by rounding only.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


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


def test_cp_path_follows_device() -> None:
    assert uses_torch_context_parallel("cuda") and not uses_torch_context_parallel("cpu")
    assert "titan's alltoall" in describe_cp_path("cpu", "alltoall")
    assert "torch's ring attention" in describe_cp_path("cuda", "allgather")


def init_cp_mesh(rank: int, folder: str) -> DeviceMesh:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=CP)
    return init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))


def attention_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (bs, heads, seq, head_dim) with k/v repeated from KV_HEADS as the model's GQA does, and the
    weights of the loss; the same on every rank (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    key, value = torch.randn(2, BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator).repeat_interleave(
        HEADS // KV_HEADS, dim=2)
    return query, key, value, torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)


def output_and_grads(attend: Callable[[Tensor, Tensor, Tensor], Tensor], query: Tensor, key: Tensor,
                     value: Tensor, loss_weights: Tensor) -> list[Tensor]:
    """attend's output and the gradients of a weighted sum of it for q, k and v."""
    inputs = [x.detach().requires_grad_() for x in (query, key, value)]
    out = attend(*inputs)
    (out * loss_weights).sum().backward()
    return [out.detach()] + [x.grad for x in inputs]  # type: ignore[misc]


def causal_sdpa(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The model's attention call; looked up at call time, so the context's patch applies."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


def check_sharded_attention(rank: int, folder: str) -> None:
    """On each rank: sharded attention, unsharded, equals full causal attention, forward and gradients, for each
    rotate method eagerly and for allgather inside a compiled function first called within the context.
    One spawn for all three, since starting two ranks costs more than the checks."""
    mesh = init_cp_mesh(rank, folder)
    query, key, value, loss_weights = attention_inputs()
    want = output_and_grads(causal_sdpa, query, key, value, loss_weights)
    shards = [shard_sequence(x, 2, rank, CP) for x in (query, key, value, loss_weights)]
    cases = [(method, "eager", causal_sdpa) for method in ROTATE_METHODS]
    cases.append(("allgather", "compiled", torch.compile(causal_sdpa, fullgraph=True)))
    for rotate_method, mode, attend in cases:
        with context_parallel_attention(mesh, rotate_method):
            got = output_and_grads(attend, *shards)
        for name, got_shard, want_full in zip(("output", "query grad", "key grad", "value grad"), got, want):
            torch.testing.assert_close(unshard_sequence(got_shard, 2, mesh), want_full, **TOLERANCE,
                                       msg=lambda m: f"{rotate_method} {mode} {name}: {m}")
    destroy_distributed(wait_for_peers=True)


def test_sharded_attention_matches_full(tmp_path: Path) -> None:
    mp.spawn(check_sharded_attention, args=(str(tmp_path),), nprocs=CP)


@contextmanager
def one_rank_cp_mesh(folder: Path, device_type: str) -> Iterator[DeviceMesh]:
    """A one-rank cp mesh in this process: enough to enter the context, far cheaper than spawning ranks."""
    dist.init_process_group(init_method=f"file://{folder}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh(device_type, (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def test_patch_only_inside_context_and_only_causal(tmp_path: Path) -> None:
    original = F.scaled_dot_product_attention
    query = torch.randn(1, 1, 4, 2)
    with one_rank_cp_mesh(tmp_path, "cpu") as mesh:
        with context_parallel_attention(mesh, "allgather"):
            assert F.scaled_dot_product_attention is not original
            with pytest.raises(NotImplementedError, match="got attn_mask=a tensor"):
                F.scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(4, 4, dtype=torch.bool),
                                               is_causal=True)
            with pytest.raises(NotImplementedError, match="is_causal=False.*context_parallel_degree"):
                F.scaled_dot_product_attention(query, query, query)
        assert F.scaled_dot_product_attention is original
        with pytest.raises(RuntimeError, match="failed inside"):
            with context_parallel_attention(mesh, "alltoall"):
                raise RuntimeError("failed inside")
        assert F.scaled_dot_product_attention is original


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch's context parallel runs on CUDA only; the CPU tests cover the layout and contract")
@pytest.mark.parametrize("rotate_method", ROTATE_METHODS)
def test_torch_path_on_cuda_matches_full(rotate_method: str, tmp_path: Path) -> None:
    """torch's ring attention entered through titan's context: one rank, so it checks the wiring (the
    placeholder buffer, the load balancing, the wrapped patch), not the exchange."""
    inputs = [x.cuda() for x in attention_inputs()]
    want = output_and_grads(causal_sdpa, *inputs)
    with one_rank_cp_mesh(tmp_path, "cuda") as mesh, context_parallel_attention(mesh, rotate_method):
        got = output_and_grads(causal_sdpa, *inputs)
        with pytest.raises(NotImplementedError, match="is_causal=False"):
            F.scaled_dot_product_attention(*inputs[:3])
    # The ring merges its blocks in fp32 after a CUDA kernel that may differ from the reference's.
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor, want_tensor, rtol=1e-4, atol=1e-4)
