"""Float8 quantization and dynamic scaling written from the specs, not from torch's float8 dtypes or from titan.

Formats: OCP 8-bit Floating Point Specification (OFP8) rev 1.0, section 4. E4M3 is the "fn" variant: bias 7,
no infinities, and the single nan pattern S.1111.111 frees S.1111.000-110 for normal numbers, up to 448.
E5M2 follows IEEE 754: bias 15, exponent 11111 is inf (mantissa 0) or nan, max 57344. Values are decoded from
all 256 bit patterns; quantizing picks the nearest decoded value, ties to the even code (mantissa LSB 0),
saturating to +-max (OFP8 section 5's saturating conversion, which maps inf to +-max too).

Scaling (torchao's dynamic recipe): scale = fp32(max / max(amax, fp32(EPS))), optionally rounded down to a power
of two, and data = quantize(fp32(x * scale)): the product is rounded to fp32 before the float8 rounding, as both
implementations compute it in fp32. Arithmetic is float64, where a product or quotient of two fp32 values rounded
once to fp32 equals the fp32 operation (53 >= 2 * 24 + 2 bits).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

EPS = 1e-12


@dataclass(frozen=True)
class Float8Spec:
    name: str
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    has_infinity: bool


E4M3 = Float8Spec("E4M3", exponent_bits=4, mantissa_bits=3, exponent_bias=7, has_infinity=False)
E5M2 = Float8Spec("E5M2", exponent_bits=5, mantissa_bits=2, exponent_bias=15, has_infinity=True)


def decode(spec: Float8Spec, code: int) -> float:
    """The value of one 8-bit pattern, per the OFP8 encoding tables."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> spec.mantissa_bits) & ((1 << spec.exponent_bits) - 1)
    mantissa = code & ((1 << spec.mantissa_bits) - 1)
    exponent_all_ones = exponent == (1 << spec.exponent_bits) - 1
    mantissa_all_ones = mantissa == (1 << spec.mantissa_bits) - 1
    if spec.has_infinity and exponent_all_ones:
        return sign * math.inf if mantissa == 0 else math.nan
    if not spec.has_infinity and exponent_all_ones and mantissa_all_ones:
        return math.nan
    fraction = mantissa / (1 << spec.mantissa_bits)
    if exponent == 0:
        return sign * 2.0 ** (1 - spec.exponent_bias) * fraction
    return sign * 2.0 ** (exponent - spec.exponent_bias) * (1.0 + fraction)


def decode_codes(spec: Float8Spec, codes: Tensor) -> Tensor:
    """float64 values of a uint8 tensor of codes."""
    table = torch.tensor([decode(spec, code) for code in range(256)], dtype=torch.float64)
    return table[codes.long()]


def positive_finite_codes(spec: Float8Spec) -> list[int]:
    """Codes of +0 up to +max; for positive codes the value grows with the code."""
    return [code for code in range(0x80) if math.isfinite(decode(spec, code))]


def max_finite(spec: Float8Spec) -> float:
    return decode(spec, positive_finite_codes(spec)[-1])


def nan_code(spec: Float8Spec) -> int:
    return next(code for code in range(0x80) if math.isnan(decode(spec, code)))


def quantize(spec: Float8Spec, values: Tensor) -> Tensor:
    """uint8 codes of `values`: nearest representable, ties to even, saturating to +-max; nan maps to a nan code."""
    values = values.double().contiguous()  # searchsorted copies strided (transposed) inputs anyway
    codes = torch.tensor(positive_finite_codes(spec))
    grid = torch.tensor([decode(spec, code) for code in codes.tolist()], dtype=torch.float64)
    magnitude = values.abs().clamp(max=max_finite(spec))
    above = torch.searchsorted(grid, magnitude).clamp(max=len(grid) - 1)  # first grid value >= magnitude
    below = (above - 1).clamp(min=0)
    # A tie is an exact midpoint, with few bits and in the binade of its neighbours, so both distances are exact.
    distance_above = grid[above] - magnitude
    distance_below = magnitude - grid[below]
    take_above = (distance_above < distance_below) | ((distance_above == distance_below) & (codes[above] % 2 == 0))
    magnitude_codes = torch.where(take_above, codes[above], codes[below])
    magnitude_codes = torch.where(values.isnan(), nan_code(spec), magnitude_codes)
    return (magnitude_codes | torch.where(torch.signbit(values), 0x80, 0)).to(torch.uint8)


def round_to_fp32(values: Tensor) -> Tensor:
    """Round float64 values to the nearest fp32, kept in float64."""
    return values.float().double()


def scale_from_amax(spec: Float8Spec, amax: float, round_to_power_of_2: bool) -> float:
    """fp32 scale max / max(amax, EPS); inf amax gives 0 and nan gives nan. Power-of-2 rounding is downwards."""
    if math.isnan(amax):
        return math.nan
    floor = round_to_fp32(torch.tensor(EPS, dtype=torch.float64)).item()  # the floor applies to an fp32 amax
    scale = round_to_fp32(torch.tensor(max_finite(spec) / max(amax, floor), dtype=torch.float64)).item()
    if round_to_power_of_2 and scale > 0:
        _, exponent = math.frexp(scale)  # scale = m * 2**exponent with 0.5 <= m < 1
        scale = 2.0 ** (exponent - 1)
    return scale


def scaled_cast(spec: Float8Spec, x: Tensor, scale: Tensor) -> Tensor:
    """Codes of quantize(fp32(x * scale)), with `scale` (float64 holding fp32 values) broadcast against x."""
    return quantize(spec, round_to_fp32(x.double() * scale))


def tensorwise(spec: Float8Spec, x: Tensor, round_to_power_of_2: bool) -> tuple[Tensor, float]:
    """(codes, scale) with one scale from the amax of the whole tensor."""
    amax = x.double().abs().max().item()
    scale = scale_from_amax(spec, amax, round_to_power_of_2)
    return scaled_cast(spec, x, torch.tensor(scale, dtype=torch.float64)), scale


def rowwise(spec: Float8Spec, x: Tensor, dim: int, round_to_power_of_2: bool) -> tuple[Tensor, Tensor]:
    """(codes, scales) with one scale per slice along `dim`; scales are float64 with `dim` kept as size 1."""
    amaxes = x.double().abs().amax(dim=dim, keepdim=True)
    scales = torch.tensor([scale_from_amax(spec, amax, round_to_power_of_2) for amax in amaxes.flatten().tolist()],
                          dtype=torch.float64).view(amaxes.shape)
    return scaled_cast(spec, x, scales), scales


def dequantize(spec: Float8Spec, codes: Tensor, scale: Tensor) -> Tensor:
    """fp32(value / scale), in float64."""
    return round_to_fp32(decode_codes(spec, codes) / scale)
