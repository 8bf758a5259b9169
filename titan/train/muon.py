"""Muon (--optimizer.name Muon; arXiv:2502.16982, Keller Jordan's post): each hidden weight matrix steps along its
momentum orthogonalised by a few Newton-Schulz iterations; every other parameter (embedding, output projection,
norms, biases, sinks, routers) steps with AdamW, in the same optimizer, so that one LR schedule, one checkpoint and
one skip flag cover both.

The matrices' update is torch.optim.Muon's, op for op (the momentum's lerp, Nesterov's look-ahead, Newton-Schulz in
bfloat16 with the matrix transposed to be wide, decoupled weight decay, the shape's learning-rate adjustment), so on
one process it equals torch's bit for bit. A stack of experts' matrices (experts, out, in) is orthogonalised matrix by
matrix, batched (torch's Muon takes 2-D parameters only).

Sharded, the Newton-Schulz iteration needs the whole matrix, which FSDP and TP cut into boxes over the ranks of a
shard group (the mesh dims whose placement cuts a matrix dim; a replicate dim, HSDP's, holds copies and runs its own
group). Each such matrix gets one owner in its group, the least loaded by the iteration's cost, so every rank
orthogonalises its share; an all-to-all gathers each owner's matrices from every rank's box, the owner runs
Newton-Schulz on them, and a second all-to-all returns each rank its box of the result (bfloat16 both ways: the
iteration's own dtype). Matrices go in buckets of one per group rank, and the next bucket's gather runs while the
owners compute. The momentum stays sharded; nothing else is gathered. Expert parallel shards the experts' stack along
the experts (and expert FSDP along it too), so every rank holds whole matrices and orthogonalises its own, with no
exchange; so does one process.

A skipped step (--training.on_nonfinite, --training.on_spike) is decided on the device: while the trainer sets
`found_inf`, a non-zero value leaves the matrices and their momentum bit for bit as they were (the update is computed
and not selected, never scaled by 0: a skipped step's gradients are non-finite), and the AdamW parameters take fused
AdamW's own found_inf path.
"""

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import _disable_current_modes

from titan.parallel.shards import local_shard, matching_layout

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, shape) of a rank's chunk of a sharded tensor, in the whole tensor."""

GroupOf = Callable[[DeviceMesh, tuple[int, ...]], dist.ProcessGroup]
"""The process group over the given dims of a mesh (titan/parallel/dims.py Meshes.shard_group)."""


