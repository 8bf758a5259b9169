"""Float8Linear against torchao itself, since docs/float8.md says Titan's recipes are torchao's: every operand's cast
against torchao's cast function driven by the CastConfigs and power-of-2 flag of Float8LinearConfig.from_recipe_name,
and output, grad_input and grad_weight against torchao's own Float8Linear, emulated and with torch._scaled_mm, on CPU.
A recipe read wrongly from torchao fails here, where a reference written from the same reading would not.
tests/test_float8.py and tests/test_float8_casts.py check the same casts against the OCP spec reference.

Needs torchao (the `test` extra), so it is not in the torch 2.11 subset of .ci/run. torchao prints "Failed to load
..._C_mxfp8..." on import on CPU: those are its CUDA extensions, which nothing here uses.
"""

import dataclasses
import math
from typing import NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torchao.float8.config import Float8LinearConfig, ScalingType
from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.float8_utils import amax_to_scale as torchao_amax_to_scale

from titan.quant.float8.casts import amax_to_scale
from titan.quant.float8.linear import RECIPES, Float8Linear, cast_operands
from titan.quant.formats import E4M3, E5M2

from harness.linears import run_linear

RECIPE_NAMES = list(RECIPES)
INPUT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOKENS, IN_FEATURES, OUT_FEATURES = 32, 64, 48


def with_outlier_columns(rows: int, cols: int, outlier_columns: dict[int, float],
                         generator: torch.Generator) -> Tensor:
    """Normal values, with the given columns multiplied by 100 to 1000 (outlier features, as LLM activations have).
    Column amaxes then differ by up to 1000x, so a per-column scale, a per-row scale (each row's amax is its own
    outlier draw) and a tensorwise one quantize differently, and rounding any of them to a power of 2 changes it."""
    x = torch.randn(rows, cols, generator=generator)
    for column, factor in outlier_columns.items():
        x[:, column] *= factor
    return x


def linear_operands(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """x (tokens, in), weight (out, in) and grad_output (tokens, out), fixed by a seed. No scale of this seed lies
    on the power-of-2 edge where torchao and Titan differ on purpose
    (test_scales_differ_from_torchao_only_at_the_power_of_2_edge); one that did would fail the bit-exact checks."""
    generator = torch.Generator().manual_seed(0)
    x = with_outlier_columns(TOKENS, IN_FEATURES, {3: 100.0, 17: 1000.0}, generator)
    weight = with_outlier_columns(OUT_FEATURES, IN_FEATURES, {5: 300.0, 40: 1000.0}, generator)
    grad = with_outlier_columns(TOKENS, OUT_FEATURES, {7: 100.0, 30: 500.0}, generator)
    return x.to(dtype), weight.to(dtype), grad.to(dtype)


def titan_operands(x: Tensor, weight: Tensor, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """The (left, right) operands of each of Titan's matmuls; each contracts left's last dim and right's first."""
    return {"output": (x, weight.t()), "grad_input": (grad, weight), "grad_weight": (grad.t(), x)}


class TorchaoCast(NamedTuple):
    """One cast that torchao's matmul_with_hp_or_float8_args (torchao/float8/float8_linear.py) makes."""

    config_field: str
    """The Float8LinearConfig field holding its CastConfig."""
    tensor: Tensor
    """The high-precision tensor torchao casts."""
    axiswise_dim: int
    """The dim torchao passes to get_maybe_axiswise_dim."""
    transposed: bool
    """Whether torchao's matmul multiplies the transpose of the cast."""


def torchao_casts(x: Tensor, weight: Tensor, grad: Tensor) -> dict[str, tuple[TorchaoCast, TorchaoCast]]:
    """The (left, right) casts of each matmul, as torchao's Float8Linear makes them: its forward receives
    weight.t() (in, out), and its backward casts grad_output and that weight_t, then transposes them where the
    matmul needs it."""
    weight_t = weight.t()  # (in, out)
    return {"output": (TorchaoCast("cast_config_input", x, -1, False),
                       TorchaoCast("cast_config_weight", weight_t, 0, False)),
            "grad_input": (TorchaoCast("cast_config_grad_output", grad, -1, False),
                           TorchaoCast("cast_config_weight_for_grad_input", weight_t, -1, True)),
            "grad_weight": (TorchaoCast("cast_config_grad_output_for_grad_weight", grad, 0, True),
                            TorchaoCast("cast_config_input_for_grad_weight", x, 0, False))}


def torchao_cast(cast: TorchaoCast, config: Float8LinearConfig) -> tuple[Tensor, Tensor] | None:
    """(float8 data, scale) of one operand from torchao's hp_tensor_to_float8_dynamic, called as its Float8Linear
    calls it; None where the recipe keeps the operand in high precision."""
    cast_config = getattr(config, cast.config_field)
    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    float8 = hp_tensor_to_float8_dynamic(
        cast.tensor, cast_config.target_dtype, LinearMMConfig(),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(cast.axiswise_dim, cast_config.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    if cast.transposed:
        return float8._data.t(), float8._scale.t()
    return float8._data, float8._scale


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_every_operand_is_cast_as_torchao_casts_it(recipe_name: str, dtype: torch.dtype) -> None:
    """Bit-exact, operand by operand: the float8 bytes, the scales and their shapes that each Titan matmul multiplies
    are those of torchao's cast function given the recipe's own CastConfig, and the same matmuls stay in high
    precision. Both compute the amax in the input dtype (exact), the scale as one division rounded to fp32
    (torchao divides in float64, which rounds to the same fp32), and the cast as a saturating fp32 x * scale."""
    config = Float8LinearConfig.from_recipe_name(recipe_name)
    x, weight, grad = linear_operands(dtype)
    recipe = RECIPES[recipe_name]
    for matmul, operands in titan_operands(x, weight, grad).items():
        want = [torchao_cast(cast, config) for cast in torchao_casts(x, weight, grad)[matmul]]
        casts = getattr(recipe, matmul)
        high_precision = all(operand is None for operand in want)
        assert (casts is None) == high_precision, f"{matmul} must run in high precision only if torchao's does"
        if casts is None:
            continue
        for side, (data, scale), (want_data, want_scale) in zip(("left", "right"), cast_operands(*operands, casts),
                                                                 want, strict=True):
            label = f"{recipe_name} {matmul} {side} operand"
            assert data.dtype == want_data.dtype, f"{label}: {data.dtype}, torchao {want_data.dtype}"
            assert data.shape == want_data.shape and scale.shape == want_scale.shape, (
                f"{label}: data {tuple(data.shape)} scale {tuple(scale.shape)}, torchao data "
                f"{tuple(want_data.shape)} scale {tuple(want_scale.shape)}")
            torch.testing.assert_close(scale, want_scale, rtol=0, atol=0, msg=lambda m: f"{label} scales: {m}")
            torch.testing.assert_close(data.view(torch.uint8), want_data.view(torch.uint8), rtol=0, atol=0,
                                       msg=lambda m: f"{label} float8 bytes: {m}")


def linear_with_weight(weight: Tensor) -> nn.Linear:
    linear = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "native"])
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_matmuls_match_torchao_float8_linear(recipe_name: str, emulate: bool, dtype: torch.dtype) -> None:
    """Output, grad_input and grad_weight of Titan's Float8Linear are bit for bit those of torchao's Float8Linear
    built from the same recipe, with emulate (dequantize, then one fp32 matmul, in both) and with torch._scaled_mm,
    which torch 2.13 runs on CPU for tensorwise and rowwise scales and torchao calls there unchanged. Native fp32
    matmuls with per-row scales go through bf16 in both, on every device, since CUDA's rowwise kernel writes no fp32
    (addmm_float8_unwrapped in torchao/float8/float8_ops.py)."""
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe_name), emulate=emulate)
    x, weight, grad = linear_operands(dtype)
    want = run_linear(TorchaoFloat8Linear.from_float(linear_with_weight(weight), config), x, grad)
    got = run_linear(Float8Linear.from_linear(linear_with_weight(weight), recipe_name=recipe_name, emulate=emulate),
                     x, grad)
    for matmul, result in got.items():
        assert result.dtype == want[matmul].dtype == dtype, f"{matmul}: {result.dtype}, torchao {want[matmul].dtype}"
        torch.testing.assert_close(result, want[matmul], rtol=0, atol=0, msg=lambda m: f"{matmul}: {m}")


