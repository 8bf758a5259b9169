"""The dry run's GPU: the simulated rank runs on fake CUDA tensors, on a machine that may have no GPU and a torch
built without CUDA (titan/estimate/simulated_cuda.cpp makes its autograd engine take them), and under CUDA's rules
for mixing devices, so that it takes a GPU rank's branches (fused Adam on CUDA, SDPA's CUDA kernels, the step's
pinned-memory readback, CPU offload's copies between host and GPU) and fails where a GPU rank would.

Used only by the dry run (titan/estimate/simulate.py), under simulated_gpu:
- CudaDeviceRules, a dispatch mode: torch's fake tensors check devices less strictly than CUDA kernels do. On torch
  2.13, torch.stack of a CPU and a CUDA 0-dim tensor passes on fake tensors and fails on a GPU ("Expected all tensors
  to be on the same device"), the exact failure of clipping under FSDP on CUDA that no CPU test saw. The mode refuses
  every op that mixes CPU and CUDA tensors unless CUDA accepts it (cuda_refusal), runs the build's CUDA allocations on
  fake tensors, and stands in for pinned host memory, which fake tensors have no form of.
- simulated_cuda_runtime: stand-ins for the parts of torch.cuda that have no fake form and that FSDP2, pipelining and
  Titan call on a GPU: the current device, streams and events (FSDP2 overlaps its all-gathers on streams; the step's
  readback records an event), synchronize, the card's name and compute capability (the --estimate.gpu card's), its
  memory counters (zero: the dry run counts memory itself, titan/estimate/trace.py) and random state; and SDPA's
  kernel choice (cuda_sdpa), which a CPU-only torch would answer with its math fallback. docs/scale.md lists them.
- register_cuda_build_kernels: a torch built without CUDA decomposes a few ops on fake CUDA tensors that a CUDA
  build runs as one kernel (RMSNorm's fused kernel, silu's backward), so that the dry run would count four kernels
  where a GPU launches one.
"""

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

CROSS_DEVICE_OPS = frozenset({
    aten._to_copy.default, aten.copy_.default, aten.copy.default, aten._copy_from.default,
    aten._copy_from_and_resize.default,
})
"""Ops that move data between devices, on CUDA as anywhere."""
CONCATENATIONS = frozenset({aten.cat.default, aten.cat.out, aten.stack.default, aten.stack.out})
"""Ops that take no CPU tensor beside CUDA ones, scalars included: torch.stack of a CPU and a CUDA 0-dim tensor fails
on a GPU ("Expected all tensors to be on the same device") and passes on fake tensors."""
INDEXING_OPS = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._index_put_impl_.default})
"""Ops that take CPU index tensors for a CUDA tensor, moving them themselves."""

# Head sizes SDPA's CUDA kernels take (sdp_utils.cpp in torch 2.13): flash up to 256; memory-efficient any multiple
# of 8 (16-bit) or 4 (float32), the alignment of its tensor-core matmuls on SM80 and newer.
FLASH_MAX_HEAD_DIM = 256


TORCH_SDPA = F.scaled_dot_product_attention


FUSED_CUDA_OPS = ("_fused_rms_norm", "_fused_rms_norm_backward")
"""Ops that a CUDA build of torch 2.11-2.13 has CUDA kernels for and that the composite ops pick where a kernel for
the device exists (F.rms_norm); a CPU build has no kernel for them at all."""

_CUDA_BUILD_KERNELS: list[torch.library.Library] = []


