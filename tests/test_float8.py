"""Float8Linear numerics against torchao's recipes and the spec reference, the conversion rules and report, and
float8 training on the debug model."""

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from titan.config.errors import ConfigError
from titan.config.job import Float8
from titan.parallel.ac import selective_policy
from titan.quant.convert import apply_float8, format_report
from titan.quant.float8.linear import RECIPES, Float8Linear, cast_operands, scaled_matmul
from titan.quant.formats import E4M3, E5M2
from titan.validate import load_job_config

from harness.debug_training import DEBUG_TOML, train, train_losses
from harness.float8_codes import assert_codes_equal
from harness.linears import sqnr_db
from reference import float8_ref as ref

RECIPE_NAMES = list(RECIPES)

# torchao's recipes, written out here from Float8LinearConfig.from_recipe_name (torchao/float8/config.py) and the
# defaults of its __post_init__, independently of titan's table: for each matmul, the (left, right) operand's
# (format, scale granularity, power-of-2 scales); None: the matmul runs in high precision. Axiswise scales run
# along the matmul's contraction dim (torchao/float8/float8_linear.py). round_scales_to_power_of_2 is one flag for
# every cast of a linear, and both rowwise recipes set it, so gw_hp's tensorwise weight scale is a power of 2 too.
# tests/test_float8_torchao.py checks Titan against torchao itself, so a misreading here cannot hide a wrong table.
E4M3_TENSORWISE, E5M2_TENSORWISE = (ref.E4M3, "tensorwise", False), (ref.E5M2, "tensorwise", False)
E4M3_TENSORWISE_POWER_OF_2, E4M3_AXISWISE_POWER_OF_2 = (ref.E4M3, "tensorwise", True), (ref.E4M3, "axiswise", True)
PUBLISHED_RECIPES = {
    "tensorwise": {"output": (E4M3_TENSORWISE, E4M3_TENSORWISE),
                   "grad_input": (E5M2_TENSORWISE, E4M3_TENSORWISE),
                   "grad_weight": (E5M2_TENSORWISE, E4M3_TENSORWISE)},
    "rowwise": {"output": (E4M3_AXISWISE_POWER_OF_2, E4M3_AXISWISE_POWER_OF_2),
                "grad_input": (E4M3_AXISWISE_POWER_OF_2, E4M3_AXISWISE_POWER_OF_2),
                "grad_weight": (E4M3_AXISWISE_POWER_OF_2, E4M3_AXISWISE_POWER_OF_2)},
    "rowwise_with_gw_hp": {"output": (E4M3_AXISWISE_POWER_OF_2, E4M3_AXISWISE_POWER_OF_2),
                           "grad_input": (E4M3_AXISWISE_POWER_OF_2, E4M3_TENSORWISE_POWER_OF_2),
                           "grad_weight": None},
}
FLOAT8_DTYPES = {ref.E4M3: E4M3, ref.E5M2: E5M2}
TOKENS, IN_FEATURES, OUT_FEATURES = 32, 64, 48


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
    """The same quantized operands: torch._scaled_mm and the dequantize-then-matmul path agree up to float32
    accumulation order, and, for a matmul with per-row scales, the native result's rounding to bf16 (CUDA's rowwise
    kernel writes only bf16, so every device does): within half a bf16 step (7 mantissa bits), 2**-8 relative."""
    native, emulated = run_both(recipe_name, False), run_both(recipe_name, True)
    for name in native:
        casts = getattr(RECIPES[recipe_name], name)
        rowwise = casts is not None and any(cast.granularity == "axiswise" for cast in casts)
        rtol = 2**-8 + 1e-5 if rowwise else 1e-5
        torch.testing.assert_close(native[name][1], emulated[name][1], rtol=rtol, atol=1e-5, msg=name)


