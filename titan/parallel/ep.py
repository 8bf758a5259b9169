"""Expert parallel: each MoE layer's experts split over the EP ranks, and every routed token sent to the rank that
holds its expert and back, with all-to-all (torchtitan's ExpertParallel and its all-to-all token dispatcher).

The EP ranks are data-parallel ranks (borrowed from dp_shard x cp), so each has tokens of its own; an expert's
gradient gathers the contributions of every EP rank's tokens through the all-to-all's backward.
"""

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan.metrics.log import logger
from titan.models.common.moe import GroupedExperts


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts whose parameters (every one, by name: weights and biases) are sharded over `ep_mesh` on the
    expert dimension (DTensors, Shard(0)): this rank runs experts rank x local ... (rank + 1) x local - 1 on the
    tokens every EP rank routes to them."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.dim, self.hidden_dim = experts.num_experts, experts.dim, experts.hidden_dim
        self.function = experts.function
        self.matmuls = experts.matmuls  # a converter's low-precision matmuls stay (each rank runs its own experts')
        self.token_counts = experts.token_counts
        self.ep_mesh = ep_mesh
        for name, param in experts.named_parameters(recurse=False):
            self.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]),
                                                       requires_grad=param.requires_grad))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (tokens, dim) sorted by expert with counts (num_experts,) -> the experts' outputs in x's order."""
        ep = self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        # (ep * local,): how many tokens each EP rank sends to each of this rank's experts, rank-major.
        received_counts = all_to_all_single(counts, None, None, group=group)
        local = self.num_experts // ep
        # The layer's one host read where grouped matmuls run (without them the experts read their counts too):
        # all-to-all takes its split sizes as Python ints, so the sizes to send and to receive are read together, in
        # one wait for the device. Every rank routes as many copies (tokens x top_k), so on the dry run's fake
        # tensors each receives as many as it sends.
        per_rank = torch.stack([counts.view(ep, local).sum(dim=1), received_counts.view(ep, local).sum(dim=1)])
        # (2, ep): tokens to, then from, each rank
        send_splits, receive_splits = self.token_counts.read(per_rank, x.size(0))
        received = all_to_all_single_autograd(x, receive_splits, send_splits, group=group)
        # received is grouped by source rank, then expert; the grouped matmul wants it grouped by expert.
        order = expert_major_order(received_counts, ep, local, num_rows=received.size(0))
        # The experts' gradients sum every EP rank's tokens, each rank's loss scaled as one data-parallel share:
        # 1/ep here and FSDP's mean over the expert-FSDP ranks make them the mean over all shares, as the dense
        # weights' gradients are (FSDP's gradient_divide_factor would do it in the reduction, but gloo has no
        # PREMUL_SUM).
        params = {name: scale_gradient(param.to_local(), 1 / ep)
                  for name, param in self.named_parameters(recurse=False)}
        outputs = self.matmuls(received[order], received_counts.view(ep, local).sum(dim=0), params, self.function,
                               self.token_counts)
        unsorted = torch.empty_like(outputs).index_copy_(0, order, outputs)  # back to (source rank, expert) order
        return all_to_all_single_autograd(unsorted, send_splits, receive_splits, group=group)


class ScaleGradient(torch.autograd.Function):
    """Identity in the forward; multiplies the gradient by `scale` in the backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    return ScaleGradient.apply(x, scale)


def expert_major_order(received_counts: Tensor, ep: int, local: int, num_rows: int) -> Tensor:
    """The row order that turns the `num_rows` received tokens, grouped (source rank, local expert) as counted by
    received_counts (ep * local,), into (local expert, source rank) order, keeping each block's rows in order."""
    blocks = torch.arange(ep * local, device=received_counts.device)  # block id = rank * local + expert
    block_of_row = blocks.repeat_interleave(received_counts, output_size=num_rows)
    expert_major_key = (block_of_row % local) * ep + block_of_row // local
    return expert_major_key.argsort(stable=True)


def block_experts(model: nn.Module, experts: str) -> dict[str, nn.Module]:
    """Each block's experts (the module at FQN `experts` within the block, a family's plan names it) by block name;
    dense blocks have none."""
    found = {}
    for name, block in model.layers.items():
        try:
            found[name] = block.get_submodule(experts)
        except AttributeError:
            continue
    return found


def has_experts(model: nn.Module, experts: str) -> bool:
    """Whether any block of `model` (a decoder, or a pipeline stage of one) has experts at FQN `experts`."""
    return bool(block_experts(model, experts))


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, experts: str) -> None:
    """Replace every block's experts (at FQN `experts` within the block) of `model` (on meta) with
    ExpertParallelExperts over `ep_mesh`. FQNs stay (layers.<i>.moe.experts.w1, ...): checkpoints hold whole experts
    and reshard across EP degrees."""
    found = block_experts(model, experts)
    parent, _, child = experts.rpartition(".")
    for name, module in found.items():
        setattr(model.layers[name].get_submodule(parent), child, ExpertParallelExperts(module, ep_mesh))
    logger.info(f"Applied expert parallel (degree {ep_mesh.size()}) to the experts of {len(found)} MoE layers: "
                f"all-to-all token exchange")
