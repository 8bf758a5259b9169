"""NVFP4 against torchao itself, since titan/quant/nvfp4 says its recipe is torchao 0.18's NVFP4 training recipe
(NVFP4TrainingConfig, as torchtitan's NVFP4 converter uses it); and the converter's and the config's rules for it
(at the end).

Quantization: against torchao's nvfp4_quantize, per_tensor_amax_to_scale and _nvfp4_dequantize, bit for bit.

The recipe: torchao's own autograd function (nvfp4_mm_triton, torchao/prototype/moe_training/nvfp4_training/
nvfp4_linear.py) runs here on CPU, inside torchao's NVFP4Linear. Its three Triton kernels, which only SM100 runs
(they convert with PTX instructions), are replaced by what each one's docstring says it computes, built from
torchao's CPU functions; its torch.nn.functional.scaled_mm by the product of torchao's dequantized operands. So
torchao's code decides which operand of which matmul is quantized how, with which tensor scale, where the Hadamard
transform goes and which casts round stochastically. What this cannot check is the kernels' arithmetic on the GPU
(titan/quant/nvfp4/numerics.py says where it can differ in the last bit) and their stochastic rounding draws: the
replaced kernels round to nearest, and so does Titan through the titan_rounds_to_nearest fixture; the test checks
that both asked for stochastic rounding on the same operands. Titan's stochastic rounding is checked against its rule.

Needs torchao (the `test` extra). torchao prints "Failed to load ..._C_mxfp8..." on import on CPU: those are its
CUDA extensions, which nothing here uses.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchao.prototype.moe_training.nvfp4_grouped_mm import _nvfp4_dequantize
from torchao.prototype.moe_training.nvfp4_training import nvfp4_linear as torchao_nvfp4_linear
from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix
from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear as TorchaoNVFP4Linear
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

from titan.config.errors import ConfigError
from titan.config.job import NVFP4 as NVFP4Config
from titan.models.families import FAMILIES
from titan.quant.convert import apply_nvfp4
from titan.quant.formats import E2M1_VALUES
from titan.quant.nvfp4 import linear as titan_nvfp4_linear
from titan.quant.nvfp4.linear import WGRAD_RHT_SIGNS, NVFP4Linear, NVFP4Matmul
from titan.quant.nvfp4.numerics import (
    NVFP4,
    dequantize,
    e2m1_codes,
    hadamard_rotation,
    quantize,
    quantize_2d,
    round_stochastically,
)
from titan.validate import load_job_config

from harness.linears import run_linear
from harness.torchrun import run_torchrun

INPUT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
BLOCK = 16
TOKENS, IN_FEATURES, OUT_FEATURES = 128, 128, 256
"""torchao's recipe takes multiples of 128 only (its swizzled scale stores); out != in tells the operands apart."""
SIGNS = (-1, 1, 1, -1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, -1, 1)
"""Hadamard signs other than Titan's default, so that a test fails if either side ignores the signs it is given."""