def test_native_rowwise_output_is_bf16_on_every_device() -> None:
    """CUDA's rowwise _scaled_mm writes only bf16; Titan asks every device's kernel for bf16 there, so an fp32 run
    gets the same rounded products on a CPU (whose kernel could write fp32) as on a GPU. Tensorwise kernels write
    fp32 on both, unrounded. Checked against torch's CPU kernel asked for each dtype."""
    x, weight, _ = linear_operands()
    for recipe_name, kernel_dtype in (("rowwise", torch.bfloat16), ("tensorwise", torch.float32)):
        (a, a_scale), (b, b_scale) = cast_operands(x, weight.t(), RECIPES[recipe_name].output)
        got = scaled_matmul(a, a_scale, b, b_scale, torch.float32, emulate=False)
        want = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                                out_dtype=kernel_dtype)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0, msg=recipe_name)


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_selective_ac_saves_every_other_float8_matmul(recipe_name: str) -> None:
    """Selective "op" AC counts native float8 matmuls (torch._scaled_mm, the op on CUDA as on this CPU) as matmuls:
    it saves every other one, as for aten.mm, instead of recomputing them all; the gradients are unchanged."""
    torch.manual_seed(0)
    block = nn.Sequential(*(Float8Linear.from_linear(nn.Linear(64, 64, bias=False), recipe_name=recipe_name,
                                                     emulate=False) for _ in range(4)))
    policy, decisions = selective_policy(save_matmuls=True), []

    def recording_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = policy(ctx, op, *args, **kwargs)
        if op is torch.ops.aten._scaled_mm.default:
            decisions.append(decision)
        return decision

    x = torch.randn(32, 64, requires_grad=True)
    checkpoint(block, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(recording_policy)).sum().backward()
    assert decisions == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2
    grads = x.grad, [linear.weight.grad for linear in block]
    x.grad = None
    block.zero_grad()
    block(x).sum().backward()
    torch.testing.assert_close((x.grad, [linear.weight.grad for linear in block]), grads, rtol=0, atol=0)


def varied_magnitudes(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """Normal values times 10**i per row and 10**j per column, i and j in -3..3: each row and column has its own
    amax, so a tensorwise, per-row or per-column scale, power of 2 or not, quantizes each differently."""
    row_magnitude = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=generator)
    column_magnitude = 10.0 ** torch.randint(-3, 4, (1, cols), generator=generator)
    return torch.randn(rows, cols, generator=generator) * row_magnitude * column_magnitude


