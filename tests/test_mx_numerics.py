"""MX quantize/dequantize: bit-exact against tests/reference/mx_ref.py (written from the OCP MX spec) over every
element value and every scale exponent, special blocks, random blocks, torch.compile, and the Triton kernel
against the torch path."""

import itertools
import math

import pytest
import torch
from torch import Tensor

from titan.quant.mx import dequantize, quantize
from titan.quant.mx.numerics import torch_quantize

from harness.float8_codes import assert_codes_equal, spec_test_values
from harness.triton_interpreter import run_interpreted
from reference import float8_ref, mx_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [pytest.param(E4M3, float8_ref.E4M3, id="e4m3"), pytest.param(E5M2, float8_ref.E5M2, id="e5m2")]
SPECS = {E4M3: float8_ref.E4M3, E5M2: float8_ref.E5M2}


def assert_matches_reference(x: Tensor, elem_dtype: torch.dtype, dim: int = -1) -> None:
    """quantize(x) has the reference's scale codes and element codes, and dequantize the reference's values."""
    spec = SPECS[elem_dtype]
    scales, data = quantize(x, elem_dtype=elem_dtype, dim=dim)
    want_codes, want_elements = mx_ref.quantize(spec, x.movedim(dim, -1))
    assert scales.dtype == torch.float8_e8m0fnu and data.dtype == elem_dtype
    assert torch.equal(scales.view(torch.uint8).movedim(dim, -1), want_codes)
    assert_codes_equal(data.movedim(dim, -1).contiguous(), want_elements)
    want_values = mx_ref.dequantize(spec, want_codes, want_elements).float().movedim(-1, dim)
    torch.testing.assert_close(dequantize(scales, data, dim=dim), want_values, rtol=0, atol=0, equal_nan=True)


def every_value_at_every_scale(spec: float8_ref.Float8Spec) -> tuple[Tensor, Tensor, Tensor]:
    """(x, element codes, scale exponents): every finite element value, both signs, times 2**s for every shared
    exponent s that fp32 inputs reach (-127 up to 127 - emax_elem). Each block starts with max * 2**s, so the spec's
    shared exponent is exactly s and every other element must come back as the code it was built from."""
    codes = [c for c in range(256) if math.isfinite(float8_ref.decode(spec, c))]
    values = torch.tensor([float8_ref.decode(spec, c) for c in codes], dtype=torch.float64)
    per_block = 31
    num_blocks = -(-len(codes) // per_block)
    padded = torch.cat([torch.tensor(codes), torch.zeros(num_blocks * per_block - len(codes), dtype=torch.long)])
    padded_values = torch.cat([values, torch.zeros(num_blocks * per_block - len(codes), dtype=torch.float64)])
    max_code = float8_ref.positive_finite_codes(spec)[-1]
    block_codes = torch.cat([torch.full((num_blocks, 1), max_code), padded.view(num_blocks, per_block)], dim=1)
    block_values = torch.cat([torch.full((num_blocks, 1), float8_ref.max_finite(spec), dtype=torch.float64),
                              padded_values.view(num_blocks, per_block)], dim=1)
    exponents = torch.arange(-127, 128 - mx_ref.emax_elem(spec))
    x = block_values[None] * torch.exp2(exponents.double())[:, None, None]  # (exponents, blocks, 32), exact
    return x.float().reshape(len(exponents) * num_blocks, 32), block_codes.repeat(len(exponents), 1), exponents


@pytest.mark.parametrize("elem_dtype,spec", FORMATS)
def test_every_element_value_at_every_scale_exponent(elem_dtype: torch.dtype, spec: float8_ref.Float8Spec) -> None:
    x, element_codes, exponents = every_value_at_every_scale(spec)
    assert (x.double().abs() > 0).sum() > 0 and x.isfinite().all()  # no fp32 overflow at the top exponent
    scales, data = quantize(x, elem_dtype=elem_dtype)
    blocks_per_exponent = x.shape[0] // len(exponents)
    want_scale_codes = (exponents + mx_ref.E8M0_BIAS).to(torch.uint8).repeat_interleave(blocks_per_exponent)
    assert torch.equal(scales.view(torch.uint8).squeeze(-1), want_scale_codes)
    assert torch.equal(data.view(torch.uint8), element_codes.to(torch.uint8))
    assert torch.equal(dequantize(scales, data), x)  # exact round trip, fp32 subnormals at 2**-127 included
    assert_matches_reference(x, elem_dtype)


@pytest.mark.parametrize("elem_dtype,spec", FORMATS)
def test_ties_and_saturation_match_reference(elem_dtype: torch.dtype, spec: float8_ref.Float8Spec) -> None:
    """Every value, midpoint (tie) and neighbour of a midpoint of the element grid, and values past max, each in a
    block whose amax pins the scale to 2**s (so they reach the element rounding unchanged), for several s."""
    values = spec_test_values(spec)
    values = values[values.isfinite()]
    per_block = 31
    pad = -len(values) % per_block
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per_block)
    pinned = torch.full((values.shape[0], 1), float8_ref.max_finite(spec) * 1.5)  # floor(log2) = emax_elem
    blocks = torch.cat([pinned, values], dim=1)
    for exponent in (-100, -3, 0, 5, 90):
        assert_matches_reference(blocks * 2.0**exponent, elem_dtype)


