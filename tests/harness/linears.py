"""What the low-precision linear tests share (float8, MX, NVFP4): one forward and backward of a linear layer, and the
signal-to-quantization-noise ratio of an approximation."""

import math

from torch import Tensor, nn


def run_linear(linear: nn.Module, x: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """Output, grad_input and grad_weight of one forward of `x` and a backward of `grad` (cast to the output's
    dtype), in that order. The layer's weight.grad is None again afterwards, so that another call on it starts from
    no gradient."""
    x_leaf = x.clone().requires_grad_()
    out = linear(x_leaf)
    out.backward(grad.to(out.dtype))
    grad_weight = linear.weight.grad
    linear.weight.grad = None
    return {"output": out.detach(), "grad_input": x_leaf.grad, "grad_weight": grad_weight}


def sqnr_db(reference: Tensor, approximation: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (reference - approximation).float().norm()
    return 20 * math.log10(reference.float().norm() / noise)