def linear_operands() -> tuple[Tensor, Tensor, Tensor]:
    """x (tokens, in), weight (out, in) and grad_output (tokens, out), fixed by a seed."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(TOKENS, IN_FEATURES), (OUT_FEATURES, IN_FEATURES), (TOKENS, OUT_FEATURES)]
    x, weight, grad = (varied_magnitudes(rows, cols, generator) for rows, cols in shapes)
    return x, weight, grad


def matmul_operands(x: Tensor, weight: Tensor, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """The (left, right) operands of each matmul of y = x @ weight^T; each contracts left's last dim, right's first."""
    return {"output": (x, weight.t()), "grad_input": (grad, weight), "grad_weight": (grad.t(), x)}


def spec_cast(operand: Tensor, cast: tuple[ref.Float8Spec, str, bool], contraction_dim: int) -> tuple[Tensor, Tensor]:
    """(codes, float64 scales) from the reference; axiswise scales have the operand's shape with the contraction
    dim set to 1."""
    spec, granularity, power_of_2 = cast
    if granularity == "tensorwise":
        codes, scale = ref.tensorwise(spec, operand, power_of_2)
        return codes, torch.tensor(scale, dtype=torch.float64)
    return ref.rowwise(spec, operand, contraction_dim, power_of_2)


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_every_operand_is_cast_as_the_published_recipe(recipe_name: str) -> None:
    """Bit-exact, operand by operand: the codes and scales each matmul multiplies are the reference's for the
    float8 format, the granularity along the contraction dim and the power-of-2 rounding of torchao's recipe.
    Weights whose columns differ in magnitude by up to 1e6 tell a tensorwise weight scale from a per-column one."""
    for matmul, operands in matmul_operands(*linear_operands()).items():
        published, casts = PUBLISHED_RECIPES[recipe_name][matmul], getattr(RECIPES[recipe_name], matmul)
        assert (casts is None) == (published is None), f"{matmul} must run in high precision only if torchao's does"
        if casts is None:
            continue
        float8_operands = cast_operands(*operands, casts)
        for side, (data, scale), operand, cast, contraction_dim in zip(
                ("left", "right"), float8_operands, operands, published, (-1, 0), strict=True):
            codes, want_scale = spec_cast(operand, cast, contraction_dim)
            assert data.dtype == FLOAT8_DTYPES[cast[0]], f"{matmul} {side} operand is {data.dtype}"
            torch.testing.assert_close(scale, want_scale.float(), rtol=0, atol=0, msg=f"{matmul} {side} scales")
            assert_codes_equal(data, codes)


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_float8_linear_multiplies_the_published_casts(recipe_name: str) -> None:
    """Output, grad_input and grad_weight of an emulated Float8Linear are the products of the reference's casts of
    their operands per torchao's recipe (of the high-precision operands where it keeps a matmul in high precision).
    Only the fp32 accumulation differs: a K-term dot product is within (K + 1) * 2**-24 * sum |a_i * b_i| of the
    exact one (K roundings of the running sum and one of the result); a wrong cast is off by float8's 2**-4."""
    x, weight, grad = linear_operands()
    linear = Float8Linear.from_linear(nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False), recipe_name=recipe_name,
                                      emulate=True)
    with torch.no_grad():
        linear.weight.copy_(weight)
    x_leaf = x.clone().requires_grad_()
    out = linear(x_leaf)
    out.backward(grad)
    got = {"output": out.detach(), "grad_input": x_leaf.grad, "grad_weight": linear.weight.grad}
    for matmul, (left, right) in matmul_operands(x, weight, grad).items():
        published = PUBLISHED_RECIPES[recipe_name][matmul]
        if published is not None:
            left, right = (ref.dequantize(cast[0], *spec_cast(operand, cast, contraction_dim))
                           for operand, cast, contraction_dim in zip((left, right), published, (-1, 0), strict=True))
        left, right = left.double(), right.double()
        error = (got[matmul].double() - left @ right).abs()
        bound = (left.shape[1] + 1) * 2.0**-24 * (left.abs() @ right.abs())
        assert (error <= bound).all(), f"{matmul}: error {(error - bound).max().item():.3g} above the bound"


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
    decisions = {d.fqn: d for d in apply_float8(model, Float8(), 1)}
    assert isinstance(model.proj, Float8Linear) and isinstance(model.small, Float8Linear)
    assert type(model.odd) is nn.Linear and type(model.output) is nn.Linear
    assert "not divisible by 16" in decisions["odd"].result
    assert "--float8.filter_fqns 'output'" in decisions["output"].result
    report = format_report(list(decisions.values()))
    assert "2 of 4 linear layers converted" in report and "64x30" in report


def test_filters_are_user_controlled() -> None:
    model = Toy()
    decisions = {d.fqn: d for d in apply_float8(model, Float8(filter_fqns=["proj"]), 1)}
    assert isinstance(model.output, Float8Linear)  # the default filter was replaced
    assert "'proj'" in decisions["proj"].result


def test_auto_filter_small_kdims() -> None:
    model = Toy()
    decisions = {d.fqn: d for d in apply_float8(model, Float8(auto_filter_small_kdims=True, filter_fqns=[]), 1)}
    assert "too small" in decisions["small"].result and "too small" in decisions["proj"].result
    assert not any(d.converted for d in decisions.values())


def test_conversion_works_on_meta() -> None:
    with torch.device("meta"):
        model = Toy()
    apply_float8(model, Float8(), 1)
    assert model.proj.weight.is_meta


