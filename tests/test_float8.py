"""Float8Linear numerics, the conversion rules and report, and float8 training on the debug model."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from debug_training import DEBUG_TOML, train_losses
from reference import float8_ref
from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.config.job import Float8
from titan.quant.convert import apply_float8, format_report
from titan.quant.float8.linear import RECIPES, Float8Linear

RECIPE_NAMES = list(RECIPES)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (reference - approximation).float().norm()
    return 20 * math.log10(reference.float().norm() / noise)


def linear_pair(recipe_name: str, emulate: bool, seed: int = 0) -> tuple[nn.Linear, Float8Linear]:
    torch.manual_seed(seed)
    reference = nn.Linear(64, 48, bias=False)
    converted = Float8Linear.from_linear(nn.Linear(64, 48, bias=False), recipe_name=recipe_name, emulate=emulate)
    with torch.no_grad():
        converted.weight.copy_(reference.weight)
    return reference, converted


def run_both(recipe_name: str, emulate: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Output, grad_input and grad_weight of nn.Linear and Float8Linear on the same data."""
    reference, converted = linear_pair(recipe_name, emulate)
    torch.manual_seed(1)
    x = torch.randn(4, 8, 64)
    grad = torch.randn(4, 8, 48)
    results = {}
    outputs = []
    for module in (reference, converted):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(grad)
        outputs.append((out.detach(), xi.grad, module.weight.grad))
    for i, name in enumerate(("output", "grad_input", "grad_weight")):
        results[name] = (outputs[0][i], outputs[1][i])
    return results


@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_float8_linear_close_to_linear(recipe_name: str, emulate: bool) -> None:
    """Within float8 error: e4m3 keeps 3 mantissa bits (~25 dB per operand), e5m2 2 bits (~20 dB)."""
    results = run_both(recipe_name, emulate)
    floors = {"output": 20.0, "grad_input": 15.0, "grad_weight": 15.0}
    for name, (reference, got) in results.items():
        assert got.shape == reference.shape and got.dtype == reference.dtype
        assert sqnr_db(reference, got) > floors[name], (name, sqnr_db(reference, got))
    if recipe_name == "rowwise_with_gw_hp":
        reference, got = results["grad_weight"]
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)  # kept in high precision


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_native_matches_emulated(recipe_name: str) -> None:
    """The same quantized operands: torch._scaled_mm and the dequantize-then-matmul path agree up to
    float32 accumulation order."""
    native, emulated = run_both(recipe_name, False), run_both(recipe_name, True)
    for name in native:
        torch.testing.assert_close(native[name][1], emulated[name][1], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_output_matches_spec_reference(recipe_name: str) -> None:
    """Forward output equals quantize-dequantize per the OCP spec (tests/reference) followed by a matmul."""
    reference, converted = linear_pair(recipe_name, emulate=True)
    x = torch.randn(16, 64)

    def spec_round_trip(t: torch.Tensor) -> torch.Tensor:
        if recipe_name == "rowwise":
            codes, scale = float8_ref.rowwise(float8_ref.E4M3, t, dim=-1, round_to_power_of_2=True)
        else:
            codes, scale = float8_ref.tensorwise(float8_ref.E4M3, t, round_to_power_of_2=False)
            scale = torch.tensor(scale, dtype=torch.float64)
        return float8_ref.dequantize(float8_ref.E4M3, codes, scale).float()

    expected = spec_round_trip(x) @ spec_round_trip(reference.weight.detach()).t()
    torch.testing.assert_close(converted(x).detach(), expected, rtol=1e-5, atol=1e-5)


def test_autocast_output_dtype() -> None:
    _, converted = linear_pair("tensorwise", emulate=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = converted(torch.randn(8, 64))
    assert out.dtype == torch.bfloat16


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 4096, bias=False)
        self.odd = nn.Linear(30, 64, bias=False)
        self.small = nn.Linear(64, 64, bias=False)
        self.output = nn.Linear(64, 2256, bias=False)


def test_conversion_rules_and_report() -> None:
    model = Toy()
    decisions = {d.fqn: d for d in apply_float8(model, Float8())}
    assert isinstance(model.proj, Float8Linear) and isinstance(model.small, Float8Linear)
    assert type(model.odd) is nn.Linear and type(model.output) is nn.Linear
    assert "not divisible by 16" in decisions["odd"].result
    assert "--float8.filter_fqns 'output'" in decisions["output"].result
    report = format_report(list(decisions.values()))
    assert "2 of 4 linear layers converted" in report and "64x30" in report


def test_filters_are_user_controlled() -> None:
    model = Toy()
    decisions = {d.fqn: d for d in apply_float8(model, Float8(filter_fqns=["proj"]))}
    assert isinstance(model.output, Float8Linear)  # the default filter was replaced
    assert "'proj'" in decisions["proj"].result


def test_auto_filter_small_kdims() -> None:
    model = Toy()
    decisions = {d.fqn: d for d in apply_float8(model, Float8(auto_filter_small_kdims=True, filter_fqns=[]))}
    assert "too small" in decisions["small"].result and "too small" in decisions["proj"].result
    assert not any(d.converted for d in decisions.values())


def test_conversion_works_on_meta() -> None:
    with torch.device("meta"):
        model = Toy()
    apply_float8(model, Float8())
    assert model.proj.weight.is_meta


@pytest.mark.parametrize("args, field", [
    (["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
     "--float8.enable_fsdp_float8_all_gather only works with --float8.recipe_name tensorwise"),
    (["--float8.precompute_float8_dynamic_scale_for_fsdp"], "--float8.precompute_float8_dynamic_scale_for_fsdp needs"),
    (["--float8.enable_fsdp_float8_all_gather", "--parallelism.tensor_parallel_degree", "2"],
     "does not combine with --parallelism.tensor_parallel_degree 2"),
])
def test_float8_config_errors(args: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "float8", *args],
                        world_size=2 if "--parallelism.tensor_parallel_degree" in args else 1)


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train_losses(tmp_path_factory.mktemp("fp32"), "--training.steps", "15")


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_debug_model_trains_in_float8(tmp_path: Path, recipe_name: str, fp32_losses: list[float]) -> None:
    """Short CI version of scripts/bench_float8.py --loss-curve: 15 steps, float8 tracks fp32 closely.
    Emulated (CPU float8 matmuls are slow); native matmuls are checked equal to emulated above."""
    fp32 = fp32_losses
    float8 = train_losses(tmp_path / recipe_name, "--training.steps", "15", "--model.converters", "float8",
                          "--float8.recipe_name", recipe_name, "--float8.emulate")
    assert all(math.isfinite(loss) for loss in float8)
    assert float8[-1] < float8[0] - 0.5
    assert abs(float8[-1] - fp32[-1]) < 0.05, (float8[-1], fp32[-1])


def test_float8_compiled_trains(tmp_path: Path) -> None:
    losses = train_losses(tmp_path, "--training.steps", "3", "--model.converters", "float8", "--float8.recipe_name",
                          "rowwise", "--training.compile", "--compile.emulate_precision_casts")
    assert all(math.isfinite(loss) for loss in losses)
