"""The order in which Titan parallelizes a model of any family, with the family's plan (titan/models/common/
parallel_plan.py) saying which modules each stage splits."""

from torch import nn

from titan.config.dtypes import to_dtype
from titan.config.job import ActivationCheckpoint, Compile, Parallelism, Training
from titan.metrics.log import logger
from titan.models.common.parallel_plan import ParallelPlan
from titan.parallel.ac import apply_ac, saves_by_op
from titan.parallel.compile import apply_compile
from titan.parallel.cp import apply_cp
from titan.parallel.dims import Meshes, ParallelDims
from titan.parallel.ep import apply_ep, has_experts
from titan.parallel.fsdp import apply_expert_fsdp, apply_fsdp, reshard_experts_after_forward
from titan.parallel.tp import apply_tp


def parallelize_model(model: nn.Module, plan: ParallelPlan, dims: ParallelDims, meshes: Meshes | None,
                      par: Parallelism, ac: ActivationCheckpoint, train: Training, compile_cfg: Compile,
                      keep_attention: bool, block_causal: bool) -> None:
    """Shard and wrap `model` (a decoder, or one pipeline stage of it) in place, as its family's `plan` names the
    modules. Order matters: TP first, so later stages see DTensor weights; expert parallel splits the experts before
    any wrapper sees them; context parallel swaps each block's attention kernel before AC wraps the block; compile
    traces the checkpointed block; FSDP wraps last so that each FSDP unit is a final (compiled) block, and shards
    the experts over their own mesh before it wraps the blocks. `keep_attention`: whether checkpointed blocks keep
    attention outputs on these ranks (titan/parallel/ac.py keeps_attention). `block_causal`:
    attention stays within documents (context parallel must know before the first batch)."""
    if dims.tp_enabled:
        apply_tp(model, meshes.tp, plan, loss_parallel=not par.disable_loss_parallel,
                 async_tp=par.enable_async_tensor_parallel)
    else:
        logger.info("Tensor parallel: off (--parallelism.tensor_parallel_degree 1)")
    if dims.ep_enabled:
        apply_ep(model, meshes.ep, plan.experts)
    if dims.cp_enabled:
        apply_cp(model, meshes.cp, par.context_parallel_rotate_method, block_causal)
    else:
        logger.info("Context parallel: off (--parallelism.context_parallel_degree 1)")
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option, save_attention=keep_attention)
        if keep_attention != ac.save_attention and not saves_by_op(ac.mode, ac.selective_ac_option):
            logger.info("Checkpointed blocks recompute attention: keeping it costs more than it saves in eager mode "
                        "on a GPU (--compile.enable keeps it at no run-time cost).")
    else:
        logger.info("Activation checkpointing: off (--activation_checkpoint.mode none)")
    if compile_cfg.enable:
        # A block whose experts read token counts on the host (expert parallel's all-to-all, the per-expert loop
        # where grouped matmuls don't run) breaks its graph there.
        apply_compile(model, emulate_precision_casts=compile_cfg.emulate_precision_casts,
                      fullgraph=not has_experts(model, plan.experts), backend=compile_cfg.backend)
    else:
        logger.info("torch.compile: off (--compile.enable to turn it on)")
    if dims.dp_enabled:
        param_dtype, reduce_dtype = to_dtype(train.mixed_precision_param), to_dtype(train.mixed_precision_reduce)
        if dims.ep_enabled:
            apply_expert_fsdp(model, meshes.expert_fsdp, plan.experts, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype,
                              reshard_after_forward=reshard_experts_after_forward(par.fsdp_reshard_after_forward,
                                                                                  dims.pp_enabled),
                              cpu_offload=train.enable_cpu_offload)
        apply_fsdp(model, meshes.fsdp, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=par.fsdp_reshard_after_forward, cpu_offload=train.enable_cpu_offload)
    else:
        logger.info("FSDP2: off (one data-parallel rank)")
