"""FSDP2 all-gathers Float8Linear weights in float8 (tensorwise recipe): half the bytes of bf16, a quarter of fp32.

The numerics are those of the high-precision all-gather. There, each rank receives the full weight in the
param dtype and Float8Linear casts it with scale = max / amax(full weight). Here each rank casts its own shard with
that same scale (its global amax comes from an all-reduce MAX over the FSDP mesh, or from
`precompute_float8_scales`), so the gathered float8 bytes are the ones the linear would have computed itself.

    apply_float8_all_gather(model)    before fully_shard: wrap each Float8Linear weight in Float8AllGatherWeight
    fully_shard(...)                  FSDP2 calls the wrapper's fsdp_pre/post_all_gather hooks (torch's
                                      all-gather extensions, torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
    forward / backward                the unsharded weight is a Float8GatheredWeight (float8/gathered.py): float8
                                      data + scale, which Float8Linear multiplies without casting again
    optimizer.step()
    precompute_float8_scales(model)   optional: every weight's global amax in one all-reduce
"""

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement
from torch.utils._pytree import tree_flatten, tree_map_only

from titan.metrics.log import logger
from titan.quant.float8.casts import amax_to_scale, cast_to_float8
from titan.quant.float8.gathered import Float8GatheredWeight, mutated_args
from titan.quant.float8.linear import TENSORWISE_E4M3, Float8Linear

aten = torch.ops.aten

# Ops whose results stay Float8AllGatherWeight, so the sharded parameter keeps its all-gather hooks: those
# fully_shard builds the padded shard and its views with (chunk -> split, new_zeros, narrow -> slice, view),
# nn.Parameter's and state_dict's detach, and to_empty's empty_like. Every other op, .to() and clone included,
# returns plain tensors. Views share their source's AmaxSlot; new storage starts with an empty one.
VIEW_OPS = {aten.detach.default, aten.slice.Tensor, aten.split.Tensor, aten.view.default}
NEW_STORAGE_OPS = {aten.empty_like.default, aten.new_zeros.default}


