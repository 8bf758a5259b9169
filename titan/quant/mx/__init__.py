"""MX (OCP Microscaling) formats: `quantize` and `dequantize` for users and tests, MXLinear for training."""

from titan.quant.mx.numerics import dequantize, quantize

__all__ = ["dequantize", "quantize"]