@pytest.mark.parametrize("float8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scales_differ_from_torchao_only_at_the_power_of_2_edge(float8_dtype: torch.dtype) -> None:
    """docs/float8.md's deliberate difference, pinned against torchao's amax_to_scale on the amaxes around every
    power-of-2 scale: torchao rounds with fp32 exp2(floor(log2(scale))), and fp32 log2 of a scale just below 2**k
    rounds up to k, so torchao returns 2**k, above the scale (its amax element then saturates), where Titan returns
    2**(k - 1). Every other scale is equal, unrounded ones everywhere, including a zero amax and amaxes below the
    1e-12 floor (which torchao applies in float64 and Titan in fp32, to the same fp32 scale for both formats) and
    non-finite ones."""
    exact = (torch.finfo(float8_dtype).max / 2.0 ** torch.arange(-30, 40, dtype=torch.float64)).float()
    amax = torch.cat([exact, torch.nextafter(exact, torch.zeros(())), torch.nextafter(exact, torch.tensor(math.inf)),
                      torch.tensor([0.0, 1e-13, 9.99e-13, 1e-12, 1.01e-12, math.inf, math.nan])])
    unrounded = amax_to_scale(amax, float8_dtype, round_to_power_of_2=False)
    torch.testing.assert_close(unrounded, torchao_amax_to_scale(amax, float8_dtype), rtol=0, atol=0, equal_nan=True)
    rounded = amax_to_scale(amax, float8_dtype, round_to_power_of_2=True)
    torchao_rounded = torchao_amax_to_scale(amax, float8_dtype, round_scales_to_power_of_2=True)
    differ = (rounded != torchao_rounded) & ~rounded.isnan()
    assert differ.any(), "the amaxes no longer reach the edge this test is about"
    assert (torchao_rounded[differ] > unrounded[differ]).all() and torch.equal(torchao_rounded[differ],
                                                                                2 * rounded[differ])
    torch.testing.assert_close(rounded[~differ], torchao_rounded[~differ], rtol=0, atol=0, equal_nan=True)