def test_special_blocks() -> None:
    """Zero block: smallest scale, zero elements. NaN or inf anywhere: NaN scale, whole block NaN. Amax below the
    E8M0 range: scale clamped to 2**-127, elements still exact. Amax in (448, 512) * 2**s: saturates to 448."""
    zero, nan, inf, tiny, saturated = (torch.zeros(32) for _ in range(5))
    nan[7] = math.nan
    inf[0], inf[1] = -math.inf, 3.0
    tiny[:4] = torch.tensor([2.0**-130, -(2.0**-131), 2.0**-140, 2.0**-149])  # fp32 subnormals
    saturated[0], saturated[1] = 500.0, 1.0
    x = torch.stack([zero, nan, inf, tiny, saturated])
    scales, data = quantize(x)
    assert scales.view(torch.uint8).squeeze(-1).tolist() == [0, 255, 255, 0, 127]
    values = dequantize(scales, data)
    assert values[0].eq(0).all() and values[1:3].isnan().all()
    # 2**-130 and 2**-131 are 2**-3 and 2**-4 times X = 2**-127; 2**-13 and 2**-22 times X are below E4M3's subnormals
    assert values[3, :2].tolist() == tiny[:2].tolist() and values[3, 2:].eq(0).all()
    assert values[4, 0] == 448.0 and values[4, 1] == 1.0
    assert_matches_reference(x, E4M3)


def test_tiny_elements_round_like_the_reference() -> None:
    """Elements far below the block's amax underflow to E4M3 subnormals or zero, with ties to even."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=generator) * 10.0 ** torch.randint(-12, 0, (64, 32), generator=generator)
    x[:, 0] = 1.0
    assert_matches_reference(x, E4M3)
    assert_matches_reference(x, E5M2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("elem_dtype,spec", FORMATS)
def test_random_blocks_match_reference(elem_dtype: torch.dtype, spec: float8_ref.Float8Spec, dim: int,
                                       dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    magnitude = 10.0 ** torch.randint(-20, 20, (64, 1), generator=generator)
    x = (torch.randn(64, 96, generator=generator) * magnitude).to(dtype)
    assert_matches_reference(x, elem_dtype, dim)


def test_public_api_shapes_and_errors() -> None:
    x = torch.randn(3, 4, 64)
    scales, data = quantize(x)
    assert scales.shape == (3, 4, 2) and data.shape == x.shape and data.dtype == E4M3
    assert dequantize(scales, data, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    codes_scales, _ = quantize(x, block_size=16, elem_dtype=E5M2)
    assert codes_scales.shape == (3, 4, 4)
    # uint8 raw exponents are accepted as scales too
    torch.testing.assert_close(dequantize(scales.view(torch.uint8), data), dequantize(scales, data))
    with pytest.raises(ValueError, match="multiple of block_size 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize(x, elem_dtype=torch.bfloat16)


def test_error_is_at_most_half_an_element_ulp() -> None:
    """The floor scale X puts each block's amax in [256, 512) * X. Elements up to E4M3's max, 448 * X, round to
    nearest: each is within half an E4M3 ulp of its own binade, 2**(e - 4) * X for |x| in [2**e, 2**(e + 1)) * X
    (e >= -6; below that, half the subnormal step, 2**-10 * X), the tightest bound round-to-nearest allows (ties
    reach it). Elements above 448 * X saturate to exactly +-448 * X, so the error of a block's top element can reach
    1 - 448/512 = 12.5% of it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=generator)
    scales, data = quantize(x)
    block_scale = torch.exp2(scales.view(torch.uint8).double() - 127).repeat_interleave(32, dim=-1)  # X per element
    scaled = x.double() / block_scale  # exact: X is a power of two
    got = dequantize(scales, data).double() / block_scale
    block_amax = scaled.abs().view(256, 8, 32).amax(-1)
    assert ((block_amax >= 256) & (block_amax < 512)).all()
    saturated = scaled.abs() > 448
    assert saturated.any()  # randn blocks often have an amax in (448, 512) * X
    assert torch.equal(got[saturated], 448 * scaled[saturated].sign())
    _, exponent = torch.frexp(scaled)  # |scaled| in [2**(exponent - 1), 2**exponent)
    half_ulp = torch.exp2((exponent - 1).clamp(min=-6) - 4.0)
    assert ((got - scaled).abs() <= half_ulp)[~saturated].all()


