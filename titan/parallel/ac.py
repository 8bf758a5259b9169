"""Activation checkpointing per transformer block: full, every k-th block, or selective by op; and what it does on a
run (which blocks, whether they keep attention), which the config rules about the combinations it does not run in
read too (titan/parallel/rules.py)."""

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from titan.metrics.log import logger

# Ops whose outputs selective AC keeps: expensive to recompute relative to the memory they hold.
# Matmuls are kept every other call (see selective_policy); attention and TP reductions always, also in fully
# checkpointed blocks with save_attention. FlexAttention reaches the policy as torch's flex_attention higher-order
# op (torch/_higher_order_ops/flex_attention.py redirects it to the selective-checkpoint modes) where a compiled
# block traces it (--compile.enable) and where it runs eagerly (CPU); torchtitan's _op_sac_save_list keeps it too.
# Eager blocks on CUDA call it as a region compiled on its own, which reaches the policy as one
# inductor_compiled_code op (titan/models/common/attention.py VISIBLE_REGION_OPTIONS): saved, its output is what
# the backward reads, where otherwise the recompute would run the region's kernels a second time.
SAVE_ALWAYS = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
    torch.ops.higher_order.inductor_compiled_code,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    SAVE_ALWAYS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)

# torch's selective checkpointing (2.13) counts every op a block runs and refuses a recompute that runs one more
# often than the forward did. Profiler ranges are bookkeeping, not computation, and FSDP opens more of them when an
# FSDP unit inside a block (a mixture of experts' experts) is recomputed in backward on a GPU: there it is the first
# FSDP module of the pass, whose root pre-forward also opens "FSDP::inputs_to_device" (CUDA only). torch leaves the
# ops it lists in SAC_IGNORED_OPS uncounted.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def keeps_attention(save_attention: bool, compiled: bool, on_gpu: bool) -> bool:
    """Whether checkpointed blocks keep their attention outputs (--activation_checkpoint.save_attention) on this run.
    Not in eager mode on a GPU: there the selective-checkpoint dispatch mode that keeps them runs Python for every
    op of the block, in forward and in recompute, which cost more than recomputing attention saves (0.69x and 0.81x
    of the step's speed measured on an H100, docs/performance.md). Compiled, the policy is traced into the graph
    and costs nothing at run time; on a CPU the step is compute-bound and keeping attention pays (1.08x)."""
    return save_attention and (compiled or not on_gpu)


def checkpoint_every(option: str) -> int | None:
    """k for `selective_ac_option` "k" (checkpoint every k-th block), None for "op"."""
    return None if option == "op" else int(option)


def saves_by_op(mode: str, selective_option: str) -> bool:
    """Selective "op" AC: every block saves by op, attention always (save_attention does not apply)."""
    return mode == "selective" and checkpoint_every(selective_option) is None


def records_ops(mode: str, selective_option: str, keep_attention: bool) -> bool:
    """Whether checkpointed blocks run under a selective-checkpoint context, which records every op of a block's
    forward and refuses a recompute that runs one the forward did not: selective "op" AC, and full or every-k AC that
    keeps attention (`keep_attention`, keeps_attention's)."""
    return saves_by_op(mode, selective_option) or (mode != "none" and keep_attention)


# The matmuls the "op" policy alternates on: plain, native float8 and MX (torch._scaled_mm), native NVFP4 and
# blockwise float8 (torch.nn.functional.scaled_mm's op) and a mixture of experts' grouped matmul
# (titan/models/common/moe.py).
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm_v2.default,
           torch.ops.aten._grouped_mm.default}


def model_fqn(name: str) -> str:
    """A parameter's or buffer's name in the model as built, as its state dict spells it: without the
    `_checkpoint_wrapped_module.` that activation checkpointing's wrapper puts into every name under a block
    (compile and FSDP2 wrap in place, adding nothing)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def selective_policy(save_matmuls: bool = True) -> Callable[..., CheckpointPolicy]:
    """The selective-checkpoint policy of one checkpointed block: save SAVE_ALWAYS outputs and, with save_matmuls,
    every second matmul, recomputing the rest."""
    mm_calls: defaultdict[str, int] = defaultdict(int)

    def save_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in SAVE_ALWAYS:
            return CheckpointPolicy.MUST_SAVE
        if save_matmuls and op in MATMULS:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_calls[mode] += 1
            # The same count in forward and recompute keeps the two passes' decisions aligned.
            if mm_calls[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return save_policy


def op_sac_context(save_matmuls: bool = True) -> tuple:
    """Selective-checkpoint contexts that save SAVE_ALWAYS outputs and, with save_matmuls, every second matmul,
    recomputing the rest (norms, activations, rotary): most of full AC's memory saving for a fraction of its
    recompute. Without save_matmuls, a block keeps only its attention (and TP reduce-scatter) outputs: full AC
    that skips recomputing the costliest op."""
    return create_selective_checkpoint_contexts(selective_policy(save_matmuls))


def apply_ac(model: nn.Module, mode: str, selective_option: str, save_attention: bool) -> None:
    """Wrap the blocks of `model.layers` in place: mode "full" checkpoints every block; "selective" with
    option "op" saves by op inside every block, with option "k" checkpoints blocks 0, k, 2k, ... With
    save_attention, full and every-k checkpointed blocks keep their SAVE_ALWAYS outputs (attention) and recompute
    the rest; without it they recompute everything."""
    every = checkpoint_every(selective_option) if mode == "selective" else 1
    by_op = saves_by_op(mode, selective_option)
    # Without save_attention no context_fn at all: dynamo (torch 2.13) cannot trace an explicit noop_context_fn.
    block_kwargs = {"context_fn": partial(op_sac_context, save_matmuls=False)} if save_attention else {}
    wrapped = 0
    for layer_id, block in model.layers.items():
        if by_op:
            model.layers[layer_id] = checkpoint_wrapper(block, context_fn=op_sac_context, preserve_rng_state=False)
            wrapped += 1
        elif int(layer_id) % every == 0:
            model.layers[layer_id] = checkpoint_wrapper(block, preserve_rng_state=False, **block_kwargs)
            wrapped += 1
    if by_op:
        kind = "selective by op"
    elif save_attention:
        kind = "full (keeping attention outputs)"
    else:
        kind = "full (recomputing attention too)"
    logger.info(f"Applied {kind} activation checkpointing to {wrapped} of {len(model.layers)} blocks")
