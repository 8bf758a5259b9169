"""MXLinear numerics against the spec reference, the scale layout for native kernels, the conversion rules and
report shared with float8, config errors, and MX training on the debug model."""

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from titan.config.errors import ConfigError
from titan.config.job import MX, NVFP4, Float8
from titan.quant.convert import apply_converters, apply_mx, format_report
from titan.quant.float8.linear import Float8Linear
from titan.quant.mx.blocked import to_blocked
from titan.quant.mx.linear import MXLinear
from titan.validate import load_job_config

from harness.debug_training import DEBUG_TOML, train_losses
from harness.linears import run_linear, sqnr_db
from reference import float8_ref, mx_ref


def spec_mx_values(x: Tensor, dim: int) -> Tensor:
    """The values MXFP8 (E4M3) stores for x, blocks of 32 along `dim`, zero-padded to whole blocks: from the
    spec reference."""
    moved = x.detach().movedim(dim, -1)
    pad = -moved.shape[-1] % 32
    moved = torch.nn.functional.pad(moved, (0, pad))
    codes, elements = mx_ref.quantize(float8_ref.E4M3, moved)
    values = mx_ref.dequantize(float8_ref.E4M3, codes, elements).float()
    return values[..., :x.shape[dim]].movedim(-1, dim)


@pytest.mark.parametrize("tokens", [64, 37], ids=["whole-blocks", "padded-tokens"])
def test_mx_linear_matches_spec_reference(tokens: int) -> None:
    """Each matmul is the product of the spec's MX values of both operands, blocked along its contraction dim;
    37 tokens make grad_weight's contraction a partial block, which is zero-padded."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    mx = MXLinear.from_linear(linear, recipe_name="mxfp8", emulate=True)
    x, grad = torch.randn(tokens, 64) * 3, torch.randn(tokens, 96)
    out, grad_input, grad_weight = run_linear(mx, x, grad).values()
    weight = linear.weight.detach()
    torch.testing.assert_close(out, spec_mx_values(x, -1) @ spec_mx_values(weight, -1).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_input, spec_mx_values(grad, -1) @ spec_mx_values(weight, 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_weight, spec_mx_values(grad, 0).t() @ spec_mx_values(x, 0), rtol=1e-5, atol=1e-5)


def test_mx_linear_close_to_linear() -> None:
    """Within MX error: E4M3 keeps 3 mantissa bits, and the floor scale saturates the top of some blocks, ~25 dB."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    mx = MXLinear.from_linear(nn.Linear(64, 96), recipe_name="mxfp8", emulate=True)
    mx.load_state_dict(linear.state_dict())
    x, grad = torch.randn(4, 8, 64), torch.randn(4, 8, 96)
    for got, want in zip(run_linear(mx, x, grad).values(), run_linear(linear, x, grad).values(), strict=True):
        assert got.shape == want.shape
        assert sqnr_db(want, got) > 22


