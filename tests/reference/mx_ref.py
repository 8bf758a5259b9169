"""MX block quantization written from the OCP Microscaling Formats (MX) Specification v1.0, not from titan.

Section 5: a block is k = 32 elements sharing a scale X in E8M0 (8 exponent bits, bias 127, no sign, no mantissa;
0xFF is NaN, so X spans 2**-127 .. 2**127). Section 6.3 converts a block {V_i}:
    shared_exp = floor(log2(max_i |V_i|)) - emax_elem      (emax_elem: exponent of the element type's max normal)
    X = 2**shared_exp, clamped to the E8M0 range
    P_i = quantize_to_element_format(V_i / X), normal numbers clamped to +-max (saturation)
with round-to-nearest-even elements (OFP8's conversion, tests/reference/float8_ref.py). Choices the spec leaves to
the implementation, as titan documents them (titan/quant/mx/numerics.py): a block with a NaN or inf gets X = NaN;
an all-zero block gets the smallest X, 2**-127. Arithmetic is float64 on Python floats, where dividing an fp32 value
by a power of two is exact.
"""

import math

import torch
from torch import Tensor

from reference import float8_ref

E8M0_BIAS = 127
E8M0_NAN = 0xFF


def emax_elem(spec: float8_ref.Float8Spec) -> int:
    """Exponent of the largest normal value: E4M3 448 = 1.75 * 2**8, E5M2 57344 = 1.75 * 2**15."""
    _, exponent = math.frexp(float8_ref.max_finite(spec))  # max = m * 2**exponent, 0.5 <= m < 1
    return exponent - 1


def scale_code(spec: float8_ref.Float8Spec, block: list[float]) -> int:
    """The E8M0 code of a block's shared scale."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return E8M0_NAN
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0
    _, exponent = math.frexp(amax)  # floor(log2(amax)) = exponent - 1, exactly
    shared_exp = exponent - 1 - emax_elem(spec)
    return min(max(shared_exp, -E8M0_BIAS), E8M0_BIAS) + E8M0_BIAS


def quantize_block(spec: float8_ref.Float8Spec, block: list[float]) -> tuple[int, list[int]]:
    """(E8M0 code, element codes) of one block; the elements of a NaN-scale block are not compared (NaN)."""
    code = scale_code(spec, block)
    if code == E8M0_NAN:
        return code, [float8_ref.nan_code(spec)] * len(block)
    scaled = torch.tensor([v / 2.0 ** (code - E8M0_BIAS) for v in block], dtype=torch.float64)
    return code, float8_ref.quantize(spec, scaled).tolist()


def quantize(spec: float8_ref.Float8Spec, x: Tensor, block_size: int = 32) -> tuple[Tensor, Tensor]:
    """(uint8 scale codes of shape (..., n / block_size), uint8 element codes of x's shape), blocks along the last
    dim of x."""
    blocks = x.double().reshape(-1, block_size).tolist()
    results = [quantize_block(spec, block) for block in blocks]
    codes = torch.tensor([code for code, _ in results], dtype=torch.uint8)
    elements = torch.tensor([element for _, block in results for element in block], dtype=torch.uint8)
    return codes.view(*x.shape[:-1], x.shape[-1] // block_size), elements.view(x.shape)


def dequantize(spec: float8_ref.Float8Spec, scale_codes: Tensor, element_codes: Tensor,
               block_size: int = 32) -> Tensor:
    """float64 values X * P_i; a NaN scale makes the whole block NaN (section 5.3)."""
    scales = torch.tensor([math.nan if c == E8M0_NAN else 2.0 ** (c - E8M0_BIAS)
                           for c in scale_codes.flatten().tolist()], dtype=torch.float64).view(scale_codes.shape)
    values = float8_ref.decode_codes(spec, element_codes)
    return values * scales.repeat_interleave(block_size, dim=-1)
