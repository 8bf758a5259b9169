"""The order in which Titan parallelizes a Llama model, in steps that other families' plans reuse."""

from torch import nn

from titan.config.dtypes import to_dtype
from titan.config.job import ActivationCheckpoint, Compile, Parallelism, Training
from titan.metrics.log import logger
from titan.parallel.ac import apply_ac, saves_by_op
from titan.parallel.compile import apply_compile
from titan.parallel.cp import apply_cp
from titan.parallel.dims import Meshes, ParallelDims
from titan.parallel.fsdp import apply_fsdp
from titan.parallel.tp import apply_tp


def parallelize_llama(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, par: Parallelism,
                      ac: ActivationCheckpoint, train: Training, compile_cfg: Compile, keep_attention: bool,
                      block_causal: bool) -> None:
    """Shard and wrap `model` (a Transformer, or one pipeline stage of it) in place. Order matters: TP first, so
    later stages see DTensor weights; context parallel swaps each block's attention kernel before AC wraps the
    block; compile traces the checkpointed block; FSDP wraps last so that each FSDP unit is a final (compiled)
    block. `keep_attention`: whether checkpointed blocks keep attention outputs on these ranks
    (titan/parallel/ac.py keeps_attention). `block_causal`: attention stays within documents (context parallel
    must know before the first batch)."""
    apply_tensor_parallel_step(model, dims, meshes, par)
    apply_block_wrappers(model, dims, meshes, par, ac, train, compile_cfg, keep_attention, block_causal)
    apply_data_parallel_step(model, dims, meshes, par, train)


def apply_tensor_parallel_step(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, par: Parallelism) -> None:
    """Tensor parallel when its degree is above 1."""
    if dims.tp_enabled:
        apply_tp(model, meshes.tp, loss_parallel=not par.disable_loss_parallel,
                 async_tp=par.enable_async_tensor_parallel)
    else:
        logger.info("Tensor parallel: off (--parallelism.tensor_parallel_degree 1)")


def apply_block_wrappers(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, par: Parallelism,
                         ac: ActivationCheckpoint, train: Training, compile_cfg: Compile, keep_attention: bool,
                         block_causal: bool, fullgraph: bool = True) -> None:
    """Context parallel, activation checkpointing and compile, each block in that order. `fullgraph`: compile each
    block as one graph (off where a block reads sizes on the host, as expert parallel's all-to-all does)."""
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
        apply_compile(model, emulate_precision_casts=compile_cfg.emulate_precision_casts, fullgraph=fullgraph,
                      backend=compile_cfg.backend)
    else:
        logger.info("torch.compile: off (--compile.enable to turn it on)")


def apply_data_parallel_step(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, par: Parallelism,
                             train: Training) -> None:
    """FSDP2 (HSDP with replicas) over every block and the root, when there is more than one data-parallel rank."""
    if dims.dp_enabled:
        apply_fsdp(model, meshes.fsdp, param_dtype=to_dtype(train.mixed_precision_param),
                   reduce_dtype=to_dtype(train.mixed_precision_reduce),
                   reshard_after_forward=par.fsdp_reshard_after_forward, cpu_offload=train.enable_cpu_offload)
    else:
        logger.info("FSDP2: off (one data-parallel rank)")
