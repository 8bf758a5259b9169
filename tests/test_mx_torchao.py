"""MX quantization and MXLinear against torchao itself, in both scale roundings (--mx.recipe_name mxfp8: floor;
mxfp8_rceil: rceil): the scale codes and elements against torchao's to_mx, every positive finite bfloat16 amax
included, and output, grad_input and grad_weight against torchao's emulated MXFP8 linear (mx_mm), bit for bit. The
edges where Titan differs on purpose (docs/mx.md) are pinned, so that any other difference fails. The experts'
grouped matmuls against torchao in both roundings: tests/test_moe_low_precision.py.

Needs torchao (the `test` extra), so it is not in the torch 2.11 subset of .ci/run. torchao prints "Failed to load
..._C_mxfp8..." on import on CPU: its CUDA extensions, which nothing here uses.
"""

import pytest
import torch
from torch import Tensor
from torchao.prototype.moe_training.mxfp8_linear import mx_mm
from torchao.prototype.mx_formats.config import (
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.quantization.quantize_.common import KernelPreference

from titan.quant.formats import E4M3
from titan.quant.mx.linear import RECIPES, MXMatmul
from titan.quant.mx.numerics import torch_quantize

MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
ROUNDINGS = [pytest.param(rounding, id=rounding) for rounding in MODES]
INPUT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def wide_range(rows: int, cols: int, dtype: torch.dtype, seed: int) -> Tensor:
    """Normal values, each row scaled by 10^-8 .. 10^7, so that blocks take scales far apart."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator)
            * 10.0 ** torch.randint(-8, 8, (rows, 1), generator=generator)).to(dtype)


def torchao_codes(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    """(uint8 scale codes, uint8 element codes) of torchao's to_mx, blocks of 32 along the last dim."""
    scales, data = to_mx(x, E4M3, 32, MODES[rounding])
    return scales.view(torch.uint8), data.view(torch.uint8)


def titan_codes(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    codes, data = torch_quantize(x, 32, E4M3, -1, rounding)
    return codes, data.view(torch.uint8)


def test_the_recipes_round_as_named() -> None:
    assert RECIPES == {"mxfp8": "floor", "mxfp8_rceil": "rceil"}


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_scales_and_elements_equal_torchaos(dtype: torch.dtype, rounding: str) -> None:
    x = wide_range(96, 256, dtype, seed=1)
    x[0] = 0  # all-zero blocks
    got, want = titan_codes(x, rounding), torchao_codes(x, rounding)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_every_bfloat16_amax_takes_torchaos_scale(rounding: str) -> None:
    """One block per positive finite bfloat16 value, that value its amax (with smaller elements beside it): the same
    scale code and elements as torchao's, but for the amaxes that the pinned edges below name."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16)  # every positive finite bf16 bit pattern
    blocks = amax[:, None] * torch.linspace(-1, 1, 32, dtype=torch.float32)[None].to(torch.bfloat16)
    blocks[:, -1] = amax
    got, want = titan_codes(blocks, rounding), torchao_codes(blocks, rounding)
    same_scale = got[0][:, 0] == want[0][:, 0]
    # floor: torchao divides a block with code 0 by 2**-126 (clamping the scale), Titan by the spec's 2**-127;
    # rceil: an amax / 448 below 2**-126 (fp32 subnormal) takes code 0 in torchao and the next power of two in Titan.
    edge = amax.float() < (2.0**-118 if rounding == "floor" else 448 * 2.0**-126)
    assert same_scale[~edge].all(), amax[~edge & ~same_scale][:4]
    assert torch.equal(got[1][~edge], want[1][~edge])
    assert edge.any() and not torch.equal(got[1][edge], want[1][edge])


def test_rceil_rounds_up_on_the_bits_where_torchaos_eager_log2_does_not() -> None:
    """fp32 amaxes an ulp above 448 x 2^k: amax / 448 is above a power of two, so it rounds up to the next one (as
    Blackwell's cvt.rp.satfinite.ue8m0 and torchao's Triton kernel do); torchao's eager ceil(log2(.)) in fp32 rounds
    log2 to the integer first and keeps the power below, which then saturates the block's largest element."""
    powers = 448.0 * torch.exp2(torch.arange(-20, 20, dtype=torch.float32))
    amax = torch.nextafter(powers, torch.tensor(float("inf")))
    blocks = torch.zeros(len(amax), 32)
    blocks[:, 0] = amax
    got, want = titan_codes(blocks, "rceil"), torchao_codes(blocks, "rceil")
    exponent = torch.arange(-20, 20)
    assert torch.equal(got[0][:, 0].long(), exponent + 127 + 1)
    apart = got[0][:, 0] != want[0][:, 0]
    assert apart.any() and torch.equal(want[0][apart, 0].long(), exponent[apart] + 127)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_mx_linear_equals_torchaos_emulated_linear(dtype: torch.dtype, rounding: str) -> None:
    """output, grad_input and grad_weight of Titan's emulated MX matmul against torchao's mx_mm, emulated, with its
    casts in torch ops (the CUDA dim1 cast kernel is its GPU default): the same bits."""
    x, weight, grad = wide_range(64, 256, dtype, 2), wide_range(96, 256, dtype, 3) * 0.1, wide_range(64, 96, dtype, 4)
    x_ref, weight_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out_ref = mx_mm.apply(x_ref, weight_ref, E4M3, E4M3, E4M3, 32, KernelPreference.EMULATED,
                          MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH, MODES[rounding], False)
    out_ref.backward(grad)
    x_got, weight_got = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = MXMatmul.apply(x_got, weight_got, True, rounding)
    out.backward(grad)
    assert torch.equal(out, out_ref)
    assert torch.equal(x_got.grad, x_ref.grad) and torch.equal(weight_got.grad, weight_ref.grad)
