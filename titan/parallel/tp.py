"""Tensor parallel with DTensor, as a family's plan names the modules: Megatron column/row splits, sequence parallel
on the norms, and a loss computed on vocab-sharded logits."""

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from titan.metrics.log import logger
from titan.models.common.decoder import tie_output
from titan.models.common.loss import IGNORE_INDEX, LogitsLoss, OutputLoss
from titan.models.common.parallel_plan import ParallelPlan, TensorParallelStyle


def tensor_parallel_style(style: TensorParallelStyle, loss_parallel: bool) -> ParallelStyle:
    """torch's style for one of a plan's kinds of split (titan/models/common/parallel_plan.py says what each is).
    The residual stream between blocks stays a sequence-sharded DTensor (use_local_output=False)."""
    if style == "vocab_embedding":  # the vocab's partial sums reduce-scattered along the sequence
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    if style == "vocab_output":
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if style == "sequence_norm":
        return SequenceParallel()
    if style == "head_norm":  # (bs, seq, local_heads, head_dim): the heads dimension, 2, is sharded
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "gather_input":
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if style == "gather_attention_input":  # (x, rotary rows, attention mask): only x is a DTensor
        return PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    raise AssertionError(f"unknown tensor-parallel style {style!r}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: ParallelPlan, loss_parallel: bool, async_tp: bool) -> None:
    """Shard `model` (a decoder, or a pipeline stage of one) over `tp_mesh` in place, as its family's `plan` says.

    Activations between blocks stay sharded along the sequence (Shard(1)); each attention/FFN gathers them,
    splits heads / hidden units column-wise, and reduce-scatters back after its row-wise output projection.
    With loss_parallel the logits stay sharded along the vocab for the loss.

    The residual stream stays a DTensor (use_local_output=False on the row-wise outputs and the embedding):
    with plain local tensors between blocks, a torch.compile'd block (AOTAutograd, torch 2.13) hands the
    backward a plain gradient where a DTensor redistribute expects a DTensor, which fails under TP alone and
    silently changed gradients under FSDP + TP.
    """
    # A pipeline stage without some of the root's parts (None) sends and receives the sequence-sharded residual
    # stream as plain local tensors, which is what pipelining transports.
    parallelize_module(model, tp_mesh, {name: tensor_parallel_style(style, loss_parallel)
                                        for name, style in plan.root_tensor_parallel.items()
                                        if getattr(model, name) is not None})
    if model.tok_embeddings is None:
        parallelize_module(model, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Shard(1),)))
    if model.output is None:
        parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                               desired_output_layouts=Shard(1)))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {name: tensor_parallel_style(style, loss_parallel)
                                            for name, style in plan.tensor_parallel.items()})
    if model.output is not None:
        model.output_loss = TensorParallelOutputLoss(model.output_loss.vocab_size, model.output.out_features,
                                                     model.output_loss.chunk_size, tp_mesh, loss_parallel)
    # TP distributed a tied embedding and output separately; both are Shard(0) over the vocab, so the output can
    # take the embedding's DTensor back.
    tie_output(model)
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # Inductor's micro-pipeline pass rewrites all-gather+matmul pairs into overlapped kernels.
        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info(f"Applied tensor parallel (degree {tp_mesh.size()}, sequence parallel norms"
                f"{', loss parallel' if loss_parallel else ''}{', async' if async_tp else ''})")


def build_vocab_sharded_loss(vocab_size: int, padded_vocab: int, tp_mesh: DeviceMesh) -> LogitsLoss:
    """The summed cross entropy over logits sharded along the vocab (a DTensor), with the padded columns masked.
    Call it, and run backward, inside torch.distributed.tensor.parallel.loss_parallel().
    Slicing off the padded columns, as the single-device loss does, would gather the shards; adding -inf
    to them (a vocab-sharded bias) keeps every rank on its own slice and gives the same loss.
    """
    bias = torch.zeros(padded_vocab, device=tp_mesh.device_type)
    bias[vocab_size:] = float("-inf")
    pad_bias = distribute_tensor(bias, tp_mesh, [Shard(0)])

    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        masked = logits.float() + pad_bias  # (..., padded_vocab), sharded on the vocab
        return F.cross_entropy(masked.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    return loss_fn


class TensorParallelOutputLoss(OutputLoss):
    """OutputLoss of a tensor-parallel model: its final hidden states are sharded along the sequence (Shard(1)),
    so each chunk is chunk_size of this rank's tokens, which the output layer gathers from every rank (a chunk of
    tp x chunk_size tokens), and with `loss_parallel` its logits stay sharded along the vocab for the loss."""

    def __init__(self, vocab_size: int, padded_vocab: int, chunk_size: int, tp_mesh: DeviceMesh,
                 loss_parallel: bool) -> None:
        super().__init__(vocab_size, chunk_size)
        self.tp_mesh = tp_mesh
        self.loss_parallel = loss_parallel
        if loss_parallel:
            self.logits_loss = build_vocab_sharded_loss(vocab_size, padded_vocab, tp_mesh)

    def compile_logits_loss(self, backend: str = "inductor") -> None:
        """The vocab-sharded loss stays eager. Compiled under loss_parallel (torch 2.13), each rank's graph bakes in
        its own vocabulary offset, but inductor's on-disk graph cache keys them alike: a rank that loads another
        rank's graph computes a wrong loss (inf in a training run). With the cache off the compiled loss is right."""
        if not self.loss_parallel:
            super().compile_logits_loss(backend)

    def token_chunks(self, h: Tensor, labels: Tensor) -> list[tuple[Tensor, Tensor]]:
        """h: a DTensor (bs, seq, dim) sharded on the sequence; labels (bs, seq), the same on every rank."""
        local = h.to_local().flatten(0, 1)  # (bs * local_seq, dim): this rank's tokens, sample after sample
        bs, seq = labels.shape
        tp = self.tp_mesh.size()
        # (tp, bs * local_seq): each rank's labels in its tokens' order, so that a chunk's labels line up with the
        # rank-major rows the output layer's all-gather makes of every rank's chunk.
        by_rank = labels.view(bs, tp, seq // tp).transpose(0, 1).reshape(tp, -1)
        starts = range(0, local.size(0), self.chunk_size)
        return [(DTensor.from_local(rows, self.tp_mesh, [Shard(0)]), by_rank[:, start:start + rows.size(0)].flatten())
                for start, rows in zip(starts, local.split(self.chunk_size))]


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel() when the loss takes vocab-sharded logits (build_vocab_sharded_loss): the loss and its
    backward must both run inside it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