def test_compiled_quantize_matches_eager() -> None:
    def quantize_both_ways(x: Tensor) -> list[Tensor]:
        return [*torch_quantize(x, 32, E4M3, -1), *torch_quantize(x, 32, E5M2, 0)]

    x = torch.randn(64, 96, dtype=torch.bfloat16) * 1e3
    x[3, 5], x[40, 2] = math.inf, math.nan
    torch._dynamo.reset()
    compiled = torch.compile(quantize_both_ways, fullgraph=True)(x)
    for got, want in zip(compiled, quantize_both_ways(x), strict=True):
        if got.dtype == torch.uint8:
            assert torch.equal(got, want)
        else:
            assert_codes_equal(got, want)


def triton_cases() -> list[tuple[str, Tensor, torch.dtype, int]]:
    """(name, x, element dtype, dim): both element types and input dtypes, both dims, shapes around the kernel's
    tiles, 3-D, strided views, special values and the exhaustive value table."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for elem_dtype in (E4M3, E5M2):
        for dtype in (torch.float32, torch.bfloat16):
            for dim in (-1, 0):
                exponents = torch.randint(-8, 8, (96, 1), generator=generator)
                x = torch.randn(96, 160, generator=generator) * 10.0 ** exponents
                cases.append((f"96x160 {dtype}", x.to(dtype), elem_dtype, dim))
        x, _, _ = every_value_at_every_scale(SPECS[elem_dtype])
        cases.append(("every value at every scale", x, elem_dtype, -1))
        cases.append(("every value at every scale, columns", x[:4096].t().contiguous(), elem_dtype, 0))
    cases.append(("3-D rows", torch.randn(3, 5, 64, generator=generator), E4M3, -1))
    cases.append(("3-D columns", torch.randn(64, 3, 7, generator=generator), E4M3, 0))
    cases.append(("1 row", torch.randn(1, 32, generator=generator), E4M3, -1))
    cases.append(("transposed", torch.randn(40, 96, generator=generator).t(), E4M3, 0))
    cases.append(("sliced", torch.randn(64, 200, generator=generator)[:, :96], E5M2, -1))
    special = torch.randn(64, 64, generator=generator)
    special[0] = 0
    special[1, 3], special[2, 40], special[3, 0] = math.nan, math.inf, -math.inf
    special[4, :32] = 2.0**-140
    # rceil's edges: amaxes of 448 times a power of two, an ulp either side of one, and tiny ones whose amax / 448 is
    # an fp32 subnormal above and below 2**-127.
    special[5:8] = 0
    power = 448.0 * 2.0**-20
    special[5, 0], special[5, 32], special[6, 0] = power, power * (1 + 2.0**-23), power * (1 - 2.0**-24)
    special[6, 32], special[7, 0], special[7, 32] = 448.0 * 2.0**-126.5, 448.0 * 2.0**-127.5, 448.0 * 2.0**-126
    for dim in (-1, 0):
        cases.append(("special values", special, E4M3, dim))
    return cases


def check_triton_matches_torch(device: str) -> None:
    """Raise an AssertionError naming every case where the Triton kernel differs from the torch path."""
    from titan.quant.kernels.mx_quantize import triton_quantize

    failures = []
    for (name, x, elem_dtype, dim), rounding in itertools.product(triton_cases(), ("floor", "rceil")):
        codes, data = triton_quantize(x.to(device), 32, elem_dtype, dim, rounding)
        want_codes, want_data = torch_quantize(x, 32, elem_dtype, dim, rounding)
        try:
            assert torch.equal(codes.cpu(), want_codes), "scale codes differ"
            assert_codes_equal(data.cpu(), want_data.view(torch.uint8))
        except AssertionError as error:
            failures.append(f"{name} {x.dtype}->{elem_dtype} dim={dim} {rounding}: {error}")
    assert not failures, "\n".join(failures)


def test_triton_quantize_matches_torch_path_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted("test_mx_numerics", "check_triton_matches_torch('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the interpreted test covers the kernel")
def test_triton_quantize_matches_torch_path_cuda() -> None:
    check_triton_matches_torch("cuda")
