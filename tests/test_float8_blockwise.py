"""Blockwise float8 (--float8.recipe_name blockwise, titan/quant/float8/blockwise.py) against torchao 0.18 itself: the
tile and block casts byte for byte against torchao's pure-torch quantizers, the linear's three matmuls against the
same matmuls composed from them, and the experts against torchao's emulated blockwise grouped matmul (its Triton
quantizers given CPU kernels from its own references: tests/harness/torchao_blockwise.py). Also the ceil-sized grid
at the edges, the conversion's skips and report, and the config's refusals. The native path's layouts go
through torch's checks of F.scaled_mm on the simulated H100: tests/test_dry_run.py. Compiled against eager:
tests/test_compiled_low_precision.py.

Needs torchao (the `test` extra), so it is not in the torch 2.11 subset of .ci/run. torchao prints "Failed to load
..._C_mxfp8..." on import on CPU: its CUDA extensions, which nothing here uses.
"""

import dataclasses

import pytest
import torch
from torch import Tensor, nn
from torchao.prototype.blockwise_fp8_training.kernels import (
    torch_blockwise_scale_act_quant_lhs,
    torch_blockwise_scale_act_quant_rhs,
    torch_blockwise_scale_weight_quant,
)

from titan.config.errors import ConfigError
from titan.config.job import Float8
from titan.models.common.moe import READ_COUNTS
from titan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from titan.models.llama.args import LLAMA3_FLAVORS
from titan.quant.convert import apply_float8, format_report
from titan.quant.float8.blockwise import (
    Float8BlockwiseLinear,
    block_cast,
    dequantize_blocks,
    dequantize_tiles,
    local_blockwise_mm,
    tile_cast,
)
from titan.quant.float8.blockwise_grouped import BLOCKWISE_GROUP_ALIGNMENT, BlockwiseExpertMatmuls
from titan.quant.grouped import pad_groups
from titan.validate import load_job_config

from harness.debug_training import DEBUG_TOML
from harness.linears import run_linear, sqnr_db
from harness.models import build_model
from harness.torchao_blockwise import _to_fp8_blockwise_then_emulated_scaled_grouped_mm