def decomposed_on_cuda() -> list[str]:
    """The aten ops that this build decomposes on (fake) CUDA tensors although a CUDA build runs them as one kernel:
    FUSED_CUDA_OPS, and those with a CPU kernel and a composite one but no CUDA kernel (a CUDA build has both
    kernels: the composite then serves only other devices). Empty on a CUDA build."""
    def has(op: str, key: str) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)

    ops = [name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::")]
    composite = [op for op in ops if has(op, "CPU") and has(op, "CompositeImplicitAutograd")]
    return [op for op in (*FUSED_CUDA_OPS, *sorted(composite)) if not has(op, "CUDA")]


def register_cuda_build_kernels() -> None:
    """Give every op of decomposed_on_cuda a CUDA kernel, once per process, so that fake CUDA tensors reach it whole
    (as on a CUDA build) and fake tensors run its shape rule. The kernel itself only refuses: no real tensor is
    on CUDA in a torch without it."""
    if _CUDA_BUILD_KERNELS:
        return
    library = torch.library.Library("aten", "IMPL")

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("The dry run's placeholder for a CUDA kernel ran on a real tensor: this torch has no CUDA "
                           "kernels, and only fake tensors may take the simulated GPU's ops.")

    for op in decomposed_on_cuda():
        library.impl(op, refuse, "CUDA")
    _CUDA_BUILD_KERNELS.append(library)  # kept alive: a Library's registrations end with it


class CudaRuleError(RuntimeError):
    """An op that a CUDA device would refuse, met by the dry run's simulated GPU rank."""


def plain_tensors(value: object) -> list[Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, Tensor)]


def touches_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether an op reads a CUDA tensor or makes one."""
    device = kwargs.get("device")
    return (device is not None and torch.device(device).type == "cuda") or any(
        t.device.type == "cuda" for t in plain_tensors((args, kwargs)))


def cuda_refusal(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why CUDA would refuse this op's mix of devices, or None when it takes it: a copy between devices, CPU index
    tensors of an indexing op, or CPU 0-dim tensors read as scalars (TensorIterator's rule, and kernels that take a
    scalar's value, such as fill_), which an op may not write into and a concatenation may not take."""
    tensors = plain_tensors((args, kwargs))
    devices = {t.device.type for t in tensors} & {"cpu", "cuda"}
    if devices != {"cpu", "cuda"} or func in CROSS_DEVICE_OPS:
        return None
    on_cpu = [t for t in tensors if t.device.type == "cpu"]
    if func in INDEXING_OPS and all(t.dtype in (torch.int64, torch.int32, torch.bool) for t in on_cpu):
        return None
    written_on_cpu = func._schema.is_mutable and isinstance(args[0], Tensor) and args[0].device.type == "cpu"
    if all(t.dim() == 0 for t in on_cpu) and func not in CONCATENATIONS and not written_on_cpu:
        return None
    shapes = ", ".join(f"{t.device.type} {tuple(t.shape)}" for t in tensors)
    return (f"{func} mixes CPU and CUDA tensors ({shapes}), which a GPU refuses (Expected all tensors to be on the "
            f"same device).")


def sdpa_backend(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, enable_gqa: bool) -> SDPBackend:
    """The kernel CUDA's SDPA picks for these inputs, of flash attention (no mask, 16-bit, head size up to 256,
    grouped kv heads read in place), memory-efficient attention (a mask or float32; no grouped kv heads) and the
    math fallback, in that order: torch's order on Hopper and Blackwell, which may put cuDNN's kernel, of flash's
    memory class, first. The math fallback materializes every (query, key) score."""
    head_dim, same_head_dims = query.size(-1), query.size(-1) == key.size(-1) == value.size(-1)
    half = query.dtype in (torch.float16, torch.bfloat16)
    grouped = query.size(-3) != key.size(-3)
    if attn_mask is None and half and same_head_dims and head_dim <= FLASH_MAX_HEAD_DIM:
        return SDPBackend.FLASH_ATTENTION
    alignment = 8 if half else 4
    if same_head_dims and head_dim % alignment == 0 and not grouped and not enable_gqa:
        return SDPBackend.EFFICIENT_ATTENTION
    return SDPBackend.MATH