def test_selective_ac_counts_grouped_matmuls_with_the_others() -> None:
    """A mixture of experts' grouped matmul (torch._grouped_mm on CUDA) takes its turn in the same alternation as
    plain and float8 matmuls."""
    policy, ctx = selective_policy(save_matmuls=True), SelectiveCheckpointContext(is_recompute=False)
    ops = [torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default, torch.ops.aten._scaled_mm.default,
           torch.ops.aten._grouped_mm.default]
    assert [policy(ctx, op) for op in ops] == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2


@pytest.mark.parametrize("args, world_size, field", [
    (["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"], 1,
     "--float8.enable_fsdp_float8_all_gather only works with --float8.recipe_name tensorwise"),
    (["--float8.precompute_float8_dynamic_scale_for_fsdp"], 1,
     "--float8.precompute_float8_dynamic_scale_for_fsdp needs"),
    (["--float8.enable_fsdp_float8_all_gather", "--parallelism.tensor_parallel_degree", "2"], 2,
     "does not combine with --parallelism.tensor_parallel_degree 2"),
    # FSDP pins offloaded shards on CUDA, a copy that drops the all-gather's weight wrapper (torch 2.13's
    # FSDPParam.reset_sharded_param), so the all-gather would silently run in high precision.
    (["--float8.enable_fsdp_float8_all_gather", "--training.enable_cpu_offload"], 2,
     "--float8.enable_fsdp_float8_all_gather does not combine with --training.enable_cpu_offload"),
])
def test_float8_config_errors(args: list[str], world_size: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "float8", *args], world_size)


# Every linear of the debug model's 6 blocks; the output projection is the 43rd, kept by the default filter.
DEBUG_MODEL_BLOCK_LINEAR_FQNS = {f"layers.{i}.{name}" for i in range(6) for name in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
    "feed_forward.w3")}


def float8_rows_of_report(records: list[logging.LogRecord]) -> tuple[set[str], str]:
    """(FQNs of the layers the logged conversion report says went to float8, its closing count line)."""
    report = next(r.getMessage() for r in records if r.getMessage().startswith("Model conversion report"))
    lines = report.splitlines()
    rows = lines[2:-1]  # between the title and column header lines and the count
    return {row.split()[0] for row in rows if row.split()[2] == "float8"}, lines[-1]


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_debug_model_converts_and_trains_in_float8(tmp_path: Path, recipe_name: str, fp32_debug_losses: list[float],
                                                   titan_records: list[logging.LogRecord]) -> None:
    """The trainer swaps every block linear for a Float8Linear of the recipe, as its conversion report says, and
    float8 tracks fp32 closely: a short CI version of scripts/bench_float8.py --loss-curve, 15 steps. Emulated (CPU
    float8 matmuls are slow); native matmuls are checked equal to emulated above."""
    trainer, float8 = train(tmp_path / recipe_name, "--training.steps", "15", "--model.converters", "float8",
                            "--float8.recipe_name", recipe_name, "--float8.emulate")
    converted = {fqn: module for fqn, module in trainer.training.model.named_modules()
                 if isinstance(module, Float8Linear)}
    assert converted.keys() == DEBUG_MODEL_BLOCK_LINEAR_FQNS
    assert all(module.recipe is RECIPES[recipe_name] and module.emulate for module in converted.values())
    reported, count = float8_rows_of_report(titan_records)
    assert reported == converted.keys() and count.startswith("42 of 43 linear layers converted: 88.9% of")
    fp32 = fp32_debug_losses
    assert all(math.isfinite(loss) for loss in float8)
    assert float8 != fp32  # the float8 matmuls ran
    assert float8[-1] < float8[0] - 0.5
    assert abs(float8[-1] - fp32[-1]) < 0.05, (float8[-1], fp32[-1])


def test_float8_compiled_trains(tmp_path: Path) -> None:
    losses = train_losses(tmp_path, "--training.steps", "3", "--model.converters", "float8", "--float8.recipe_name",
                          "rowwise", "--training.compile", "--compile.emulate_precision_casts")
    assert all(math.isfinite(loss) for loss in losses)