def newton_schulz(matrices: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (_zeropower_via_newtonschulz) on a matrix (rows, cols)
    or a stack of them (..., rows, cols), each on its own: in bfloat16, transposed to be wide, divided by its
    Frobenius norm (at least `eps`), then `steps` times X <- a X + (b A + c A^2) X with A = X X^T. The same ops in the
    same order as torch's on a matrix, batched on a stack. Returns bfloat16."""
    a, b, c = coefficients
    x = matrices.to(torch.bfloat16, copy=True)
    tall = x.size(-2) > x.size(-1)
    # A stack's norms over each matrix in memory order, as torch's reduction reads a transposed matrix.
    norms = x.norm() if x.dim() == 2 else x.flatten(-2).norm(dim=-1)[..., None, None]  # (..., 1, 1) for a stack
    if tall:
        x = x.mT
    x.div_(norms.clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        if x.dim() == 2:
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def newton_schulz_bound(coefficients: Sequence[float], steps: int) -> tuple[float, float]:
    """(a singular value in [0, 1], where the iteration takes it) for the one taken farthest from 0. The iteration
    acts on each singular value alone, s <- a s + b s^3 + c s^5, and the norm division puts them in [0, 1]; so a
    bounded result on that interval is a bounded update, and a huge or non-finite one is NaN weights."""
    a, b, c = coefficients
    values = torch.linspace(0.0, 1.0, 10001, dtype=torch.float64)
    mapped = values.clone()
    for _ in range(steps):
        mapped = a * mapped + b * mapped**3 + c * mapped**5
    magnitude = torch.nan_to_num(mapped.abs(), nan=math.inf)
    worst = int(magnitude.argmax())
    return float(values[worst]), float(mapped[worst])


def adjusted_lr(lr: float, adjust_lr_fn: str, rows: int, cols: int) -> float:
    """A (rows x cols) matrix's learning rate, as torch.optim.Muon's _adjust_lr computes it: original scales by
    sqrt(max(1, rows / cols)), match_rms_adamw by 0.2 sqrt(max(rows, cols)) (AdamW's update RMS)."""
    ratio = math.sqrt(max(1, rows / cols)) if adjust_lr_fn == "original" else 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs of the iteration on one matrix, wide side n and narrow side m: per step X X^T (2 m^2 n),
    A^2 (2 m^3) and (...) X (2 m^2 n). What the owners' balance weighs and the dry run's Muon line counts."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class Gathered:
    """How a sharded matrix (or stack) is gathered whole on one rank of the group that holds its pieces."""

    group: dist.ProcessGroup
    index: int
    """This rank's index in the group."""
    owner: int
    """The index of the rank that runs Newton-Schulz on it."""
    boxes: tuple[Box, ...]
    """Each group rank's chunk, by index."""
    shape: torch.Size


def shard_mesh_dims(param: DTensor) -> tuple[int, ...]:
    """The mesh dims whose placement cuts `param` into pieces (FSDP's and TP's, FSDP's strided over TP's shards
    included; not HSDP's replicate dim)."""
    return tuple(dim for dim, placement in enumerate(param.placements)
                 if placement.is_shard() or isinstance(placement, _StridedShard))


def cuts_matrices(param: Tensor) -> bool:
    """Whether some rank holds part of one of `param`'s matrices: a placement shards one of its last two dims. Expert
    parallel and expert FSDP cut the experts' stack along the experts, leaving every matrix whole on a rank."""
    if not isinstance(param, DTensor):
        return False
    matrix_dims = (param.dim() - 2, param.dim() - 1)
    cut = [param.placements[dim].dim in matrix_dims for dim in shard_mesh_dims(param)]
    # Every sharded layout Titan builds cuts either the matrices (FSDP, TP) or the stack (EP), never both.
    assert all(cut) or not any(cut), f"a layout that shards both a stack and its matrices: {param.placements}"
    return any(cut)


def coordinate_of(ranks: list, rank: int) -> list[int]:
    """Where `rank` sits in a mesh's nested list of ranks."""
    if isinstance(ranks, int):
        return [] if ranks == rank else None
    for index, inner in enumerate(ranks):
        found = coordinate_of(inner, rank)
        if found is not None:
            return [index, *found]
    return None


def chunk_boxes(param: DTensor, group: dist.ProcessGroup) -> tuple[Box, ...]:
    """The box of each rank of `group` (in group order), computed from its coordinate in the parameter's mesh: the
    same on every rank, with no exchange (and so also in the dry run, whose process groups carry no data)."""
    mesh = param.device_mesh
    boxes = []
    # Host arithmetic on the mesh's rank table and the shapes, outside the dispatch modes the step may run under
    # (under the dry run's fake tensors its small tensors would be fake, and reading them data-dependent).
    with _disable_current_modes():
        ranks = mesh.mesh.tolist()
        for rank in dist.get_process_group_ranks(group):
            shape, offsets = _compute_local_shape_and_global_offset(param.shape, mesh.shape,
                                                                    coordinate_of(ranks, rank), param.placements)
            boxes.append((tuple(offsets), tuple(shape)))
    return tuple(boxes)


def least_loaded_owners(costs: Sequence[int], group_size: int) -> list[int]:
    """An owner (a group index) for each matrix by its cost, in order: each to the rank with the least cost so far
    (the lowest index among equals), so that every rank of the group orthogonalises about its share."""
    loads = [0] * group_size
    owners = []
    for cost in costs:
        owner = loads.index(min(loads))
        loads[owner] += cost
        owners.append(owner)
    return owners


def matrix_cost(param: Tensor, ns_steps: int) -> int:
    """Newton-Schulz FLOPs of a parameter's matrices (a stack's all of them)."""
    *stack, rows, cols = param.shape
    return math.prod(stack) * newton_schulz_flops(rows, cols, ns_steps)


def plan_gathers(params: Sequence[Tensor], group_of: GroupOf, ns_steps: int) -> dict[int, Gathered]:
    """A Gathered for every parameter in `params` whose matrices are cut (by id), its owner the least loaded rank of
    its group by Newton-Schulz's cost, in parameter order: the same plan on every rank."""
    by_group: dict[dist.ProcessGroup, list[Tensor]] = defaultdict(list)
    for param in params:
        if cuts_matrices(param):
            by_group[group_of(param.device_mesh, shard_mesh_dims(param))].append(param)
    plans = {}
    for group, members in by_group.items():
        owners = least_loaded_owners([matrix_cost(param, ns_steps) for param in members], dist.get_world_size(group))
        for param, owner in zip(members, owners):
            plans[id(param)] = Gathered(group, dist.get_rank(group), owner, chunk_boxes(param, group), param.shape)
    return plans


def in_buckets(items: list[tuple[Gathered, Tensor]]) -> list[list[tuple[Gathered, Tensor]]]:
    """`items` (plan, this rank's chunk of the update) by group, in buckets of as many matrices as the group has
    ranks: one exchange each."""
    by_group: dict[dist.ProcessGroup, list[tuple[Gathered, Tensor]]] = defaultdict(list)
    for item in items:
        by_group[item[0].group].append(item)
    buckets = []
    for group_items in by_group.values():
        size = dist.get_world_size(group_items[0][0].group)
        buckets += [group_items[start:start + size] for start in range(0, len(group_items), size)]
    return buckets


def box_slices(box: Box) -> tuple[slice, ...]:
    offsets, shape = box
    return tuple(slice(offset, offset + length) for offset, length in zip(offsets, shape))


class BucketExchange:
    """One bucket's two all-to-alls: every rank's chunks to the matrices' owners (start_gather, whole), and the
    orthogonalised matrices' chunks back (start_scatter, chunks), each started asynchronously."""

    def __init__(self, bucket: list[tuple[Gathered, Tensor]]) -> None:
        self.plans = [plan for plan, _ in bucket]
        self.group = self.plans[0].group
        self.size, self.index = dist.get_world_size(self.group), self.plans[0].index
        self.owned = [plan for plan in self.plans if plan.owner == self.index]
        by_owner: list[list[Tensor]] = [[] for _ in range(self.size)]
        for plan, chunk in bucket:
            by_owner[plan.owner].append(chunk.to(torch.bfloat16).flatten())
        self.send_splits = [sum(piece.numel() for piece in pieces) for pieces in by_owner]
        self.send = torch.cat([piece for pieces in by_owner for piece in pieces])
        self.receive_splits = [sum(math.prod(plan.boxes[rank][1]) for plan in self.owned) for rank in range(self.size)]

    def start_gather(self) -> tuple[Tensor, dist.Work]:
        received = self.send.new_empty(sum(self.receive_splits))
        work = dist.all_to_all_single(received, self.send, self.receive_splits, self.send_splits, group=self.group,
                                      async_op=True)
        return received, work

    def whole_matrices(self, received: Tensor) -> list[Tensor]:
        """The owned matrices, each put together from every rank's chunk."""
        matrices = [received.new_empty(plan.shape) for plan in self.owned]
        for rank, from_rank in enumerate(received.split(self.receive_splits)):
            for matrix, plan, chunk in zip(matrices, self.owned, from_rank.split(
                    [math.prod(plan.boxes[rank][1]) for plan in self.owned])):
                matrix[box_slices(plan.boxes[rank])] = chunk.view(plan.boxes[rank][1])
        return matrices

    def start_scatter(self, orthogonalised: list[Tensor]) -> tuple[Tensor, dist.Work]:
        """Each rank's chunks of the owned, orthogonalised matrices back to it."""
        send = torch.cat([matrix[box_slices(plan.boxes[rank])].flatten()
                          for rank in range(self.size) for matrix, plan in zip(orthogonalised, self.owned)]
                         ) if self.owned else self.send.new_empty(0)
        received = self.send.new_empty(sum(self.send_splits))
        work = dist.all_to_all_single(received, send, self.send_splits, self.receive_splits, group=self.group,
                                      async_op=True)
        return received, work

    def own_chunks(self, received: Tensor) -> list[Tensor]:
        """This rank's chunk of each matrix of the bucket, in bucket order, from what the owners sent back."""
        from_owner = [iter(piece.split([math.prod(plan.boxes[self.index][1]) for plan in self.plans
                                        if plan.owner == owner]))
                      for owner, piece in enumerate(received.split(self.send_splits))]
        return [next(from_owner[plan.owner]).view(plan.boxes[self.index][1]) for plan in self.plans]


def orthogonalise(items: list[tuple[Gathered | None, Tensor]], coefficients: Sequence[float], steps: int,
                  eps: float) -> list[Tensor]:
    """Newton-Schulz of each item's matrices, for this rank's chunk of them (item: its Gathered, or None where this
    rank holds whole matrices), in item order: whole ones here, cut ones by their owners, the next bucket's gather
    overlapping this bucket's iterations."""
    results: dict[int, Tensor] = {}
    gathered = []
    for position, (plan, chunk) in enumerate(items):
        if plan is None:
            results[position] = newton_schulz(chunk, coefficients, steps, eps)
        else:
            gathered.append((plan, chunk, position))
    buckets = in_buckets([(plan, chunk) for plan, chunk, _ in gathered])
    positions = iter(position for _, _, position in gathered)
    exchanges = [BucketExchange(bucket) for bucket in buckets]
    scatters = []
    pending = exchanges[0].start_gather() if exchanges else None
    for number, exchange in enumerate(exchanges):
        received, work = pending
        work.wait()
        if number + 1 < len(exchanges):
            pending = exchanges[number + 1].start_gather()
        whole = [newton_schulz(matrix, coefficients, steps, eps) for matrix in exchange.whole_matrices(received)]
        scatters.append((exchange, *exchange.start_scatter(whole)))
    for exchange, received, work in scatters:
        work.wait()
        for chunk in exchange.own_chunks(received):
            results[next(positions)] = chunk
    return [results[position] for position in range(len(items))]


class Muon(torch.optim.Optimizer):
    """Muon on the parameter groups marked `"algorithm": "muon"`, AdamW on those marked "adamw" (titan/train/optim.py
    parameter_groups makes both), one optimizer: its state holds each matrix's `momentum_buffer` and the AdamW
    parameters' moments and step counts, by parameter, as DCP saves and reshards them."""

    def __init__(self, param_groups: list[dict[str, Any]], *, lr: float, weight_decay: float, momentum: float,
                 nesterov: bool, ns_coefficients: Sequence[float], ns_steps: int, ns_eps: float, adjust_lr_fn: str,
                 betas: tuple[float, float], eps: float, adamw_kernel: str, group_of: GroupOf | None) -> None:
        """`adamw_kernel`: torch's AdamW kernel for the AdamW groups (fused, foreach or for-loop). `group_of`: the
        process group of a sharded matrix's mesh dims (None on one process, where nothing is sharded)."""
        super().__init__(param_groups, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                            ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps,
                                            adjust_lr_fn=adjust_lr_fn))
        self.group_of = group_of
        # torch's AdamW on the same group dicts and the same state: its kernels, found_inf path and state layout.
        self.adamw = torch.optim.AdamW(self.adamw_groups(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       foreach=adamw_kernel == "foreach", fused=adamw_kernel == "fused")
        self.adamw.state = self.state
        self.skips_on_found_inf = adamw_kernel == "fused"
        """The trainer may set `found_inf` before step() (titan/train/step.py): Muon's update always skips on it,
        AdamW's fused kernel does too, the other AdamW kernels cannot."""
        self.gathers: dict[int, Gathered] | None = None
        self.register_load_state_dict_post_hook(Muon.share_with_adamw)

    def adamw_groups(self) -> list[dict[str, Any]]:
        return [group for group in self.param_groups if group["algorithm"] == "adamw"]

    @staticmethod
    def share_with_adamw(optimizer: "Muon") -> None:
        """load_state_dict made new group dicts and a new state: AdamW works on those again."""
        optimizer.adamw.param_groups = optimizer.adamw_groups()
        optimizer.adamw.state = optimizer.state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        found_inf = getattr(self, "found_inf", None)
        matrices = [(group, param) for group in self.param_groups if group["algorithm"] == "muon"
                    for param in group["params"] if param.grad is not None]
        if self.gathers is None:
            self.gathers = plan_gathers([param for _, param in matrices], self.group_of, self.defaults["ns_steps"])
        updates, new_buffers = [], []
        for group, param in matrices:
            grad = local_shard(matching_layout(param.grad, param))
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buffer = local_shard(state["momentum_buffer"])
            new_buffer = buffer.lerp(grad, 1 - group["momentum"]) if found_inf is not None else buffer.lerp_(
                grad, 1 - group["momentum"])
            new_buffers.append(new_buffer)
            updates.append(grad.lerp(new_buffer, group["momentum"]) if group["nesterov"] else new_buffer)
        defaults = self.defaults
        orthogonal = orthogonalise([(self.gathers.get(id(param)), update) for (_, param), update
                                    in zip(matrices, updates)], defaults["ns_coefficients"], defaults["ns_steps"],
                                   defaults["ns_eps"])
        for (group, param), update, new_buffer in zip(matrices, orthogonal, new_buffers):
            self.apply_update(group, param, update, new_buffer, found_inf)
        if found_inf is not None:
            self.adamw.found_inf = found_inf
        try:
            self.adamw.step()
        finally:
            self.adamw.__dict__.pop("found_inf", None)

    def apply_update(self, group: dict[str, Any], param: Tensor, update: Tensor, new_buffer: Tensor,
                     found_inf: Tensor | None) -> None:
        """Decoupled weight decay and the orthogonalised step at the matrix's adjusted rate, in place, as torch's
        Muon; under `found_inf`, selected where it is 0 and the momentum with it."""
        weights = local_shard(param)
        lr = group["lr"]
        step = adjusted_lr(lr, group["adjust_lr_fn"], *param.shape[-2:])
        if found_inf is None:
            weights.mul_(1 - lr * group["weight_decay"])
            weights.add_(update, alpha=-step)
            return
        apply = found_inf == 0
        updated = (weights * (1 - lr * group["weight_decay"])).add_(update, alpha=-step)
        weights.copy_(torch.where(apply, updated, weights))
        buffer = local_shard(self.state[param]["momentum_buffer"])
        buffer.copy_(torch.where(apply, new_buffer, buffer))