def cuda_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention as CUDA runs it, for CUDA tensors: the kernel sdpa_backend picks, a boolean mask
    turned into the additive bias the memory-efficient kernel reads (as torch does before calling it). A torch
    without CUDA kernels asks its CPU build which kernels exist and takes the math fallback, which holds every
    score."""
    if query.device.type != "cuda":
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    backend = sdpa_backend(query, key, value, attn_mask, enable_gqa)
    if backend == SDPBackend.FLASH_ATTENTION:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if backend == SDPBackend.EFFICIENT_ATTENTION:
        bias = attn_mask
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return aten._scaled_dot_product_efficient_attention(query, key, value, bias, query.requires_grad, dropout_p,
                                                            is_causal, scale=scale)[0]
    return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa)


class CudaDeviceRules(TorchDispatchMode):
    """Raises CudaRuleError on an op whose mix of CPU and CUDA tensors a GPU refuses (cuda_refusal), and runs every op
    on CUDA tensors on `fake_mode`'s fake ones, also before the build enters it (FSDP allocates its buffers on the
    mesh's device as it wraps the meta-built model). Pinned host memory has no fake form: pinning copies. DTensor ops
    are left to DTensor, whose local ops come back through the mode."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature, untyped
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        refusal = cuda_refusal(func, args, kwargs)
        if refusal is not None:
            raise CudaRuleError(refusal)
        # Fake tensors have no pinned form: a tensor in host memory counts as pinned, and pinning copies it there.
        if func is aten._pin_memory.default:
            return args[0].clone()
        if func is aten.is_pinned.default:
            return args[0].device.type == "cpu"
        if touches_cuda(args, kwargs) and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
            with self.fake_mode:  # FSDP's buffers, allocated as it wraps the meta-built model
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class SimulatedStream:
    """torch.cuda.Stream's interface, on a device where every op is done as soon as it is issued."""

    def __init__(self, device: object = None, priority: int = 0, **kwargs: object) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority

    def wait_stream(self, stream: "SimulatedStream") -> None:
        pass

    def wait_event(self, event: "SimulatedEvent") -> None:
        pass

    def record_event(self, event: "SimulatedEvent | None" = None) -> "SimulatedEvent":
        return event if event is not None else SimulatedEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class SimulatedEvent:
    """torch.cuda.Event's interface: every event has happened already."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: SimulatedStream | None = None) -> None:
        pass

    def wait(self, stream: SimulatedStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def simulated_cuda_runtime(name: str, capability: tuple[int, int]) -> Iterator[None]:
    """torch.cuda's runtime calls answered by stand-ins for one GPU (`name`, compute `capability`) while active."""
    stream = SimulatedStream()
    stand_ins = {
        "_lazy_init": lambda: None, "current_device": lambda: 0, "device_count": lambda: 1,
        "set_device": lambda device: None, "synchronize": lambda device=None: None,
        "Stream": SimulatedStream, "Event": SimulatedEvent,
        "current_stream": lambda device=None: stream, "default_stream": lambda device=None: stream,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "get_device_name": lambda device=None: name, "get_device_capability": lambda device=None: capability,
        "max_memory_allocated": lambda device=None: 0, "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        # A pipeline schedule forks the devices' random state while it sets its stages up.
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda state, device="cuda": None,
    }
    with contextlib.ExitStack() as stack:
        for attribute, stand_in in stand_ins.items():
            stack.enter_context(mock.patch.object(torch.cuda, attribute, stand_in))
        # Patched where callers look it up, not as a function mode: the backward's recomputation of checkpointed
        # blocks runs on the autograd engine's CUDA thread, which torch's function modes do not reach.
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", cuda_sdpa))
        yield


@contextlib.contextmanager
def simulated_gpu(name: str, capability: tuple[int, int], fake_mode: FakeTensorMode) -> Iterator[None]:
    """Everything the dry run's GPU rank runs under: the runtime's stand-ins and CUDA's device rules, on the fake
    tensors of `fake_mode`."""
    register_cuda_build_kernels()
    with simulated_cuda_runtime(name, capability), CudaDeviceRules(fake_mode):
        yield
