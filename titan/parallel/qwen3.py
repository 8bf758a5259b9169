"""The order in which Titan parallelizes a Qwen3 model: Llama's steps (titan/parallel/llama.py), plus tensor parallel
for the QK-norms and a tied output, and for mixture-of-experts flavors expert parallel with the experts' own FSDP."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from titan.config.dtypes import to_dtype
from titan.config.job import ActivationCheckpoint, Compile, Parallelism, Training
from titan.metrics.log import logger
from titan.models.common.decoder import tie_output
from titan.parallel.dims import Meshes, ParallelDims
from titan.parallel.ep import apply_ep
from titan.parallel.fsdp import apply_expert_fsdp
from titan.parallel.llama import apply_block_wrappers, apply_data_parallel_step, apply_tensor_parallel_step


def parallelize_qwen3(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, par: Parallelism,
                      ac: ActivationCheckpoint, train: Training, compile_cfg: Compile, keep_attention: bool,
                      block_causal: bool) -> None:
    """Shard and wrap `model` (a Qwen3 Transformer, or one pipeline stage of it) in place, in Llama's order (TP,
    CP, AC, compile, FSDP) with expert parallel after TP: the experts are split before any wrapper sees them, and
    FSDP shards them over their own mesh before it wraps the blocks."""
    apply_tensor_parallel_step(model, dims, meshes, par)
    if dims.tp_enabled:
        apply_qk_norm_tp(model, meshes.tp)
        # TP distributed the embedding and the output separately; both are Shard(0) over the vocab, so the output
        # can take the embedding's DTensor back.
        tie_output(model)
    if dims.ep_enabled:
        apply_ep(model, meshes.ep)
    # A block whose experts read token counts on the host (expert parallel's all-to-all, the per-expert loop where
    # grouped matmuls don't run) breaks its graph there.
    apply_block_wrappers(model, dims, meshes, par, ac, train, compile_cfg, keep_attention, block_causal,
                         fullgraph=model.args.moe is None)
    if dims.dp_enabled and dims.ep_enabled:
        apply_expert_fsdp(model, meshes.expert_fsdp, param_dtype=to_dtype(train.mixed_precision_param),
                          reduce_dtype=to_dtype(train.mixed_precision_reduce), cpu_offload=train.enable_cpu_offload)
    apply_data_parallel_step(model, dims, meshes, par, train)


def apply_qk_norm_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The QK-norms under tensor parallel: each rank normalises its own heads (the heads dimension, 2, is sharded),
    with a replicated weight whose gradient sums every rank's heads."""
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        })
    logger.info("Applied tensor parallel to the QK-norms (heads sharded, weights replicated)")
