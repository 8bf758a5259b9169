"""The reductions a step makes across meshes: the gradient norm over every shard and pipeline stage (with
clipping), and the loss summed over the ranks that hold its shares (torchtitan's distributed/utils.py
clip_grad_norm_ and dist_mean)."""

from collections.abc import Iterable

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None) -> Tensor:
    """The global gradient norm over every shard on every mesh and, with `pp_mesh`, every pipeline stage; the
    gradients are clipped to `max_norm` when it is positive. Returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    # One norm per mesh: DTensor ops can't mix meshes, and expert-parallel experts live on another mesh than the
    # rest of the model. Only meshes that hold gradients: torch's norm of no tensors is a CPU tensor(0.), which a
    # GPU refuses to stack with the others (issue 33).
    by_mesh: dict[DeviceMesh | None, list[Tensor]] = {}
    for param in params:
        by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        # Per-shard norms come back as a partial DTensor; full_tensor() reduces them to the global norm.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    # Gradients in host memory (CPU offload) give host norms: all on the first norm's device, as stack needs.
    total_norm = norms[0] if len(norms) == 1 else torch.stack([norm.to(norms[0].device) for norm in norms]).norm()
    if pp_mesh is not None:
        # Each stage holds different parameters: the squared norms add up across the pipeline.
        total_norm = funcol.all_reduce(total_norm**2, reduceOp="sum", group=pp_mesh) ** 0.5
    if max_norm > 0:
        # Not foreach: torch 2.11's in-place foreach ops leave Partial DTensors unchanged (in-place ops on Partial
        # DTensors: pytorch/pytorch#163374), and under TP the sequence-parallel norms' gradients are Partial, so
        # they went unclipped. torch 2.13 scales them either way.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=False)
    return total_norm


def full_value(loss: Tensor) -> Tensor:
    """The whole value of a loss as a plain tensor: under loss parallel the loss is a replicated DTensor (its
    full_tensor()); sums of losses are plain tensors already."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def loss_sum(local_loss: Tensor, loss_mesh: DeviceMesh | None) -> Tensor:
    """`local_loss` added up over the ranks of `loss_mesh` (pipeline x data x context parallel), on every rank:
    ranks without the last pipeline stage add zero, and TP ranks of one group agree, so they are not in it."""
    if loss_mesh is None or loss_mesh.size() == 1:
        return local_loss
    return funcol.all_reduce(local_loss, reduceOp="sum", group=loss_mesh)
