"""The experts' low-precision grouped matmuls against torchao itself (the `test` extra): MXFP8 against torchao's
`_to_mxfp8_then_scaled_grouped_mm` in its emulated mode, bit for bit; float8 rowwise casts against the torch
references of torchao's grouped float8 quantization (torchao/prototype/moe_training/utils.py) and torchao.float8's
scaling functions, bit for bit, and the emulated matmuls within the summation-order bound; tensorwise, which torchao
has no grouped form of, within the bound of E4M3's rounding. Token groups of 0 and 1 tokens and sizes that are not
multiples of the kernels' alignment are in every case.

The conversion itself (which experts convert, the report) and the validation rules are checked below too; layouts
(EP, expert FSDP) against one process are in tests/test_parallel.py.
"""

import pytest
import torch
from torch import Tensor
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
from torchao.prototype.moe_training.utils import (
    torch_to_3d_rowwise_float8_transpose_rhs,
    torch_to_float8_per_group_colwise,
)
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common import KernelPreference

from titan.config.errors import ConfigError
from titan.config.job import MX, NVFP4, Float8
from titan.hardware import SIMULATED_GPUS, Accelerator
from titan.models.common.moe import READ_COUNTS, HighPrecisionMatmuls, MoE, MoEArgs, moe_layers
from titan.models.families import FAMILIES
from titan.quant.convert import apply_converters, apply_float8, format_report
from titan.quant.float8.casts import dequantize
from titan.quant.float8.grouped import (
    EXPERT_RECIPES,
    FLOAT8_GROUP_ALIGNMENT,
    Float8ExpertMatmuls,
    Float8GroupedMatmul,
    cast_expert_columns,
    cast_tokens,
    cast_weights,
)
from titan.quant.formats import E4M3
from titan.quant.grouped import pad_groups
from titan.quant.mx.grouped import MX_GROUP_ALIGNMENT, MXExpertMatmuls
from titan.validate import find_problems, load_job_config, validate

from harness.debug_training import DEBUG_TOML

# Groups of 0 and 1 tokens, and sizes that are multiples of neither 16 nor 32.
COUNTS = [0, 1, 45, 70]
NUM_EXPERTS, DIM, HIDDEN = len(COUNTS), 64, 96
INPUT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def expert_operands(dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tokens x (tokens, dim) sorted by expert, counts (experts,), stacked weights (experts, hidden, dim) and a
    grad_output (tokens, hidden); a few outlier columns, so per-row, per-column and per-tensor scales differ."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), DIM, generator=generator)
    x[:, 3] *= 100
    weight = torch.randn(NUM_EXPERTS, HIDDEN, DIM, generator=generator) * 0.1
    weight[1, 7] *= 50
    grad = torch.randn(sum(COUNTS), HIDDEN, generator=generator)
    grad[:, 11] *= 300
    return x.to(dtype), counts, weight.to(dtype), grad.to(dtype)


def titan_grouped_mm(matmuls: Float8ExpertMatmuls | MXExpertMatmuls, x: Tensor, counts: Tensor, weight: Tensor,
                     grad: Tensor, alignment: int) -> tuple[Tensor, Tensor, Tensor]:
    """One of the experts' grouped matmuls as the experts run it (padded blocks): output, grad_input, grad_weight."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    groups = pad_groups(counts, x.size(0), alignment)
    out = groups.unpad(matmuls.grouped_mm(groups.pad(x), weight, groups, READ_COUNTS))
    out.backward(grad)
    return out, x.grad, weight.grad


@pytest.mark.parametrize("recipe_name, mode", [("mxfp8", ScaleCalculationMode.FLOOR),
                                               ("mxfp8_rceil", ScaleCalculationMode.RCEIL)], ids=["floor", "rceil"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_mxfp8_experts_equal_torchao_bit_for_bit(dtype: torch.dtype, recipe_name: str,
                                                 mode: ScaleCalculationMode) -> None:
    """torchao's emulated MXFP8 grouped matmul with its own group padding, in the recipe's scale rounding: the output
    and both gradients are the same bits. torchao returns bf16 (its out_dtype, what the kernels write); so do
    Titan's experts, cast to the input's dtype after the matmul, and so the output gradient reaches both as bf16."""
    x, counts, weight, grad = expert_operands(dtype)
    got = titan_grouped_mm(MXExpertMatmuls(True, recipe_name), x, counts, weight, grad, MX_GROUP_ALIGNMENT)
    x_ref, weight_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out_ref = _to_mxfp8_then_scaled_grouped_mm(
        x_ref, weight_ref.transpose(-2, -1), counts.cumsum(0).to(torch.int32), out_dtype=torch.bfloat16,
        kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=mode,
        pad_token_groups_for_grouped_mm=True)
    out_ref.to(dtype).backward(grad)
    for name, value, expected in zip(("output", "grad_input", "grad_weight"), got,
                                     (out_ref.to(dtype), x_ref.grad, weight_ref.grad)):
        assert torch.equal(value, expected), name


def torchao_rowwise(x: Tensor, axiswise_dim: int) -> tuple[Tensor, Tensor]:
    """torchao.float8's axiswise power-of-2 E4M3 cast (what its grouped kernels fuse): (data, scale)."""
    scale = tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=axiswise_dim,
                            round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.float() * scale, E4M3), scale


