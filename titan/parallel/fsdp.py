"""FSDP2 (fully_shard) per transformer block and the root, with mixed precision; HSDP on a 2-D mesh."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan.metrics.log import logger
from titan.parallel.ep import block_experts


def reshard_block_after_forward(policy: str, layer_index: int, num_layers: int) -> bool:
    """"default" keeps the last block gathered: its backward starts right after the forward ends."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return layer_index < num_layers - 1


def reshard_experts_after_forward(policy: str, pipelined: bool) -> bool:
    """"default" keeps a pipeline stage's experts gathered between micro-batches. The schedule keeps every FSDP unit
    gathered after each micro-batch's backward but the last (set_reshard_after_backward), so resharding the experts
    after a forward only makes the next micro-batch gather them again; and where their unit sits inside a block that
    selective checkpointing records (titan/parallel/ac.py), that micro-batch's recompute would then gather them where
    its forward did not, which torch 2.13 refuses ("... encountered during backward but not found in storage")."""
    if policy == "always":
        return True
    return policy == "default" and not pipelined


def mixed_precision(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP's casts of every unit: parameters gathered in param_dtype, gradients reduced in reduce_dtype, and the
    forward's inputs left as they come (cast_forward_inputs=False, as torchtitan). By default FSDP casts a unit's
    floating-point inputs to param_dtype, and that would hand every block the float32 rotary table in bf16: the
    rotation computes in float32 from a table already rounded. Activations arrive in param_dtype anyway, from the
    embedding's gathered weight."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def offload_policy(mesh: DeviceMesh, cpu_offload: bool) -> OffloadPolicy:
    """FSDP's shards in host memory with `cpu_offload` (pinned where the mesh is on CUDA, for asynchronous copies)."""
    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: str, cpu_offload: bool = False) -> None:
    """Shard every block of `model.layers`, then the root (embedding, final norm, output), over `mesh`:
    parameters all-gathered in param_dtype, gradients reduce-scattered in reduce_dtype. A 2-D mesh
    (replicate, shard) gives HSDP. `cpu_offload` keeps the shards, their gradients and so the optimizer state in
    host memory (pinned where the mesh is on CUDA, for asynchronous copies)."""
    mp_policy = mixed_precision(param_dtype, reduce_dtype)
    offload = offload_policy(mesh, cpu_offload)
    num_layers = len(model.layers)
    for index, block in enumerate(model.layers.values()):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                    reshard_after_forward=reshard_block_after_forward(reshard_after_forward, index, num_layers))
    # The root's parameters are used last in forward and first in backward: no point resharding them.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                reshard_after_forward=reshard_after_forward == "always")
    kind = "HSDP" if mesh.ndim == 2 else "FSDP2"
    logger.info(f"Applied {kind} over {tuple(mesh.shape)} ranks to {num_layers} blocks and the root "
                f"(params {param_dtype}, reduce {reduce_dtype}, reshard after forward: {reshard_after_forward}"
                + (", shards, gradients and optimizer state in host memory)" if cpu_offload else ")"))


def apply_expert_fsdp(model: nn.Module, mesh: DeviceMesh, experts: str, param_dtype: torch.dtype,
                      reduce_dtype: torch.dtype, reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """Shard every block's expert-parallel experts (at FQN `experts` within the block, a family's plan names it)
    over `mesh` (the data-parallel ranks that hold the same
    experts: the block's FSDP can't, since their weights are already DTensors over ranks of its own mesh), each
    layer's experts one FSDP unit inside its block's. Their gradients are averaged over `mesh` like any FSDP
    gradient; expert parallel scales them for the EP ranks (titan/parallel/ep.py). `reshard_after_forward`:
    reshard_experts_after_forward's. `cpu_offload` keeps them in host memory with the rest of the model's shards, so
    that every gradient, and its norm, is on one device."""
    mp_policy = mixed_precision(param_dtype, reduce_dtype)
    units = list(block_experts(model, experts).values())
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy(mesh, cpu_offload),
                    reshard_after_forward=reshard_after_forward)
    logger.info(f"Applied FSDP2 over {tuple(mesh.shape)} ranks to the experts of {len(units)} MoE layers "
                f"(reshard after forward: {reshard_after_forward})" + (", in host memory" if cpu_offload else ""))

