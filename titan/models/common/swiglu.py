"""SwiGLU's gate, silu(a) * b, as one kernel each way on a GPU.

Eager torch runs the gate as two kernels in forward (silu, multiply) and three in backward (two multiplies and
silu's backward), each a round trip through memory of a (tokens, hidden) tensor, in forward, in selective
checkpointing's recompute and in backward. `titan::swiglu` and `titan::swiglu_backward` are torch custom ops: on CUDA
one Triton kernel each (titan/models/common/swiglu_kernels.py: fp32 inside, the output rounded once), on the CPU the
unfused expression and exactly its autograd's backward, and on fake tensors (the dry run) their shapes alone. A
compiled block takes the expression instead: inductor fuses it with its neighbours, which an opaque op prevents."""

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("titan::swiglu", mutates_args=())
def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b for a, b of one shape and dtype."""
    if a.device.type == "cuda":
        from titan.models.common.swiglu_kernels import swiglu_forward

        return swiglu_forward(a, b)
    return F.silu(a) * b


@swiglu.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return torch.empty_like(a)


@torch.library.custom_op("titan::swiglu_backward", mutates_args=())
def swiglu_backward(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of silu(a) * b with respect to a and b, given the output's `grad`."""
    if a.device.type == "cuda":
        from titan.models.common.swiglu_kernels import swiglu_backward_kernel

        return swiglu_backward_kernel(grad, a, b)
    # The products autograd forms for the expression, in its order, so that the CPU path is the expression exactly.
    return torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a)


@swiglu_backward.register_fake
def _(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(a), torch.empty_like(b)


def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor]:
    a, b = ctx.saved_tensors
    return swiglu_backward(grad.contiguous(), a, b)


torch.library.register_autograd("titan::swiglu", backward, setup_context=setup_context)


def silu_gate(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b: the fused op eagerly, the expression where torch.compile traces it (and where the two differ in
    shape or dtype, which the kernels do not take)."""
    if torch.compiler.is_compiling() or a.shape != b.shape or a.dtype != b.dtype:
        return F.silu(a) * b
    return swiglu(a, b)
