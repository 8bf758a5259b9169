"""Triton kernels of SwiGLU's gate (titan/models/common/swiglu.py): elementwise over contiguous tensors, the math in
fp32 and each output rounded once, to nearest even, into the inputs' dtype. Imported only where a CUDA tensor meets
the gate: Triton has no CPU backend, and the CPU path is torch's own (tests run these under TRITON_INTERPRET=1)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
"""Elements per program: 8 per thread at 4 warps, loads of 16 bytes for 16-bit dtypes."""


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 x in `dtype`, to nearest even (Triton's fp_downcast_rounding applies to narrowing conversions only)."""
    if dtype == tl.float32:
        return x
    return x.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _swiglu_forward(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    out = a * tl.sigmoid(a) * b
    tl.store(out_ptr + offsets, _rounded(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(grad_ptr, a_ptr, b_ptr, grad_a_ptr, grad_b_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    sigmoid = tl.sigmoid(a)
    # d silu(a) / da = sigmoid(a) (1 + a (1 - sigmoid(a))), the formula of torch's silu_backward.
    grad_a = grad * b * sigmoid * (1 + a * (1 - sigmoid))
    grad_b = grad * a * sigmoid
    tl.store(grad_a_ptr + offsets, _rounded(grad_a, grad_a_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_b_ptr + offsets, _rounded(grad_b, grad_b_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    _swiglu_forward[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)
    return out


def swiglu_backward_kernel(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    grad, a, b = grad.contiguous(), a.contiguous(), b.contiguous()
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    _swiglu_backward[(triton.cdiv(n, BLOCK),)](grad, a, b, grad_a, grad_b, n, BLOCK=BLOCK)
    return grad_a, grad_b