class AmaxSlot:
    """The full weight's amax from `precompute_float8_scales`, shared by every wrapper of the same storage
    (FSDP's padded shard, its views, detached copies such as `.data` or a state dict's), so that a write through
    any of them empties it and the all-gather never uses a stale amax."""

    def __init__(self) -> None:
        self.amax: Tensor | None = None


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (FSDP2's sharded local tensor) that FSDP all-gathers in float8.

    Every op runs on the wrapped tensor, so the optimizer, grad clipping, init and checkpoints see the plain
    weight. It has no __tensor_flatten__ on purpose: torch.compile then runs the ops on it eagerly, through the
    dispatch below, which empties the AmaxSlot on writes (a traced in-place op would bypass it).
    """

    _tensor: Tensor
    amax_slot: AmaxSlot

    @staticmethod
    def __new__(cls, tensor: Tensor, amax_slot: AmaxSlot | None = None) -> "Float8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, amax_slot: AmaxSlot | None = None) -> None:
        self._tensor = tensor
        self.amax_slot = amax_slot if amax_slot is not None else AmaxSlot()

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for written in mutated_args(func, args, kwargs):
            if isinstance(written, cls):
                written.amax_slot.amax = None
        wrappers = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, cls)]
        # An op that returns its input (in-place, out=) returns the wrapper, not the wrapped tensor.
        wrapper_of = {id(t._tensor): t for t in wrappers}

        def unwrap(weight: Float8AllGatherWeight) -> Tensor:
            return weight._tensor

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))

        def rewrap(result: Tensor) -> Tensor:
            if id(result) in wrapper_of:
                return wrapper_of[id(result)]
            if func in VIEW_OPS:
                return cls(result, wrappers[0].amax_slot)
            return cls(result) if func in NEW_STORAGE_OPS else result

        return tree_map_only(Tensor, rewrap, out)

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: MixedPrecisionPolicy) -> tuple[tuple[Tensor], Tensor]:
        """This shard in float8, as uint8 bytes (gloo cannot all-gather float8 dtypes; NCCL moves the same
        bytes either way), padded to FSDP's padded shard size; the metadata is the fp32 scale."""
        if tuple(outer_size) != (module.out_features, module.in_features):
            raise NotImplementedError(
                f"The float8 all-gather got a {tuple(outer_size)} piece of a {module.out_features}x"
                f"{module.in_features} weight: tensor parallelism sharded it, and the all-gather's scale would "
                f"cover only this rank's piece. Turn off --float8.enable_fsdp_float8_all_gather when "
                f"--parallelism.tensor_parallel_degree > 1.")
        # Round to the param dtype first, as FSDP's high-precision all-gather would, so that the float8 values
        # are exactly those Float8Linear computes from a bf16-gathered weight.
        shard = self._tensor.to(mp_policy.param_dtype or self.dtype)
        if self.amax_slot.amax is not None:
            # Rounding is monotonic, so max|round(w)| = round(max|w|): the same amax as the shards' all-reduce.
            amax = self.amax_slot.amax.to(shard.dtype).float()
        else:
            amax = shard.abs().amax().float() if shard.numel() else shard.new_zeros((), dtype=torch.float32)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = amax_to_scale(amax, TENSORWISE_E4M3.dtype, TENSORWISE_E4M3.power_of_2)
        data = cast_to_float8(shard, TENSORWISE_E4M3.dtype, scale).view(torch.uint8)
        padded_rows = math.ceil(outer_size[0] / mesh.size())
        if data.size(0) < padded_rows:  # uneven sharding: FSDP all-gathers equal-sized shards
            padded = data.new_zeros((padded_rows, *data.shape[1:]))
            padded[: data.size(0)] = data
            data = padded
        return (data,), scale

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[Tensor, ...], metadata: Tensor,
                             param_dtype: torch.dtype, *,
                             out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """The unsharded weight: all ranks' float8 bytes (padded rows included; FSDP as_strides them away) and
        the scale. On later all-gathers FSDP refills the same buffer and passes the weight back as `out`."""
        (gathered,) = all_gather_outputs  # (world_size * padded_rows, in_features) uint8
        if out is not None:
            out._scale = metadata
            return None
        data = gathered.view(TENSORWISE_E4M3.dtype)
        return Float8GatheredWeight(data, metadata, param_dtype), (data,)


def apply_float8_all_gather(model: nn.Module) -> int:
    """Wrap the weight of every Float8Linear of `model` in Float8AllGatherWeight, so that fully_shard (applied
    after this) all-gathers it in float8. Works on the meta device; returns the number of weights wrapped."""
    num_wrapped = 0
    for module in model.modules():
        if isinstance(module, Float8Linear) and not isinstance(module.weight, Float8AllGatherWeight):
            # The output and grad_input matmuls both take the gathered weight as it is, so both must cast it so.
            weight_casts = (module.recipe.output[1], module.recipe.grad_input[1])
            if any(cast != TENSORWISE_E4M3 for cast in weight_casts):
                raise ValueError(f"The float8 all-gather needs the tensorwise recipe, but a Float8Linear uses "
                                 f"{module.recipe.name!r}. Use --float8.recipe_name tensorwise or turn off "
                                 f"--float8.enable_fsdp_float8_all_gather.")
            weight = module.weight
            module.weight = nn.Parameter(Float8AllGatherWeight(weight.data), requires_grad=weight.requires_grad)
            module.register_state_dict_post_hook(unwrap_weight_in_state_dict)
            num_wrapped += 1
    logger.info(f"FSDP will all-gather {num_wrapped} Float8Linear weights in float8 (tensorwise scales)")
    return num_wrapped


def unwrap_weight_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                                local_metadata: dict) -> None:
    """Checkpoints hold plain tensors: replace the wrapped weight by the tensor it wraps. It shares the
    parameter's storage, so a checkpoint loaded in place into this state dict writes into the parameter."""
    key = f"{prefix}weight"
    weight = state_dict.get(key)
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    if not isinstance(local, Float8AllGatherWeight):
        return
    local.amax_slot.amax = None  # a checkpoint loaded in place into the unwrapped tensor bypasses the wrapper
    if isinstance(weight, DTensor):
        state_dict[key] = DTensor.from_local(local._tensor, weight.device_mesh, weight.placements,
                                             run_check=False, shape=weight.shape, stride=weight.stride())
    else:
        state_dict[key] = local._tensor


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """After optimizer.step(): the global amax of every float8-all-gathered weight, in one fused norm and one
    all-reduce MAX per sharded mesh dim, instead of one all-reduce per weight at each all-gather."""
    # Weights grouped by layout (in practice one: every FSDP unit shards over the same mesh). Parameters come in
    # the same order on every rank, so the ranks issue matching all-reduces.
    local_weights_by_layout: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[Float8AllGatherWeight]] = {}
    for parameter in model.parameters():
        if isinstance(parameter, DTensor) and isinstance(parameter._local_tensor, Float8AllGatherWeight):
            layout = (parameter.device_mesh, parameter.placements)
            local_weights_by_layout.setdefault(layout, []).append(parameter._local_tensor)
    for (mesh, placements), local_weights in local_weights_by_layout.items():
        # An uneven split can leave a rank an empty shard; inf-norm has no value there, and 0 is MAX's identity.
        shards = [w._tensor if w.numel() else w._tensor.new_zeros(1) for w in local_weights]
        amaxes = torch.stack(torch._foreach_norm(shards, ord=math.inf)).float()  # (num_weights,)
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():  # replicas (HSDP's replicate dim) hold the same values
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh_dim))
        for weight, amax in zip(local_weights, amaxes.unbind()):
            weight.amax_slot.amax = amax