def with_outliers(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """Normal values with rows scaled by up to 100 and two outlier columns (x30, x300), so that block amaxes span
    four decades and block scales use much of E4M3's range; one all-zero block (row 1, elements 16..31)."""
    x = torch.randn(rows, cols, generator=generator) * (100 * torch.rand(rows, 1, generator=generator))
    x[:, 3] *= 30
    x[:, cols - 5] *= 300
    x[1, 16:32] = 0
    return x


def torchao_quantize(x: Tensor) -> NVFP4:
    """x in NVFP4 by torchao's nvfp4_quantize, with the tensor scale per_tensor_amax_to_scale gives."""
    scale = per_tensor_amax_to_scale(x.float().abs().max())
    block_scales, data = nvfp4_quantize(x.contiguous(), BLOCK, scale)
    return NVFP4(data, block_scales, scale)


def assert_same_nvfp4(got: NVFP4, want: NVFP4, label: str) -> None:
    assert got.data.dtype == want.data.dtype == torch.uint8, f"{label}: data {got.data.dtype}"
    assert got.block_scales.dtype == want.block_scales.dtype == torch.float8_e4m3fn, f"{label}: block scale dtype"
    assert got.data.shape == want.data.shape and got.block_scales.shape == want.block_scales.shape, (
        f"{label}: data {tuple(got.data.shape)} scales {tuple(got.block_scales.shape)}, torchao data "
        f"{tuple(want.data.shape)} scales {tuple(want.block_scales.shape)}")
    torch.testing.assert_close(got.tensor_scale, want.tensor_scale, rtol=0, atol=0,
                               msg=lambda m: f"{label} tensor scale: {m}")
    torch.testing.assert_close(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8), rtol=0,
                               atol=0, msg=lambda m: f"{label} block scale bytes: {m}")
    torch.testing.assert_close(got.data, want.data, rtol=0, atol=0, msg=lambda m: f"{label} packed E2M1 bytes: {m}")


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("shape", [(32, 64), (48, 64)], ids=["activation", "weight"])
def test_quantize_matches_torchao(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Packed E2M1 bytes, E4M3 block scales and the fp32 tensor scale equal torchao's, bit for bit, and so do the
    dequantized values; the data hold an all-zero block and elements that saturate at 6."""
    x = with_outliers(*shape, torch.Generator().manual_seed(sum(shape))).to(dtype)
    want = torchao_quantize(x)
    assert_same_nvfp4(quantize(x), want, f"{tuple(shape)} {dtype}")
    want_values = _nvfp4_dequantize(want.data, want.block_scales, BLOCK, want.tensor_scale, torch.float32)
    torch.testing.assert_close(dequantize(quantize(x)), want_values, rtol=0, atol=0)
    assert (want_values[1, 16:32] == 0).all() and want.block_scales[1, 1].float() == 2 ** -6, "the all-zero block"
    at_six = (unpack_uint4(want.data) & 7) == 7
    assert (at_six & (x.float().abs() > want_values.abs())).any(), "no element saturates: the data lost the case"


def test_e2m1_rounds_as_torchao() -> None:
    """To nearest with ties to even, on every midpoint between E2M1 values, the fp32 values either side of each, and
    a fine sweep of [-6, 6], signed zeros included: torchao's f32_to_f4_unpacked codes."""
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    around = torch.cat([midpoints, torch.nextafter(midpoints, torch.zeros(7)),
                        torch.nextafter(midpoints, torch.full((7,), 7.0))])
    values = torch.cat([around, -around, torch.linspace(-6, 6, 48001), torch.tensor([0.0, -0.0])])
    torch.testing.assert_close(e2m1_codes(values), f32_to_f4_unpacked(values), rtol=0, atol=0)


def test_hadamard_rotation_is_torchaos() -> None:
    for signs in (SIGNS, WGRAD_RHT_SIGNS):
        torch.testing.assert_close(hadamard_rotation(signs, torch.device("cpu")),
                                   get_rht_matrix(signs, "cpu", torch.float32, BLOCK), rtol=0, atol=0)


def tile_amax(w: Tensor) -> Tensor:
    """Each element's 16x16 tile's amax, w's shape: the amax torchao's 2D weight kernel scales the tile by."""
    rows, cols = w.shape
    tiles = w.float().abs().unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK))  # (rows / 16, 16, cols / 16, 16)
    return tiles.amax(dim=(1, 3), keepdim=True).expand(-1, BLOCK, -1, BLOCK).reshape(rows, cols)