INPUT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def wide_range(rows: int, cols: int, dtype: torch.dtype, seed: int) -> Tensor:
    """Normal values, each row scaled by 10^-6 .. 10^5, one 128 x 128 block all zero."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * 10.0 ** torch.randint(-6, 6, (rows, 1), generator=generator)
    x[:128, :128] = 0
    return x.to(dtype)


def same_bytes(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_casts_equal_torchaos_quantizers_byte_for_byte(dtype: torch.dtype) -> None:
    """1 x 128 tiles along rows (torchao's lhs), 128 x 1 down columns (rhs) and 128 x 128 blocks (weight): the same
    float8 bytes and inverse scales. One difference, pinned: torchao's rhs reference floors an all-zero tile's amax
    at 1e-12 in the input's dtype, which bf16 rounds to 1.0019e-12 (its other quantizers, and Titan, floor in fp32);
    the tile's values are 0 either way."""
    x = wide_range(256, 384, dtype, seed=0)
    for (data, scale), (want_data, want_scale) in [(tile_cast(x, 1), torch_blockwise_scale_act_quant_lhs(x)),
                                                   (block_cast(x), torch_blockwise_scale_weight_quant(x))]:
        assert same_bytes(data, want_data) and torch.equal(scale, want_scale)
    data, scale = tile_cast(x, 0)
    want_data, want_scale = torch_blockwise_scale_act_quant_rhs(x)
    assert same_bytes(data, want_data)
    zero_tiles = x.unflatten(0, (-1, 128)).abs().amax(1) == 0  # (row tiles, cols)
    assert torch.equal(scale[~zero_tiles], want_scale[~zero_tiles])
    if dtype == torch.bfloat16:
        assert (scale[zero_tiles] != want_scale[zero_tiles]).all()


def test_the_grid_is_ceil_sized_at_the_edges() -> None:
    """A dim that is not a multiple of 128 (DeepSeek-V3's 576-row wkv_a): the last tile or block holds what is left
    and takes its own amax, as the zero-padded tensor's does; the scales are ceil(size / 128) long."""
    x = wide_range(576, 200, torch.float32, seed=1)
    padded = torch.nn.functional.pad(x, (0, 56, 0, 64))  # (640, 256)
    data, scale = block_cast(x)
    want_data, want_scale = torch_blockwise_scale_weight_quant(padded)
    assert scale.shape == (5, 2) and torch.equal(scale, want_scale)
    assert same_bytes(data, want_data[:576, :200].contiguous())
    data, scale = tile_cast(x, 1)
    want_data, want_scale = torch_blockwise_scale_act_quant_lhs(padded)
    assert scale.shape == (576, 2) and torch.equal(scale, want_scale[:576])
    assert same_bytes(data, want_data[:576, :200].contiguous())
    assert torch.equal(dequantize_blocks(*block_cast(x)), dequantize_blocks(*block_cast(padded))[:576, :200])


def torchao_linear(x: Tensor, weight: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """Output, grad_input and grad_weight of torchao's Float8BlockwiseLinear's matmuls (torchao/prototype/
    blockwise_fp8_training/linear.py fp8_blockwise_mm), each operand quantized by torchao's reference for its kernel
    and dequantized as the kernels multiply (data x inverse scale), multiplied in fp32: x in 1 x 128 tiles and W in
    blocks for the output, grad in tiles and W in blocks for grad_input, grad^T in tiles along the tokens and x in
    128 x 1 tiles for grad_weight."""
    def tiles(t: Tensor) -> Tensor:
        return dequantize_tiles(*torch_blockwise_scale_act_quant_lhs(t.contiguous()), 1)

    w_blocks = dequantize_blocks(*torch_blockwise_scale_weight_quant(weight))
    x_down_columns = dequantize_tiles(*torch_blockwise_scale_act_quant_rhs(x), 0)
    return {"output": (tiles(x) @ w_blocks.t()).to(x.dtype), "grad_input": (tiles(grad) @ w_blocks).to(x.dtype),
            "grad_weight": (tiles(grad.t()) @ x_down_columns).to(weight.dtype)}


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_linear_equals_torchaos_matmuls(dtype: torch.dtype) -> None:
    """Emulated, the three matmuls equal torchao's quantizers composed as its linear composes them, bit for bit (256
    tokens: torchao's weight gradient asks for a multiple of 128); and they are close to the high-precision linear
    (DeepSeek's recipe keeps about 30 dB here)."""
    linear = Float8BlockwiseLinear(384, 256, bias=False, emulate=True, dtype=dtype)
    nn.init.normal_(linear.weight, std=0.05)
    x, grad = wide_range(256, 384, dtype, seed=2), wide_range(256, 256, dtype, seed=3)
    got = run_linear(linear, x, grad)
    want = torchao_linear(x, linear.weight.detach(), grad)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    reference = nn.Linear(384, 256, bias=False, dtype=torch.float32)
    reference.weight.data.copy_(linear.weight.float())
    plain = run_linear(reference, x.float(), grad.float())
    assert all(sqnr_db(plain[name], got[name].float()) > 25 for name in plain)


def test_weight_gradient_pads_the_tokens_to_whole_tiles() -> None:
    """200 tokens: grad_weight's tiles run down the tokens, and the last holds 72 of them and 56 zero rows, as the
    zero-padded batch's (torchao asks for a multiple of 128 instead)."""
    weight = torch.randn(128, 256) * 0.05
    x, grad = torch.randn(200, 256), torch.randn(200, 128)
    padded_x, padded_grad = (torch.nn.functional.pad(t, (0, 0, 0, 56)) for t in (x, grad))
    assert torch.equal(local_blockwise_mm(grad.t(), x, b_blocks=False, emulate=True),
                       torchao_linear(padded_x, weight, padded_grad)["grad_weight"])


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_experts_equal_torchaos_emulated_grouped_matmul(dtype: torch.dtype) -> None:
    """Token groups of 0, 1, 130 and 125 tokens (neither a multiple of 128), padded inside: the output and both
    gradients are torchao's bits. torchao returns bf16 (its out_dtype), as Titan's experts do before casting to the
    input's dtype, so the output gradient reaches both as bf16."""
    counts = torch.tensor([0, 1, 130, 125])
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(int(counts.sum()), 256, generator=generator).to(dtype)
    weight = (torch.randn(4, 384, 256, generator=generator) * 0.05).to(dtype)
    grad = torch.randn(int(counts.sum()), 384, generator=generator).to(dtype)
    x_got, weight_got = x.clone().requires_grad_(), weight.clone().requires_grad_()
    groups = pad_groups(counts, x.size(0), BLOCKWISE_GROUP_ALIGNMENT)
    out = groups.unpad(BlockwiseExpertMatmuls().grouped_mm(groups.pad(x_got), weight_got, groups, READ_COUNTS))
    out.backward(grad)
    x_ref, weight_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out_ref = _to_fp8_blockwise_then_emulated_scaled_grouped_mm(
        x_ref, weight_ref.transpose(-2, -1), counts.cumsum(0).to(torch.int32), torch.bfloat16,
        pad_token_groups_for_grouped_mm=True)
    out_ref.to(dtype).backward(grad)
    assert torch.equal(out, out_ref.to(dtype))
    assert torch.equal(x_got.grad, x_ref.grad) and torch.equal(weight_got.grad, weight_ref.grad)
    assert weight_got.grad[0].abs().sum() == 0 and weight_got.grad[1].abs().sum() > 0


def test_conversion_skips_what_the_blocks_cannot_cover_and_says_the_experts_are_emulated() -> None:
    """Linears whose dims are not multiples of 128 (DeepSeek-V3's wkv_a: the latent rank plus the rotary key's
    channels), or whose TP shards would cut a block (Llama's 128-row wk over 2 ranks), stay in high precision with
    their reason; the experts convert, reported as emulated (no blockwise grouped kernel)."""
    model = build_model(dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=2256))
    decisions = {d.fqn: d for d in apply_float8(model, Float8(recipe_name="blockwise"), 1)}
    assert decisions["layers.1.attention.wkv_a"].result == ("skipped: 144x256 not divisible by 128 (blockwise "
                                                             "float8's tiles and blocks)")
    assert decisions["layers.1.attention.wkv_b"].converted
    assert isinstance(model.layers["1"].attention.wkv_b, Float8BlockwiseLinear)
    experts = decisions["layers.1.moe.experts"]
    assert experts.converted and "emulated" in experts.result and "slower than bf16" in experts.result
    assert "float8 blockwise grouped" in format_report(list(decisions.values()))
    model = build_model(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256))
    decisions = {d.fqn: d for d in apply_float8(model, Float8(recipe_name="blockwise"), 2)}
    assert decisions["layers.0.attention.wk"].result == ("skipped: 128x256 does not split into 2 TP shards of whole "
                                                          "128-element blockwise float8 tiles")
    assert decisions["layers.0.attention.wq"].converted


@pytest.mark.parametrize("flags, message", [
    (["--float8.recipe_name", "blockwise"], r"--float8\.recipe_name blockwise runs natively only on NVIDIA Hopper"),
    (["--float8.recipe_name", "blockwise", "--float8.emulate", "--float8.auto_filter_small_kdims"],
     r"--float8\.auto_filter_small_kdims has no size thresholds for --float8\.recipe_name blockwise"),
    (["--float8.recipe_name", "blockwise", "--float8.emulate", "--float8.enable_fsdp_float8_all_gather"],
     r"only works with --float8\.recipe_name tensorwise"),
], ids=["cpu", "auto-filter", "all-gather"])
def test_blockwise_config_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "float8", *flags], world_size=1)


def test_blockwise_runs_on_a_simulated_hopper() -> None:
    """The hardware rule passes a (simulated) H100 and points a B200 at MX."""
    load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "float8", "--float8.recipe_name",
                     "blockwise", "--estimate.gpu", "H100", "--job.dry_run"], world_size=1)
    with pytest.raises(ConfigError, match=r"On Blackwell, --model.converters mx"):
        load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "float8", "--float8.recipe_name",
                         "blockwise", "--estimate.gpu", "B200", "--job.dry_run"], world_size=1)
