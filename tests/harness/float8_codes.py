"""Assertions and test values on float8 codes, shared by the float8 and MX numerics tests."""

import math

import torch
from torch import Tensor

from reference import float8_ref as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def assert_codes_equal(data: Tensor, codes: Tensor) -> None:
    """Bit-exact, except that any two nans match: IEEE 754 leaves a nan's sign unspecified, and x86 and CUDA
    give 0 * inf different signs."""
    assert data.shape == codes.shape
    spec = {E4M3: ref.E4M3, E5M2: ref.E5M2}[data.dtype]
    got, want = data.view(torch.uint8), codes.view(torch.uint8)
    got_nan, want_nan = ref.decode_codes(spec, got).isnan(), ref.decode_codes(spec, want).isnan()
    assert torch.equal(got_nan, want_nan), (f"{int(got_nan.sum())} nans, expected {int(want_nan.sum())}; first "
                                            f"difference at {(got_nan != want_nan).nonzero()[0].tolist()}")
    mismatch = (got != want) & ~got_nan
    assert not mismatch.any(), (f"{int(mismatch.sum())} codes differ, first at {mismatch.nonzero()[0].tolist()}: "
                                f"got {got[mismatch][0]:#04x}, want {want[mismatch][0]:#04x}")


def spec_test_values(spec: ref.Float8Spec) -> Tensor:
    """Every finite value of the format with both signs, the midpoints between neighbours (ties), one fp32 ulp
    either side of each midpoint, values beyond max (saturation) and nan; all exactly representable in fp32."""
    grid = torch.tensor([ref.decode(spec, code) for code in ref.positive_finite_codes(spec)], dtype=torch.float32)
    midpoints = (grid[:-1] + grid[1:]) / 2  # exact: one more mantissa bit than the format
    max_value = grid[-1]
    beyond = torch.tensor([max_value * 1.001, max_value * 2, 1e30, 3e38, math.inf, math.nan])
    positive = torch.cat([grid, midpoints, torch.nextafter(midpoints, torch.zeros(())),
                          torch.nextafter(midpoints, torch.tensor(math.inf)), beyond])
    return torch.cat([positive, -positive])
