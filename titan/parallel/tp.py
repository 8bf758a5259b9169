"""Tensor parallel for Llama with DTensor: Megatron column/row splits, sequence parallel on the norms, and a
loss computed on vocab-sharded logits."""

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from titan.metrics.log import logger


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, async_tp: bool) -> None:
    """Shard `model` (a Llama Transformer, or a pipeline stage of one) over `tp_mesh` in place.

    Activations between blocks stay sharded along the sequence (Shard(1)); each attention/FFN gathers them,
    splits heads / hidden units column-wise, and reduce-scatters back after its row-wise output projection.
    With loss_parallel the logits stay sharded along the vocab for the loss.

    The residual stream stays a DTensor (use_local_output=False on the row-wise outputs and the embedding):
    with plain local tensors between blocks, a torch.compile'd block (AOTAutograd, torch 2.13) hands the
    backward a plain gradient where a DTensor redistribute expects a DTensor, which fails under TP alone and
    silently changed gradients under FSDP + TP.
    """
    root_plan = {
        # Embedding rows are split over the vocab; the partial sums are reduce-scattered along the sequence.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage without some of these parts (None) sends and receives the sequence-sharded residual stream
    # as plain local tensors, which is what pipelining transports.
    parallelize_module(model, tp_mesh, {name: style for name, style in root_plan.items()
                                        if getattr(model, name) is not None})
    if model.tok_embeddings is None:
        parallelize_module(model, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Shard(1),)))
    if model.output is None:
        parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                               desired_output_layouts=Shard(1)))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "feed_forward.w3": ColwiseParallel(),
        })
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # Inductor's micro-pipeline pass rewrites all-gather+matmul pairs into overlapped kernels.
        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info(f"Applied tensor parallel (degree {tp_mesh.size()}, sequence parallel norms"
                f"{', loss parallel' if loss_parallel else ''}{', async' if async_tp else ''})")


def build_vocab_sharded_loss(vocab_size: int, padded_vocab: int, tp_mesh: DeviceMesh) -> Callable[..., Tensor]:
    """Cross entropy over logits sharded along the vocab (a DTensor), with the padded columns masked.
    Call it, and run backward, inside torch.distributed.tensor.parallel.loss_parallel().

    Slicing off the padded columns, as the single-device loss does, would gather the shards; adding -inf
    to them (a vocab-sharded bias) keeps every rank on its own slice and gives the same loss.
    """
    bias = torch.zeros(padded_vocab, device=tp_mesh.device_type)
    bias[vocab_size:] = float("-inf")
    pad_bias = distribute_tensor(bias, tp_mesh, [Shard(0)])

    def loss_fn(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
        masked = logits.float() + pad_bias  # (bs, seq, padded_vocab), sharded on the vocab
        return F.cross_entropy(masked.flatten(0, 1), labels.flatten(0, 1))

    return loss_fn


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel() when the loss takes vocab-sharded logits (build_vocab_sharded_loss): the loss and its
    backward must both run inside it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