def torchao_quantize_2d(w: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """(packed bytes, block scales (rows, cols / 16)) of torchao's 16x16 weight quantization, which has no CPU
    implementation, from its 1x16 nvfp4_quantize: a block holding its tile's amax in one place quantizes as the
    tile does, except in that place. Two passes, the amax in place 0 and then in place 1, give every element."""
    amaxes = tile_amax(w)
    passes = []
    for place in (0, 1):
        spliced = w.float().clone()
        spliced[:, place::BLOCK] = amaxes[:, place::BLOCK]
        passes.append(nvfp4_quantize(spliced, BLOCK, per_tensor_amax_to_scale(amax)))
    (block_scales, data), (other_block_scales, other_data) = passes
    assert torch.equal(block_scales.view(torch.uint8), other_block_scales.view(torch.uint8))
    codes = unpack_uint4(data)
    codes[:, 0::BLOCK] = unpack_uint4(other_data)[:, 0::BLOCK]
    return pack_uint4(codes), block_scales


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_quantize_2d_matches_torchao_tiles(dtype: torch.dtype) -> None:
    """Each 16x16 tile is quantized as nvfp4_quantize quantizes its rows when their amax is the tile's; and the
    transposed weight (grad_input's operand) holds the same values, transposed."""
    w = with_outliers(48, 64, torch.Generator().manual_seed(1)).to(dtype)
    data, block_scales = torchao_quantize_2d(w, w.float().abs().max())
    assert_same_nvfp4(quantize_2d(w), NVFP4(data, block_scales, per_tensor_amax_to_scale(w.float().abs().max())),
                      f"2d {dtype}")
    torch.testing.assert_close(dequantize(quantize_2d(w.t())), dequantize(quantize_2d(w)).t(), rtol=0, atol=0)


def test_special_tensors() -> None:
    """Where Titan departs from nvfp4_quantize: an all-zero tensor (a zero gradient) takes tensor scale 1, as
    torchao's Triton kernels do, where nvfp4_quantize divides 0 by 0 into NaN. And one NaN or infinity makes every
    value NaN, so that the trainer's NaN stop sees it."""
    zeros = quantize(torch.zeros(16, 32))
    assert zeros.tensor_scale == 1 and (dequantize(zeros) == 0).all()
    assert dequantize(torchao_quantize(torch.zeros(16, 32))).isnan().all()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
        x[5, 7] = bad
        assert dequantize(quantize(x)).isnan().all(), f"a {bad} must make every value NaN"


def test_stochastic_rounding_is_unbiased() -> None:
    """Each element rounds to one of the two E2M1 values around its scaled value, never further; averaged over 20000
    draws it is its scaled value, to within 5 standard errors (a draw is off by at most the widest E2M1 gap, 2, so
    its standard deviation is at most 1). In quantize, it leaves the scales of rounding to nearest, and the same
    noise gives the same bytes."""
    scaled = torch.linspace(-6, 6, 241)
    noise = torch.rand(20000, 241, generator=torch.Generator().manual_seed(0))
    draws = round_stochastically(scaled.expand(20000, -1), noise)
    grid = torch.tensor(E2M1_VALUES)
    below = torch.bucketize(scaled.abs(), grid, right=True) - 1
    lower, upper = grid[below], grid[(below + 1).clamp(max=len(E2M1_VALUES) - 1)]
    assert ((draws.abs() == lower) | (draws.abs() == upper)).all() and (draws * scaled >= 0).all()
    assert (draws.mean(0) - scaled).abs().max() < 5 / 20000 ** 0.5
    x = with_outliers(32, 64, torch.Generator().manual_seed(2))
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(3))
    stochastic, nearest = quantize(x, noise), quantize(x)
    torch.testing.assert_close(stochastic.block_scales.view(torch.uint8), nearest.block_scales.view(torch.uint8),
                               rtol=0, atol=0)
    assert not torch.equal(stochastic.data, nearest.data)
    torch.testing.assert_close(quantize(x, noise.clone()).data, stochastic.data, rtol=0, atol=0)


def torchao_rotate(a: Tensor, sign_vector: list[int]) -> Tensor:
    """RHT(A^T) as torchao's Triton kernels compute it: A (M, N) bf16 transposed, each run of 16 along M multiplied
    by get_rht_matrix in fp32 (tl.dot), then cast to bf16. (N, M)."""
    rht = get_rht_matrix(tuple(sign_vector), "cpu", torch.bfloat16, BLOCK)
    a_t = a.t().reshape(-1, BLOCK)  # (N * M / 16, 16)
    return (a_t.float() @ rht.float()).to(torch.bfloat16).reshape(a.shape[1], a.shape[0])


