"""What one training step does on this rank, recorded op by op under a dispatch mode: every tensor storage allocated,
resized and freed (memory), every collective with its mesh dimension and bytes (communication volume), and every
op's FLOPs and bytes (the roofline). The same recorder runs on fake tensors (the dry run) and on real ones (the
runs that check the dry run), so the two are measured alike.

The mode defers ops on DTensors to DTensor (returning NotImplemented), so it sees the local ops each rank runs and
the collectives DTensor issues, with local shapes, never the global ones."""

import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from titan.estimate.roofline import Collective, OpCost

aten = torch.ops.aten
c10d = torch.ops.c10d
functional = torch.ops._c10d_functional
functional_autograd = torch.ops._c10d_functional_autograd

CATEGORIES = ("parameters", "gradients", "optimizer state", "communication buffers", "activations and temporaries")
"""How memory at the peak is split, in precedence order: a storage gets the first category that claims it."""

# Collective op -> (kind, where its payload is): the payload conventions of roofline.Collective. Non-functional
# c10d ops take (output, input, group, ...) or (tensors, group, ...); functional ones end with the group's name.
C10D_COLLECTIVES = {
    c10d._allgather_base_.default: ("all_gather", "output"),
    c10d.allgather_.default: ("all_gather", "output"),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", "input"),
    c10d.reduce_scatter_.default: ("reduce_scatter", "input"),
    c10d.allreduce_.default: ("all_reduce", "tensors"),
    c10d.broadcast_.default: ("broadcast", "tensors"),
    c10d.alltoall_base_.default: ("all_to_all", "input"),
    c10d.send.default: ("send", "tensors"),
    c10d.recv_.default: ("recv", "tensors"),
    c10d.barrier.default: ("barrier", "tensors"),
}
FUNCTIONAL_COLLECTIVES = {
    functional.all_gather_into_tensor.default: "all_gather",
    functional_autograd.all_gather_into_tensor.default: "all_gather",
    functional.reduce_scatter_tensor.default: "reduce_scatter",
    functional_autograd.reduce_scatter_tensor.default: "reduce_scatter",
    functional.all_reduce.default: "all_reduce",
    functional.all_reduce_.default: "all_reduce",
    functional.all_to_all_single.default: "all_to_all",
    functional_autograd.all_to_all_single.default: "all_to_all",
    functional.broadcast.default: "broadcast",
}

GROUPED_MM = aten._grouped_mm.default
SCALED_GROUPED_MM = aten._scaled_grouped_mm.default
# torch.nn.functional.scaled_mm's op (NVFP4's block-scaled matmuls), which torch's FLOP table lacks.
SCALED_MM_V2 = aten._scaled_mm_v2.default
# Fused attention kernels: forward and backward of SDPA's flash (CPU and CUDA), memory-efficient and cuDNN kernels.
# Their FLOPs are counted here, as the work the kernel does (a causal kernel skips the masked half; torch's FLOP table
# has no CPU kernels and counts causal kernels whole), and they are timed at the roofline's attention efficiency
# rather than the matmuls'.
ATTENTION_FORWARD = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(aten, name)}
ATTENTION_BACKWARD = {getattr(aten, f"{op._overloadpacket.__name__}_backward").default for op in ATTENTION_FORWARD
                      if hasattr(aten, f"{op._overloadpacket.__name__}_backward")}
ATTENTION_OPS = {op._overloadpacket for op in ATTENTION_FORWARD | ATTENTION_BACKWARD}


@dataclass(frozen=True)
class GroupInfo:
    """A process group as the step sees it: its mesh dimension label and global ranks."""

    dim: str
    ranks: tuple[int, ...]


def attention_flops(query: torch.Tensor, key: torch.Tensor, causal: bool) -> float:
    """Forward FLOPs of softmax(QK^T)V: two matmuls of 2*s_q*s_k*head_dim per query head. A causal kernel skips the
    masked half of the blocks, so it is counted as half: this is the work the GPU does, not the MFU convention."""
    batch, heads, seq_q, head_dim = query.shape  # (bs, local_heads, seq, head_dim); k/v may have fewer (GQA) heads
    flops = 4.0 * batch * heads * seq_q * key.shape[2] * head_dim
    return flops / 2 if causal else flops


