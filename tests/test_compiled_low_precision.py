"""Every low-precision linear and experts' grouped matmul compiled (aot_eager: the graph Dynamo and AOTAutograd
capture, run op for op) computes what it computes eagerly, forward and backward, in fp32 and in bf16, emulated and
(float8's linears, whose torch._scaled_mm runs on the CPU) native. torch 2.11 compiles an autograd.Function whose
forward returns a no-op `.to(...)` into zero gradients, silently: bf16 with the native kernels (which write bf16) and
fp32 emulated both hit it in the linears, so both dtypes run here, and this file is in the torch 2.11 subset of
.ci/run."""

import pytest
import torch
from torch import Tensor, nn

from tests.harness.linears import run_linear
from titan.hardware import cpu_scaled_mm_takes_rowwise_scales
from titan.models.common.moe import READ_COUNTS
from titan.quant.float8.blockwise import Float8BlockwiseLinear
from titan.quant.float8.blockwise_grouped import BLOCKWISE_GROUP_ALIGNMENT, BlockwiseExpertMatmuls
from titan.quant.float8.grouped import FLOAT8_GROUP_ALIGNMENT, Float8ExpertMatmuls
from titan.quant.float8.linear import Float8Linear
from titan.quant.grouped import pad_groups
from titan.quant.mx.grouped import MX_GROUP_ALIGNMENT, MXExpertMatmuls
from titan.quant.mx.linear import MXLinear
from titan.quant.nvfp4.linear import NVFP4Linear
from titan.quant.quantized_linear import QuantizedLinear

LINEARS = {
    "float8_tensorwise": lambda emulate: Float8Linear(256, 128, bias=True, recipe_name="tensorwise", emulate=emulate),
    "float8_rowwise": lambda emulate: Float8Linear(256, 128, bias=True, recipe_name="rowwise", emulate=emulate),
    "float8_rowwise_with_gw_hp": lambda emulate: Float8Linear(256, 128, bias=True, recipe_name="rowwise_with_gw_hp",
                                                              emulate=emulate),
    "float8_blockwise": lambda emulate: Float8BlockwiseLinear(256, 128, bias=True, emulate=emulate),
    "mxfp8": lambda emulate: MXLinear(256, 128, bias=True, recipe_name="mxfp8", emulate=emulate),
    "nvfp4": lambda emulate: NVFP4Linear(256, 128, bias=True, emulate=emulate),
}
ROWWISE_NATIVE = pytest.param("float8_rowwise", False, marks=pytest.mark.skipif(
    not cpu_scaled_mm_takes_rowwise_scales(), reason="this torch's CPU torch._scaled_mm has no rowwise scales"))
CASES = [(name, True) for name in LINEARS] + [("float8_tensorwise", False), ROWWISE_NATIVE]
IDS = [f"{name}-emulated" for name in LINEARS] + ["float8_tensorwise-native", "float8_rowwise-native"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,emulate", CASES, ids=IDS)
def test_compiled_linear_matches_eager(name: str, emulate: bool, dtype: torch.dtype) -> None:
    # All the cases compile QuantizedLinear.forward: without a reset, Dynamo's recompile limit would soon run the
    # later ones eagerly, and they would pass without being compiled.
    torch._dynamo.reset()
    torch.manual_seed(0)
    linear: QuantizedLinear = LINEARS[name](emulate).to(dtype)
    nn.init.normal_(linear.weight, std=0.05)
    x, grad = torch.randn(2, 64, 256, dtype=dtype), torch.randn(2, 64, 128, dtype=dtype)
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws its noise: the same draws in both runs
    eager = run_linear(linear, x, grad)
    torch.manual_seed(1)
    compiled = run_linear(torch.compile(linear, backend="aot_eager"), x, grad)
    for key in eager:
        assert eager[key].abs().amax() > 0, key
        torch.testing.assert_close(compiled[key], eager[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


EXPERTS = {  # each with the token-group alignment its converter pads to
    "float8_tensorwise": (Float8ExpertMatmuls("tensorwise", emulate=True), FLOAT8_GROUP_ALIGNMENT),
    "float8_rowwise": (Float8ExpertMatmuls("rowwise", emulate=True), FLOAT8_GROUP_ALIGNMENT),
    "float8_blockwise": (BlockwiseExpertMatmuls(), BLOCKWISE_GROUP_ALIGNMENT),
    "mxfp8": (MXExpertMatmuls(emulate=True), MX_GROUP_ALIGNMENT),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", EXPERTS)
def test_compiled_expert_matmul_matches_eager(name: str, dtype: torch.dtype) -> None:
    """One grouped matmul of the experts as they run it (tokens padded per group), with groups of 0, 1 and sizes
    that are multiples of no alignment."""
    matmuls, alignment = EXPERTS[name]
    counts = torch.tensor([0, 1, 45, 70])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(116, 128, generator=generator).to(dtype)
    weight = (torch.randn(4, 128, 128, generator=generator) * 0.1).to(dtype)
    grad = torch.randn(116, 128, generator=generator).to(dtype)

    def grouped_mm(x: Tensor, weight: Tensor) -> Tensor:
        groups = pad_groups(counts, x.size(0), alignment)
        return groups.unpad(matmuls.grouped_mm(groups.pad(x), weight, groups, READ_COUNTS))

    def run(fn) -> list[Tensor]:
        x_leaf, weight_leaf = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(x_leaf, weight_leaf)
        out.backward(grad.to(out.dtype))
        return [out.detach(), x_leaf.grad, weight_leaf.grad]

    torch._dynamo.reset()
    eager, compiled = run(grouped_mm), run(torch.compile(grouped_mm, backend="aot_eager"))
    for key, want, got in zip(["output", "grad_input", "grad_weight"], eager, compiled):
        assert want.abs().amax() > 0, key
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