def swizzled(block_scales: Tensor) -> Tensor:
    """Scales (rows, K / 16) as torchao's kernels store them: torchao's to_blocked, shaped (rows / 128, K / 64, 32,
    16)."""
    rows = block_scales.shape[0]
    return to_blocked(block_scales).view(rows // 128, -1, 32, BLOCK)


def fake_rht_amax(A: Tensor, sign_vector: list[int], **unused: object) -> tuple[Tensor, Tensor]:
    """triton_rht_amax's contract: (max |RHT(A^T)|, max |A|)."""
    return torchao_rotate(A, sign_vector).float().abs().max(), A.float().abs().max()


def fake_weight_quantize_2d(A: Tensor, global_amax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """triton_weight_quantize_2d's contract: A (M, N) and A^T in 16x16 tiles, with swizzled scales."""
    data, block_scales = torchao_quantize_2d(A, global_amax)
    data_t, block_scales_t = torchao_quantize_2d(A.t().contiguous(), global_amax)
    return data, swizzled(block_scales), data_t, swizzled(block_scales_t)


def fake_scaled_mm(mat_a: Tensor, mat_b: Tensor, scale_a: list[Tensor], scale_recipe_a: list[F.ScalingType],
                   scale_b: list[Tensor], scale_recipe_b: list[F.ScalingType], swizzle_a: list[F.SwizzleType],
                   swizzle_b: list[F.SwizzleType], output_dtype: torch.dtype, **unused: object) -> Tensor:
    """torch.nn.functional.scaled_mm on NVFP4, which only SM100 runs: the fp32 product of the values that torchao's
    _nvfp4_dequantize gives each operand, rounded once to output_dtype. mat_b (K / 2, N) is packed rows (N, K / 2)
    transposed."""
    assert scale_recipe_a == scale_recipe_b == [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    assert swizzle_a == swizzle_b == [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]

    def values(data: Tensor, scales: list[Tensor]) -> Tensor:
        rows, packed = data.shape
        block_scales = from_blocked(scales[0], rows, 2 * packed // BLOCK)
        return _nvfp4_dequantize(data.view(torch.uint8), block_scales, BLOCK, scales[1], torch.float32)

    return (values(mat_a, scale_a) @ values(mat_b.t(), scale_b).t()).to(output_dtype)


@pytest.fixture
def torchao_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], bool]]:
    """torchao's NVFP4 training recipe on CPU (module docstring); F.scaled_mm is replaced for Titan's native path
    too. Returns the (shape, stochastic_rounding) of each activation or gradient that torchao's recipe quantizes."""
    quantized = []

    def fake_rht_quantize_row_col(A: Tensor, col_global_amax: Tensor, row_global_amax: Tensor,
                                  sign_vector: list[int], stochastic_rounding: bool = False,
                                  **unused: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """triton_rht_quantize_row_col's contract, rounding to nearest: RHT(A^T) and A, each in 1x16 blocks."""
        quantized.append((tuple(A.shape), stochastic_rounding))
        col_scales, col = nvfp4_quantize(torchao_rotate(A, sign_vector), BLOCK,
                                         per_tensor_amax_to_scale(col_global_amax))
        row_scales, row = nvfp4_quantize(A, BLOCK, per_tensor_amax_to_scale(row_global_amax))
        return col, swizzled(col_scales), row, swizzled(row_scales)

    monkeypatch.setattr(torchao_nvfp4_linear, "triton_rht_amax", fake_rht_amax)
    monkeypatch.setattr(torchao_nvfp4_linear, "triton_rht_quantize_row_col", fake_rht_quantize_row_col)
    monkeypatch.setattr(torchao_nvfp4_linear, "triton_weight_quantize_2d", fake_weight_quantize_2d)
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm)
    return quantized


@pytest.fixture
def titan_rounds_to_nearest(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Titan's casts round to nearest where they would round stochastically; returns the shapes they asked noise
    for."""
    asked = []

    def no_noise(x: Tensor) -> None:
        asked.append(tuple(x.shape))

    monkeypatch.setattr(titan_nvfp4_linear, "rounding_noise", no_noise)
    return asked


def linear_operands(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """x (tokens, in), weight (out, in) and grad_output (tokens, out), fixed by a seed; grad_output in bf16's values,
    so that torchao's bf16 output and Titan's fp32 one get the same gradient."""
    generator = torch.Generator().manual_seed(0)
    x = with_outliers(TOKENS, IN_FEATURES, generator)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) / IN_FEATURES ** 0.5
    weight[:, 7] *= 20
    grad = with_outliers(TOKENS, OUT_FEATURES, generator).bfloat16()
    return x.to(dtype), weight.to(dtype), grad.to(dtype)


def with_weight(linear: nn.Linear, weight: Tensor) -> nn.Linear:
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "native"])
def test_linear_matches_torchao_recipe(emulate: bool, dtype: torch.dtype,
                                       torchao_on_cpu: list[tuple[tuple[int, ...], bool]],
                                       titan_rounds_to_nearest: list[tuple[int, ...]]) -> None:
    """Output, grad_input and grad_weight of NVFP4Linear equal those of torchao's NVFP4Linear with the same
    Hadamard signs, bit for bit, emulated and native (through the same scaled_mm replacement as torchao's); torchao
    returns the output in bf16 for fp32 inputs, Titan the same values in fp32. Both round stochastically exactly the
    two casts of grad_output: torchao in its one backward kernel call, Titan in its two casts."""
    x, weight, grad = linear_operands(dtype)
    torchao_linear = TorchaoNVFP4Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=dtype, rht_sign_vector=SIGNS)
    want = run_linear(with_weight(torchao_linear, weight), x, grad)
    titan_linear = NVFP4Linear(IN_FEATURES, OUT_FEATURES, bias=False, emulate=emulate, dtype=dtype, rht_signs=SIGNS)
    got = run_linear(with_weight(titan_linear, weight), x, grad)
    for matmul, result in got.items():
        assert result.dtype == dtype, f"{matmul}: {result.dtype}, input {dtype}"
        torch.testing.assert_close(result, want[matmul].to(dtype), rtol=0, atol=0, msg=lambda m: f"{matmul}: {m}")
    assert torchao_on_cpu == [((TOKENS, IN_FEATURES), False), ((TOKENS, OUT_FEATURES), True)]
    assert titan_rounds_to_nearest == [(TOKENS, OUT_FEATURES), (OUT_FEATURES, TOKENS)]


def test_tokens_pad_to_whole_blocks(torchao_on_cpu: list[tuple[tuple[int, ...], bool]],
                                    titan_rounds_to_nearest: list[tuple[int, ...]]) -> None:
    """Titan takes any number of tokens (here 2 x 20, whose grad_weight contracts 40 tokens, padded to 64, a whole
    number of 16-byte FP4 rows); torchao's recipe only multiples of 128. Titan's results are those of torchao's on
    the tokens padded with zeros to 128. To a bf16 ulp (2**-8 relative) in grad_weight: the padded tokens add zero
    products to its fp32 sums, which may then sum in another order."""
    x, weight, grad = linear_operands(torch.bfloat16)
    tokens = 40
    x[tokens:], grad[tokens:] = 0, 0
    torchao_linear = TorchaoNVFP4Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=torch.bfloat16,
                                        rht_sign_vector=SIGNS)
    want = run_linear(with_weight(torchao_linear, weight), x, grad)
    titan_linear = NVFP4Linear(IN_FEATURES, OUT_FEATURES, bias=False, emulate=True, dtype=torch.bfloat16,
                               rht_signs=SIGNS)
    got = run_linear(with_weight(titan_linear, weight), x[:tokens].view(2, 20, -1), grad[:tokens].view(2, 20, -1))
    torch.testing.assert_close(got["output"].flatten(0, 1), want["output"][:tokens], rtol=0, atol=0)
    torch.testing.assert_close(got["grad_input"].flatten(0, 1), want["grad_input"][:tokens], rtol=0, atol=0)
    torch.testing.assert_close(got["grad_weight"], want["grad_weight"], rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("tokens", [48, 40, 33])
def test_native_matmuls_pass_torchs_shape_rule_for_any_number_of_tokens(tokens: int) -> None:
    """The native forward and backward on meta tensors, which run torch's own shape rule for scaled_mm (the one its
    CUDA kernel checks): packed FP4 operands two elements a byte must be whole 16-byte rows along the contraction.
    grad_weight contracts the tokens: 48 (16 mod 32) padded to whole blocks of 16 were 24-byte rows, which the rule
    (and a GPU) refused; they are padded to 64 now."""
    x = torch.empty(tokens, IN_FEATURES, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(OUT_FEATURES, IN_FEATURES, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = NVFP4Matmul.apply(x, weight, SIGNS, False)
    out.backward(torch.empty_like(out))
    assert out.shape == (tokens, OUT_FEATURES) and weight.grad.shape == weight.shape and x.grad.shape == x.shape


def test_gradients_round_stochastically_and_repeat_under_a_seed() -> None:
    """Unpatched, the backward rounds grad_output stochastically: its gradients depend on the seed, and
    torch.manual_seed repeats them exactly."""
    x, weight, grad = linear_operands(torch.float32)
    linear = NVFP4Linear(IN_FEATURES, OUT_FEATURES, bias=False, emulate=True)

    def gradients(seed: int) -> dict[str, Tensor]:
        torch.manual_seed(seed)
        linear.weight.grad = None
        return run_linear(with_weight(linear, weight), x, grad)

    first, again, other = gradients(0), gradients(0), gradients(1)
    for name in ("grad_input", "grad_weight"):
        torch.testing.assert_close(again[name], first[name], rtol=0, atol=0)
        assert not torch.equal(other[name], first[name]), f"{name} does not depend on the seed"


def test_shapes_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="in_features and out_features divisible by 32"):
        NVFP4Linear(48, 64, bias=False, emulate=True)
    with pytest.raises(ValueError, match="rht_signs"):
        NVFP4Linear(64, 64, bias=False, emulate=True, rht_signs=(1, -1))


def debug_model_on_meta(family: str, flavor: str) -> nn.Module:
    with torch.device("meta"):
        return FAMILIES[family].model(FAMILIES[family].flavors[flavor])


def test_converter_keeps_the_last_blocks_the_output_and_the_experts() -> None:
    """torchtitan's recipe: the last ceil(6 x 0.15) = 1 of the debug model's blocks and the output projection stay
    in high precision; 0 converts every block. Experts have no NVFP4 grouped recipe and are reported as kept."""
    model = debug_model_on_meta("llama3", "debugmodel")
    decisions = {d.fqn: d for d in apply_nvfp4(model, NVFP4Config(emulate=True), 1)}
    assert isinstance(model.layers["4"].attention.wq, NVFP4Linear) and type(model.output) is nn.Linear
    assert decisions["layers.5.feed_forward.w1"].result == (
        "skipped: one of the last 1 blocks (--nvfp4.high_precision_last_blocks_fraction 0.15)")
    assert sum(d.converted for d in decisions.values()) == 5 * 7
    model = debug_model_on_meta("llama3", "debugmodel")
    apply_nvfp4(model, NVFP4Config(high_precision_last_blocks_fraction=0.0, filter_fqns=[]), 1)
    assert isinstance(model.layers["5"].attention.wq, NVFP4Linear) and isinstance(model.output, NVFP4Linear)
    decisions = apply_nvfp4(debug_model_on_meta("qwen3", "debugmodel_moe"), NVFP4Config(emulate=True), 1)
    experts = [d for d in decisions if d.num_experts]
    assert len(experts) == 6 and not any(d.converted for d in experts)


def test_nvfp4_config_rules() -> None:
    job = ["--model.converters", "nvfp4"]
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)):
        with pytest.raises(ConfigError, match="nvfp4 runs natively only on NVIDIA GPUs with compute capability 10.0.*"
                                              "Add --nvfp4.emulate"):
            load_job_config(job, world_size=1)
    assert load_job_config([*job, "--nvfp4.emulate"], world_size=1).nvfp4.emulate
    with pytest.raises(ConfigError) as error:
        load_job_config([*job, "mx", "--nvfp4.emulate", "--mx.emulate", "--nvfp4.filter_fqns", "outptu"],
                        world_size=1)
    message = str(error.value)
    assert "--model.converters nvfp4 does not combine with mx" in message
    # Tensor parallel is no conflict (as torchao's NVFP4 tensor-parallel styles, below).
    assert load_job_config([*job, "--nvfp4.emulate", "--parallelism.tensor_parallel_degree", "2"],
                           world_size=2).parallelism.tensor_parallel_degree == 2
    assert "--nvfp4.filter_fqns 'outptu' matches no linear layer" in message


def test_tensor_parallel_follows_torchaos_amax_rule(tmp_path: Path) -> None:
    """Colwise and rowwise NVFP4 linears on 2 TP ranks with sequence parallel (tests/harness/nvfp4_tp_harness.py):
    every rank's output, input gradient and weight gradient equal the NVFP4 matmuls of the operands torchao's NVFP4
    tensor-parallel styles give it, a gathered operand quantized with the whole tensor's amax and a sharded one with
    its shard's, bit for bit; and a rank's output is not one process's where its shard's amax is not the whole's."""
    result = tmp_path / "nvfp4_tp.pt"
    run_torchrun("nvfp4_tp_harness.py", 2, str(result))
    for rank, styles in enumerate(torch.load(result)):
        for style, got in styles.items():
            for key in ("out", "grad_input", "grad_weight"):
                assert torch.equal(got[key], got[f"want_{key}"]), (rank, style, key)
    # Rank 0's weight rows lack the weight's largest entry (row 70): its tensor scale is its own, not the whole's.
    colwise = torch.load(result)[0]["colwise"]
    assert not torch.equal(colwise["out"], colwise["one_process_out"].chunk(2, dim=1)[0])