def argument(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str) -> object:
    """The value of the op's argument `name`, given positionally, by keyword, or left at its default."""
    for index, declared in enumerate(func._schema.arguments):
        if declared.name == name:
            return args[index] if index < len(args) else kwargs.get(name, declared.default_value)
    raise KeyError(f"{func} has no argument {name}")


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    """FLOPs of torch._grouped_mm and torch._scaled_grouped_mm (a mixture of experts' matmuls, in high or low
    precision), which torch's FLOP table lacks: every output element is a dot product over the contracted dimension,
    except when two 2-D operands give one (in, out) matrix per group (an expert's weight gradient), where each group
    contracts only its own block of rows."""
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> float:
    """The op's FLOPs from torch's FLOP table (matmuls), with fused attention and grouped matmuls added."""
    if func is GROUPED_MM or func is SCALED_GROUPED_MM:
        return grouped_mm_flops(args[0], args[1], out)
    if func is SCALED_MM_V2:
        return 2.0 * out.numel() * contracted_size(args[0])
    if func in ATTENTION_FORWARD or func in ATTENTION_BACKWARD:
        query, key = argument(func, args, kwargs, "query"), argument(func, args, kwargs, "key")
        forward = attention_flops(query, key, causal=bool(argument(func, args, kwargs, "is_causal")))
        # Backward: dQ, dK, dV and the recomputed scores, 2.5x the forward's matmul work (torch's convention).
        return forward if func in ATTENTION_FORWARD else 2.5 * forward
    counter = flop_registry.get(func._overloadpacket)
    return float(counter(*args, **kwargs, out_val=out)) if counter is not None else 0.0


def contracted_size(a: torch.Tensor) -> int:
    """The contraction size of a matmul's left operand (M, K): K, of which a float4_e2m1fn_x2 element holds two."""
    return a.shape[-1] * (2 if a.dtype == torch.float4_e2m1fn_x2 else 1)