def bytes_equal(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_float8_rowwise_expert_casts_equal_torchao(dtype: torch.dtype) -> None:
    """Every operand of the three matmuls, cast as the experts' rowwise recipe casts it, against torchao's
    quantization for its float8 rowwise grouped recipe (fp8_grouped_mm.py): the tokens per row, the weights per
    expert and row along K (forward) and along N (grad_input: torch_to_3d_rowwise_float8_transpose_rhs), and both
    operands of grad_weight per column of each expert's tokens (torch_to_float8_per_group_colwise)."""
    x, counts, weight, grad = expert_operands(dtype)
    recipe = EXPERT_RECIPES["rowwise"]
    for data, scale, (expected_data, expected_scale) in [
            (*cast_tokens(x, recipe.output[0]), torchao_rowwise(x, -1)),
            (*cast_tokens(grad, recipe.grad_input[0]), torchao_rowwise(grad, -1)),
            (*cast_weights(weight, recipe.output[1], -1), torchao_rowwise(weight, -1))]:
        assert bytes_equal(data, expected_data) and torch.equal(scale, expected_scale)
    # grad_input's weight: torchao casts W^T (E, K, N) per (expert, k) along N and returns (E, N, K) column-major.
    data, scale = cast_weights(weight, recipe.grad_input[1], -2)
    expected_data, expected_scale = torch_to_3d_rowwise_float8_transpose_rhs(weight.transpose(-2, -1), E4M3,
                                                                             round_scales_to_power_of_2=True)
    assert bytes_equal(data, expected_data.contiguous()) and torch.equal(scale, expected_scale)
    # grad_weight: torchao's reference reads every group (it has no empty ones), so the padded layout drops expert 0.
    groups = pad_groups(counts, x.size(0), FLOAT8_GROUP_ALIGNMENT)
    used = groups.expert_of_row < NUM_EXPERTS
    for tokens in (groups.pad(x), groups.pad(grad)):
        data, scale = cast_expert_columns(tokens, recipe.grad_weight[0], groups.expert_of_row, NUM_EXPERTS)
        expected_data, expected_scale = torch_to_float8_per_group_colwise(tokens[used], groups.offsets[1:], E4M3,
                                                                          round_scales_to_power_of_2=True)
        assert bytes_equal(data[used], expected_data)
        assert torch.equal(scale[1:].flatten(), expected_scale)


def per_expert(a: Tensor, b: Tensor, offsets: list[int], grad_weight: bool) -> list[Tensor]:
    """Each expert's product in float64: rows start:end of a (rows, K) @ b[e] (E, K, N), or for a weight gradient
    columns start:end of a (M, rows) @ rows start:end of b (rows, N)."""
    starts = [0] + offsets[:-1]
    if grad_weight:
        return [a[:, s:e].double() @ b[s:e].double() for s, e in zip(starts, offsets)]
    return [a[s:e].double() @ b[i].double() for i, (s, e) in enumerate(zip(starts, offsets))]


def float8_matmuls(recipe_name: str, dtype: torch.dtype) -> dict[str, tuple[Tensor, list[Tensor], list[Tensor]]]:
    """For each of the three matmuls of the experts' float8 recipe, emulated: Titan's result in the padded layout,
    and per expert the exact (float64) product of the same float8 operands, and |a_q| @ |b_q| (for the bound)."""
    x, counts, weight, grad = expert_operands(dtype)
    recipe = EXPERT_RECIPES[recipe_name]
    groups = pad_groups(counts, x.size(0), FLOAT8_GROUP_ALIGNMENT)
    padded_x, padded_grad = groups.pad(x).requires_grad_(), groups.pad(grad)
    weight = weight.clone().requires_grad_()
    out = Float8GroupedMatmul.apply(padded_x, weight, groups.offsets, groups.expert_of_row, recipe, True, READ_COUNTS)
    out.backward(padded_grad)
    ends = groups.offsets.tolist()

    def dequantized_rows(data_scale: tuple[Tensor, Tensor]) -> Tensor:
        data, scale = data_scale
        return dequantize(data, scale if scale.dim() < 2 or scale.size(0) == data.size(0) else
                          torch.cat([scale, scale.new_ones(1, scale.size(1))])[groups.expert_of_row])

    operands = {
        "output": (dequantize(*cast_tokens(padded_x, recipe.output[0])),
                   dequantize(*cast_weights(weight, recipe.output[1], -1)).transpose(-2, -1), out, False),
        "grad_input": (dequantize(*cast_tokens(padded_grad, recipe.grad_input[0])),
                       dequantize(*cast_weights(weight, recipe.grad_input[1], -2)), padded_x.grad, False),
        "grad_weight": (dequantized_rows(cast_expert_columns(padded_grad, recipe.grad_weight[0], groups.expert_of_row,
                                                             NUM_EXPERTS)).t(),
                        dequantized_rows(cast_expert_columns(padded_x, recipe.grad_weight[1], groups.expert_of_row,
                                                             NUM_EXPERTS)), weight.grad, True)}
    results = {}
    for name, (a_q, b_q, got, is_grad_weight) in operands.items():
        results[name] = (got.detach(), per_expert(a_q, b_q, ends, is_grad_weight),
                         per_expert(a_q.abs(), b_q.abs(), ends, is_grad_weight))
    return results, ends


def expert_rows(result: Tensor, ends: list[int], is_grad_weight: bool) -> list[Tensor]:
    """Titan's result split per expert, as per_expert splits the references."""
    if is_grad_weight:
        return list(result.double())
    return [result[s:e].double() for s, e in zip([0] + ends[:-1], ends)]


@pytest.mark.parametrize("recipe_name", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_float8_expert_matmuls_are_within_the_summation_bound(recipe_name: str, dtype: torch.dtype) -> None:
    """The emulated matmuls multiply the dequantized float8 operands in fp32: each expert's block is within
    K x 2^-24 x (|a_q| @ |b_q|) of the exact product of those operands (the summation-order bound of K fp32
    additions, Higham, Accuracy and Stability of Numerical Algorithms, 3.1), plus one rounding to the input's dtype.
    An expert without tokens gets a zero weight gradient."""
    results, ends = float8_matmuls(recipe_name, dtype)
    output_rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    starts = [0] + ends[:-1]
    contracted = {"output": [DIM] * NUM_EXPERTS, "grad_input": [HIDDEN] * NUM_EXPERTS,
                  "grad_weight": [end - start for start, end in zip(starts, ends)]}
    for name, (got, exact, magnitude) in results.items():
        for e, value in enumerate(expert_rows(got, ends, name == "grad_weight")):
            bound = magnitude[e] * contracted[name][e] * 2.0 ** -24 + exact[e].abs() * output_rounding
            assert ((value - exact[e]).abs() <= bound * 1.01 + 1e-30).all(), (name, e)
    assert results["grad_weight"][0][0].abs().max() == 0


def test_float8_tensorwise_expert_casts_equal_torchao() -> None:
    """Tensorwise, which torchao has no grouped form of: one scale for all the tokens (torchao.float8's tensorwise
    cast of the whole tensor) and one per expert for the weights (the same cast of each expert's weight)."""
    x, _, weight, grad = expert_operands(torch.float32)
    recipe = EXPERT_RECIPES["tensorwise"]

    def torchao_tensorwise(t: Tensor) -> tuple[Tensor, Tensor]:
        scale = tensor_to_scale(t, E4M3, scaling_granularity=ScalingGranularity.TENSORWISE)
        return to_fp8_saturated(t.float() * scale, E4M3), scale

    for data, scale, (expected_data, expected_scale) in [
            (*cast_tokens(x, recipe.output[0]), torchao_tensorwise(x)),
            (*cast_tokens(grad, recipe.grad_input[0]), torchao_tensorwise(grad))]:
        assert bytes_equal(data, expected_data) and torch.equal(scale, expected_scale)
    data, scale = cast_weights(weight, recipe.output[1], -1)
    for e in range(NUM_EXPERTS):
        expected_data, expected_scale = torchao_tensorwise(weight[e])
        assert bytes_equal(data[e], expected_data) and torch.equal(scale[e].reshape(()), expected_scale)


def qwen3_moe_on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return FAMILIES["qwen3"].model(FAMILIES["qwen3"].flavors["debugmodel_moe"])


def test_converters_take_the_experts_and_report_them() -> None:
    model = qwen3_moe_on_meta()
    decisions = apply_converters(model, ["mx"], Float8(), MX(emulate=True), NVFP4(), tp_degree=1, fsdp_enabled=False,
                                 print_after_conversion=False).decisions
    experts = [d for d in decisions if d.num_experts]
    assert [d.fqn for d in experts] == [f"layers.{i}.moe.experts" for i in range(6)]
    assert {d.result for d in experts} == {"mx mxfp8 grouped, token groups padded to 32 (emulated)"}
    assert all(isinstance(moe.experts.matmuls, MXExpertMatmuls) for moe in moe_layers(model).values())
    routers = [d for d in decisions if d.fqn.endswith("router.gate")]
    assert routers and not any(d.converted for d in routers)
    report = format_report(decisions)
    assert "8x256x256" in report and "and the experts of 6 of 6 MoE layers" in report
    # Per token: every linear's in x out, each layer's experts top_k x 3 x dim x hidden; the output projection and
    # the routers stay in high precision.
    linear_flops = {name: module.weight.numel() for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear)}
    expert_flops = 6 * 2 * 3 * 256 * 256
    kept = linear_flops["output"] + sum(flops for name, flops in linear_flops.items() if name.endswith("router.gate"))
    share = 100 * (1 - kept / (sum(linear_flops.values()) + expert_flops))
    assert f"{share:.1f}% of the weight matmuls' FLOPs per token (a token's top_k experts' among them) run" in report

    model = qwen3_moe_on_meta()
    decisions = apply_float8(model, Float8(emulate=True, moe_fqns_prototype=[]), 1)
    assert all(type(moe.experts.matmuls) is HighPrecisionMatmuls for moe in moe_layers(model).values())
    assert "skipped: not matched by --float8.moe_fqns_prototype (empty)" in {d.result for d in decisions}


def test_experts_a_recipe_cannot_take_are_skipped() -> None:
    """Both dims of an expert are contracted (dim by w1 and w3, hidden by w2): 40 is no multiple of 16."""
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"moe": MoE(48, MoEArgs(num_experts=4, top_k=2, hidden_dim=40))})
    decisions = apply_float8(model, Float8(emulate=True), 1)
    assert [d.result for d in decisions if d.num_experts] == [
        "skipped: 40x48 not divisible by 16 (the grouped kernels need it)"]