def test_mx_linear_under_autocast_and_bf16() -> None:
    torch.manual_seed(0)
    mx = MXLinear.from_linear(nn.Linear(64, 32), recipe_name="mxfp8", emulate=True)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mx(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and mx.weight.grad.dtype == torch.float32


def test_compiled_mx_linear_matches_eager() -> None:
    torch.manual_seed(0)
    mx = MXLinear.from_linear(nn.Linear(64, 96, bias=False), recipe_name="mxfp8", emulate=True)
    x, grad = torch.randn(40, 64), torch.randn(40, 96)
    eager = run_linear(mx, x, grad)
    torch._dynamo.reset()
    compiled = run_linear(torch.compile(mx, fullgraph=True), x, grad)
    for got, want in zip(compiled.values(), eager.values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocked_scale_layout() -> None:
    """cuBLAS's layout: 128 x 4 tiles of 512 bytes in row-major tile order; in a tile, row r and column c at byte
    (r % 32) * 16 + (r // 32) * 4 + c; rows and columns padded with zeros to whole tiles."""
    rows, cols = 200, 6
    codes = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    blocked = to_blocked(codes)
    num_col_tiles = -(-cols // 4)
    assert blocked.numel() == 256 * num_col_tiles * 4
    want = torch.zeros_like(blocked)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * num_col_tiles + c // 4
            want[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4] = codes[r, c]
    assert torch.equal(blocked, want)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(64, 128, bias=False)
        self.feed_forward = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(48, 64, bias=False)  # divisible by 16 (float8) but not by 32 (MX)
        self.output = nn.Linear(64, 2304, bias=False)


def decisions_by_fqn(decisions: list) -> dict:
    return {d.fqn: d for d in decisions}


def test_conversion_rules_and_report() -> None:
    model = Toy()
    decisions = decisions_by_fqn(apply_mx(model, MX(emulate=True), tp_degree=1))
    assert isinstance(model.attention, MXLinear) and isinstance(model.feed_forward, MXLinear)
    assert type(model.odd) is nn.Linear and type(model.output) is nn.Linear
    assert decisions["odd"].result == "skipped: 64x48 not divisible by the MX block size 32"
    assert decisions["output"].result == "skipped: matches --mx.filter_fqns 'output'"
    assert decisions["attention"].result == "mx mxfp8 (emulated)"
    report = format_report(list(decisions.values()))
    assert "2 of 4 linear layers converted" in report and "2304x64" in report


def test_filters_and_tensor_parallel_shards() -> None:
    model = Toy()
    decisions = decisions_by_fqn(apply_mx(model, MX(filter_fqns=[]), tp_degree=2))
    assert isinstance(model.output, MXLinear)  # an empty filter converts the output projection too
    assert "emulated" not in decisions["output"].result
    assert decisions["attention"].converted  # 128x64 splits into 2 shards of 64x64 or 128x32
    model = nn.ModuleDict({"proj": nn.Linear(64, 96)})
    decisions = decisions_by_fqn(apply_mx(model, MX(), tp_degree=2))
    # a colwise shard would hold 48 of the 96 rows: one and a half blocks
    assert decisions["proj"].result == "skipped: 96x64 does not split into 2 TP shards of whole 32-element MX blocks"


def test_float8_and_mx_must_split_the_layers() -> None:
    with pytest.raises(ConfigError) as error:
        apply_converters(Toy(), ["float8", "mx"], Float8(), MX(), NVFP4(), tp_degree=1, fsdp_enabled=False,
                         print_after_conversion=False)
    message = str(error.value)
    assert "--model.converters float8 and mx would both convert 2 linear layers (attention, feed_forward)" in message
    assert "--float8.filter_fqns" in message and "--mx.filter_fqns" in message

    model = Toy()
    decisions = decisions_by_fqn(apply_converters(
        model, ["float8", "mx"], Float8(filter_fqns=["output", "feed_forward"]),
        MX(filter_fqns=["output", "attention"]), NVFP4(), tp_degree=1, fsdp_enabled=False,
        print_after_conversion=False).decisions)
    assert isinstance(model.attention, Float8Linear) and isinstance(model.feed_forward, MXLinear)
    assert isinstance(model.odd, Float8Linear)  # mx cannot take it, float8 can
    assert decisions["output"].result == ("skipped: matches --float8.filter_fqns 'output'; "
                                          "skipped: matches --mx.filter_fqns 'output'")
    assert len(decisions) == 4


def test_print_after_conversion(titan_records: list[logging.LogRecord]) -> None:
    with torch.device("meta"):
        model = Toy()
    apply_converters(model, ["mx"], Float8(), MX(emulate=True), NVFP4(), tp_degree=1, fsdp_enabled=False,
                     print_after_conversion=True)
    log = "\n".join(record.getMessage() for record in titan_records)
    assert "Model conversion report" in log
    assert "MXLinear(in_features=64, out_features=128, bias=False, mx=mxfp8, emulated)" in log


def test_mx_needs_blackwell_or_emulate() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs MX natively")
    with pytest.raises(ConfigError, match="--model.converters mx runs natively only on NVIDIA GPUs with compute "
                                          "capability 10.0 or newer.*Add --mx.emulate"):
        load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "mx"], world_size=1)
    cfg = load_job_config(["--job.config_file", DEBUG_TOML, "--model.converters", "mx", "--mx.recipe_name", "mxfp8",
                           "--mx.filter_fqns", "output", "attention", "--mx.emulate"], world_size=1)
    assert cfg.mx == MX(recipe_name="mxfp8", filter_fqns=["output", "attention"], emulate=True)


def test_debug_model_trains_in_mxfp8(tmp_path: Path, fp32_debug_losses: list[float]) -> None:
    """Short CI version of scripts/bench_mx.py --loss-curve: 15 steps, MXFP8 tracks fp32 closely."""
    fp32 = fp32_debug_losses
    mx = train_losses(tmp_path / "mx", "--training.steps", "15", "--model.converters", "mx", "--mx.emulate")
    assert all(math.isfinite(loss) for loss in mx)
    assert mx[-1] < mx[0] - 0.5
    assert abs(mx[-1] - fp32[-1]) < 0.05, (mx[-1], fp32[-1])