def precision_class(tensor: torch.Tensor) -> str:
    """The roofline's dtype class of a matmul input."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if tensor.dtype == torch.float4_e2m1fn_x2:
        return "fp4"
    return "fp32" if tensor.dtype == torch.float32 else "bf16"


def local_tensors(value: object) -> list[torch.Tensor]:
    """The plain tensors inside `value` (nested lists, DTensors and other wrapper subclasses unwrapped)."""
    found = []
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            found.extend(local_tensors([getattr(leaf, name) for name in names]))
        else:
            found.append(leaf)
    return found


def tensor_bytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(value))


class StepRecorder(TorchDispatchMode):
    """Records memory events, collectives and op costs while active. Storages alive before it starts count only
    once they are registered (register) or touched by an op; frees are seen through weakref callbacks, and FSDP's
    storage resizes (how it frees and refills unsharded parameters) through UntypedStorage.resize_."""

    def __init__(self, groups: dict[str, GroupInfo]) -> None:
        super().__init__()
        self.groups = groups
        self.paused = False
        """Inside DTensor's sharding propagation, which runs ops on global-shape fake tensors to learn an output's
        shape (context parallel's ring attention, on the whole sequence): work a GPU never does."""
        self.ops: list[OpCost] = []
        self.collectives: list[Collective] = []
        self.events: list[tuple[int, int]] = []
        """(storage id, change in bytes) in order: positive on allocation or growth, negative on free."""
        self.live: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self.on_host: set[int] = set()
        """Storages in host memory (a CPU tensor's, on a simulated GPU: CPU offload's shards, pinned copies)."""
        self._ids = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._original_resize = None

    def __enter__(self) -> "StepRecorder":
        self._original_resize = torch.UntypedStorage.resize_
        self._original_propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        recorder = self

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            result = recorder._original_resize(storage, size)
            recorder.resized(storage, size)
            return result

        def propagate(propagator: ShardingPropagator, *args: object, **kwargs: object) -> object:
            recorder.paused = True
            try:
                return recorder._original_propagate(propagator, *args, **kwargs)
            finally:
                recorder.paused = False

        torch.UntypedStorage.resize_ = resize_
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        return super().__enter__()

    def __exit__(self, *args: object) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate
        super().__exit__(*args)

    def register(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Count the storages of `tensors` (already alive) under `label`, one of CATEGORIES."""
        for tensor in local_tensors(list(tensors)):
            self.labels[self.see(tensor)] = label

    def label(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Give the storages of `tensors`, seen during the step, the category `label` (gradients, once they exist)."""
        self.register(tensors, label)

    def see(self, tensor: torch.Tensor) -> int:
        """The id of the tensor's storage; a storage seen for the first time is allocated now."""
        storage_id = self.see_storage(tensor.untyped_storage())
        if tensor.device.type == "cpu":  # a fake tensor's storage is on "meta": its tensor says where it lives
            self.on_host.add(storage_id)
        return storage_id

    def see_storage(self, storage: torch.UntypedStorage) -> int:
        known = self._ids.get(storage)
        if known is not None:
            return known
        storage_id = len(self._refs)
        self._ids[storage] = storage_id
        self._refs[storage_id] = weakref.ref(storage, functools.partial(self.freed, storage_id))
        self.change(storage_id, storage.nbytes())
        return storage_id

    def change(self, storage_id: int, size: int) -> None:
        delta = size - self.live.get(storage_id, 0)
        if delta:
            self.events.append((storage_id, delta))
        self.live[storage_id] = size

    def freed(self, storage_id: int, _ref: weakref.ref) -> None:
        self.change(storage_id, 0)

    def resized(self, storage: torch.UntypedStorage, size: int) -> None:
        known = self._ids.get(storage)
        if known is None:
            self.see_storage(storage)
        else:
            self.change(known, size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature, untyped
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        outputs = local_tensors(out)
        for tensor in outputs:
            self.see(tensor)
        if func in C10D_COLLECTIVES or func in FUNCTIONAL_COLLECTIVES:
            self.record_collective(func, args, out)
        elif not func.is_view and self.moves_data(func, args, kwargs, outputs):
            self.record_cost(func, args, kwargs, out, outputs)
        return out

    def moves_data(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                   outputs: list[torch.Tensor]) -> bool:
        """Whether the op reads or writes tensor memory. Ops that return no tensor and change none (prim.device:
        one call per tensor moved to a device, 11k per step of the 1B model) or only return an alias of an input
        (views torch does not mark as views, such as _unsafe_view) cost no HBM traffic and no kernel."""
        if func._schema.is_mutable:
            return True
        input_storages = {self._ids.get(t.untyped_storage()) for t in local_tensors((args, kwargs))}
        return any(self._ids.get(t.untyped_storage()) not in input_storages for t in outputs)

    def record_cost(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object,
                    outputs: list[torch.Tensor]) -> None:
        inputs = local_tensors((args, kwargs))
        moved = sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
        flops = op_flops(func, args, kwargs, out)
        self.ops.append(OpCost(flops=flops, bytes=moved, precision=precision_class(inputs[0]) if flops else "bf16",
                               attention=func._overloadpacket in ATTENTION_OPS, name=func._overloadpacket.__name__))

    def record_collective(self, func: torch._ops.OpOverload, args: tuple, out: object) -> None:
        """One collective's payload (roofline.Collective's conventions) and group; its buffers are communication
        buffers unless something else claims them."""
        if func in FUNCTIONAL_COLLECTIVES:
            kind = FUNCTIONAL_COLLECTIVES[func]
            group_name = args[-1]
            payload = out if kind == "all_gather" else args[0]
            buffers = [*local_tensors(args[0]), *local_tensors(out)]
        else:
            kind, where = C10D_COLLECTIVES[func]
            group_name = ProcessGroup.unbox(next(arg for arg in args if isinstance(arg, torch.ScriptObject))).group_name
            payload = {"output": args[0], "input": args[1], "tensors": args[0]}[where]
            buffers = local_tensors(args[:2] if where != "tensors" else args[0])
        for tensor in buffers:
            storage_id = self.see(tensor)
            self.labels.setdefault(storage_id, "communication buffers")
        group = self.groups.get(group_name, GroupInfo(dim=group_name, ranks=()))
        self.collectives.append(Collective(dim=group.dim, kind=kind, bytes=tensor_bytes(payload), ranks=group.ranks))


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes live at the step's peak on the GPU, in total and by category (CATEGORIES), and the peak of what lives in
    host memory instead (CPU offload's shards, gradients and optimizer state, pinned copies; 0 on a CPU rank)."""

    total: int
    by_category: dict[str, int]
    host: int = 0


def memory_peak(recorder: StepRecorder, host_memory: bool) -> MemoryPeak:
    """Replay the recorder's events to find the peak of live bytes on the device and what was live then; with
    `host_memory`, storages of CPU tensors are in host memory, with a peak of their own. Categories are settled
    after the step (gradients are only known once they exist), so the split is exact at the peak too."""
    on_host = recorder.on_host if host_memory else set()
    live = live_at_peak([(storage_id, delta) for storage_id, delta in recorder.events if storage_id not in on_host])
    by_category = dict.fromkeys(CATEGORIES, 0)
    for storage_id, size in live.items():
        by_category[recorder.labels.get(storage_id, "activations and temporaries")] += size
    host_events = [(storage_id, delta) for storage_id, delta in recorder.events if storage_id in on_host]
    return MemoryPeak(total=sum(live.values()), by_category=by_category, host=sum(live_at_peak(host_events).values()))


def live_at_peak(events: list[tuple[int, int]]) -> dict[int, int]:
    """Bytes of each storage live the first time the replayed (storage, size change) events reach their peak."""
    total, peak = 0, 0
    for _, delta in events:
        total += delta
        peak = max(peak, total)
    live: dict[int, int] = {}
    total = 0
    for storage_id, delta in events:
        live[storage_id] = live.get(storage_id, 0) + delta
        total += delta
        if total == peak:
            break
    return live