def test_float8_and_mx_cannot_both_take_the_experts() -> None:
    with pytest.raises(ConfigError) as error:
        apply_converters(qwen3_moe_on_meta(), ["float8", "mx"], Float8(filter_fqns=["output", "attention"]),
                         MX(), NVFP4(), tp_degree=1, fsdp_enabled=False, print_after_conversion=False)
    message = str(error.value)
    assert "--model.converters float8 and mx would both convert the experts of 6 MoE layers (layers.0.moe.experts" \
        in message and "linear layers" not in message  # the filters keep the linears apart
    assert "--float8.moe_fqns_prototype and --mx.moe_fqns_prototype" in message


# (major, minor) of NVIDIA parts: Ampere, Ada, Hopper, the data-center Blackwells (B200, B300), Thor and the other
# Blackwells (RTX 50, DGX Spark).
CAPABILITIES = [(8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


def test_native_low_precision_is_refused_where_torch_ships_no_kernel() -> None:
    """Which GPUs each native matmul is accepted on, as torch 2.11 to 2.13 ship their kernels (the same in all three,
    read from their CUDA builds; torch's own tests gate alike, torch/testing/_internal/common_cuda.py): float8 linears
    (torch._scaled_mm) from 8.9 on; MX linears (cuBLAS's block-scaled GEMMs) from 10.0 on; float8 experts
    (torch._scaled_grouped_mm's rowwise kernel, built for SM90 alone: PLATFORM_SUPPORTS_FP8_GROUPED_GEMM is SM90 and
    not SM100) on 9.x only; MXFP8 experts (its kernel built for SM100 and SM103: PLATFORM_SUPPORTS_MXFP8_GROUPED_GEMM)
    on 10.x only. Before, float8 experts passed on every GPU from 9.0 and MX experts on every one from 10.0, and a
    12.0 card failed at the first MoE forward."""
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    dense_only = ["--float8.moe_fqns_prototype", "--mx.moe_fqns_prototype"]
    cases = {"float8 linears": (["--model.converters", "float8", *dense_only], lambda c: c >= (8, 9)),
             "mx linears": (["--model.converters", "mx", *dense_only], lambda c: c >= (10, 0)),
             "float8 experts": ([*moe, "--model.converters", "float8"], lambda c: c[0] == 9),
             "mx experts": ([*moe, "--model.converters", "mx"], lambda c: c[0] == 10)}
    for name, (flags, runs_on) in cases.items():
        cfg = load_job_config(["--job.config_file", DEBUG_TOML, *flags, "--job.print_config"], world_size=1)
        for capability in CAPABILITIES:
            problems = find_problems(cfg, 1, Accelerator(f"a {capability} GPU", capability))[1]
            assert (problems == []) == runs_on(capability), f"{name} on {capability}: {problems}"
            assert all("emulate" in problem for problem in problems), problems


def test_float8_experts_need_hopper_or_emulate() -> None:
    job = ["--job.config_file", DEBUG_TOML, "--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
           "--model.converters", "float8"]
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        with pytest.raises(ConfigError, match="run natively only on NVIDIA Hopper GPUs.*Add "
                                              "--float8.emulate.*--float8.moe_fqns_prototype with no value"):
            load_job_config(job, world_size=1)
    load_job_config([*job, "--float8.emulate"], world_size=1)
    load_job_config([*job, "--float8.moe_fqns_prototype"], world_size=1)  # experts stay in high precision
    validate(load_job_config([*job, "--float8.emulate"], world_size=1), 1, SIMULATED_GPUS["H100"])
    with pytest.raises(ConfigError, match="--float8.moe_fqns_prototype 'moe.expert_s' matches no experts module"):
        load_job_config([*job, "--float8.emulate", "--float8.moe_fqns_prototype", "moe.expert_s"], world_size=1)
