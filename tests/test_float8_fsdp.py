"""FSDP2's float8 all-gather (titan/quant/float8/fsdp.py): the numerics of the high-precision all-gather, float8
bytes on the wire, and plain high-precision tensors for the optimizer and checkpoints.

Exactness: with the all-gather, each rank casts its shard (rounded to the param dtype first) with the scale of the
full weight's global amax, so the gathered float8 bytes are exactly those Float8Linear computes from a gathered
high-precision weight, and a precomputed amax equals the all-reduced one. Every comparison is therefore bit-exact.
"""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from titan.quant.float8.casts import dequantize, tensorwise_cast
from titan.quant.float8.fsdp import Float8AllGatherWeight, apply_float8_all_gather
from titan.quant.float8.gathered import Float8GatheredWeight
from titan.quant.float8.linear import TENSORWISE_E4M3, Float8Linear, cast_operand
from titan.quant.formats import E4M3

from harness.float8_fsdp_harness import STEPS, VARIANTS
from harness.torchrun import CaseResults, run_cases, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
PAIRS = [("fp32", "fp32_float8_all_gather"), ("fp32", "fp32_float8_all_gather_precompute"),
         ("bf16", "bf16_float8_all_gather"), ("bf16", "bf16_float8_all_gather_precompute"),
         ("uneven", "uneven_float8_all_gather_precompute"), ("fp32", "hsdp_float8_all_gather_precompute")]
FLOAT8_VARIANTS = [name for name, variant in VARIANTS.items() if variant.float8_all_gather]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every variant of tests/harness/float8_fsdp_harness.py, trained on 2 gloo ranks."""
    tmp_path = tmp_path_factory.mktemp("float8_fsdp")
    run_torchrun("float8_fsdp_harness.py", WORLD_SIZE, str(tmp_path / "runs.pt"), str(tmp_path / "checkpoints"))
    return torch.load(tmp_path / "runs.pt")


def assert_equal_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("reference, variant", PAIRS)
def test_same_numerics_as_high_precision_all_gather(runs: dict, reference: str, variant: str) -> None:
    got, expected = runs[variant], runs[reference]
    assert got["losses"] == expected["losses"]
    assert_equal_tensors(got["first_grads"], expected["first_grads"])
    assert_equal_tensors(got["weights"], expected["weights"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_all_gather_moves_float8(runs: dict, name: str) -> None:
    """Each Float8Linear sees the weight FSDP gathered: with the float8 all-gather, float8 data whose buffer (the
    all-gather's output) holds one byte per element, padded rows included."""
    variant = VARIANTS[name]
    for index, (type_name, dtype, num_bytes) in enumerate(runs[name]["gathered"]):
        in_features, out_features = variant.dims[index], variant.dims[index + 1]
        padded_rows = math.ceil(out_features / WORLD_SIZE) * WORLD_SIZE
        if variant.float8_all_gather:
            assert (type_name, dtype) == ("Float8GatheredWeight", E4M3)
            assert num_bytes == padded_rows * in_features
        else:
            assert dtype == variant.param_dtype
            assert num_bytes == padded_rows * in_features * variant.param_dtype.itemsize


@pytest.mark.parametrize("name", FLOAT8_VARIANTS)
def test_gradients_land_on_sharded_parameters(runs: dict, name: str) -> None:
    assert runs[name]["grad_local_shapes_match"]


@pytest.mark.parametrize("name", FLOAT8_VARIANTS)
def test_wrapping_survives_meta_build_to_empty_and_init(runs: dict, name: str) -> None:
    assert runs[name]["num_wrapped"] == 2
    assert runs[name]["wrapped_after_init"] == [True, True]


@pytest.mark.parametrize("name", FLOAT8_VARIANTS)
def test_state_dicts_hold_plain_high_precision_tensors(runs: dict, name: str) -> None:
    run = runs[name]
    assert run["sharded_local_types"] == ["Tensor"]
    assert (run["full_types"], run["full_dtypes"]) == (["Tensor"], ["torch.float32"])


@pytest.mark.parametrize("name", FLOAT8_VARIANTS)
def test_precomputed_amax_is_used_until_the_weight_changes(runs: dict, name: str) -> None:
    """Precomputed after each optimizer step, used by the next step's all-gathers; the optimizer's write and a
    state_dict() (which a checkpoint may load into in place) discard it."""
    run, num_weights = runs[name], 2
    precompute = VARIANTS[name].precompute
    assert run["valid_precomputed_before_forward"] == [0] + [num_weights if precompute else 0] * (STEPS - 1)
    assert run["valid_precomputed_after_step"] == [0] * STEPS
    assert run["valid_precomputed_at_end"] == (num_weights if precompute else 0)
    assert run["valid_precomputed_after_state_dict"] == 0


@pytest.mark.parametrize("name", FLOAT8_VARIANTS)
def test_distributed_checkpoint_round_trip(runs: dict, name: str) -> None:
    """DCP saves the sharded state dict and loads it in place into a fresh wrapped model, which then gives the
    same forward."""
    run = runs[name]
    assert_equal_tensors(run["loaded_weights"], run["weights"])
    assert run["forward_equal"]
    assert run["still_wrapped"] == [True, True]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    """The debug model through Titan's trainer on FSDP=2, every linear float8 tensorwise: with the float8 all-gather
    (scales precomputed) and with the high-precision one."""
    tmp_path = tmp_path_factory.mktemp("trainer_float8_fsdp")
    flags = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--training.steps", "3",
             "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param",
             "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1",
             "--parallelism.data_parallel_shard_degree", "2", "--model.converters", "float8", "--float8.filter_fqns"]
    all_gather = ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
    return run_cases("parallel_harness.py", WORLD_SIZE, tmp_path, {
        name: [*flags, "--job.dump_folder", str(tmp_path / name), *extra]
        for name, extra in (("high_precision", []), ("float8", all_gather))})


def test_trainer_float8_all_gather_matches_high_precision(trainer_runs: CaseResults) -> None:
    """The float8 all-gather with precomputed scales reproduces the high-precision all-gather bit for bit."""
    assert trainer_runs["float8"]["losses"] == trainer_runs["high_precision"]["losses"]
    assert_equal_tensors(trainer_runs["float8"]["weights"], trainer_runs["high_precision"]["weights"])


def expected_all_gather_bytes(parameter_shapes: dict[str, tuple[int, ...]], float8_weight_fqns: set[str]) -> int:
    """Bytes a rank sends to all-gather every parameter once: its dim-0 shard, padded to ceil(rows / ranks) rows as
    FSDP2 pads, one byte per element for weights gathered in float8 and four (fp32) for everything else."""
    return sum(math.ceil(shape[0] / WORLD_SIZE) * math.prod(shape[1:]) * (1 if name in float8_weight_fqns else 4)
               for name, shape in parameter_shapes.items())


def test_trainer_all_gathers_float8_bytes(trainer_runs: CaseResults) -> None:
    """What the trainer's FSDP puts on the wire in one forward: every linear weight (the output projection too) in
    float8, a quarter of the fp32 bytes, so a float8 all-gather that silently falls back to fp32 fails here."""
    high_precision, float8 = trainer_runs["high_precision"], trainer_runs["float8"]
    linear_fqns = float8["float8_linear_fqns"]
    assert len(linear_fqns) == 43 and "output" in linear_fqns  # 6 blocks x 7 linears, and the output projection
    float8_weight_fqns = {f"{fqn}.weight" for fqn in linear_fqns}
    assert float8_weight_fqns <= float8["parameter_shapes"].keys()
    assert high_precision["all_gather_bytes"] == expected_all_gather_bytes(high_precision["parameter_shapes"], set())
    assert float8["all_gather_bytes"] == expected_all_gather_bytes(float8["parameter_shapes"], float8_weight_fqns)


def float8_linear(seed: int = 0) -> Float8Linear:
    torch.manual_seed(seed)
    return Float8Linear.from_linear(nn.Linear(64, 48, bias=False), recipe_name="tensorwise", emulate=False)


def test_wrapped_weight_behaves_like_the_plain_tensor() -> None:
    plain = torch.randn(8, 4)
    wrapped = Float8AllGatherWeight(plain.clone())
    assert type(wrapped * 2) is torch.Tensor and torch.equal(wrapped * 2, plain * 2)
    assert type(wrapped.view(32)) is Float8AllGatherWeight  # FSDP's views of the shard keep the hooks
    assert wrapped.add_(1) is wrapped and torch.equal(wrapped._tensor, plain + 1)


def test_float8_linear_with_wrapped_weight_matches_plain() -> None:
    """Without FSDP, a wrapped Float8Linear computes as before and its weight gets a plain gradient."""
    plain, wrapped = float8_linear(), nn.Sequential(float8_linear())
    assert apply_float8_all_gather(wrapped) == 1
    assert apply_float8_all_gather(wrapped) == 0  # already wrapped
    x = torch.randn(16, 64)
    for module in (plain, wrapped):
        module(x).pow(2).sum().backward()
    torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)
    assert type(wrapped[0].weight.grad) is torch.Tensor
    torch.testing.assert_close(wrapped[0].weight.grad, plain.weight.grad, rtol=0, atol=0)
    state_dict = wrapped.state_dict()
    assert type(state_dict["0.weight"]) is torch.Tensor
    state_dict["0.weight"].zero_()  # a load in place writes into the parameter
    assert not wrapped[0].weight._tensor.any()


def test_gathered_weight_gives_its_data_and_scale_without_recasting() -> None:
    data, scale = tensorwise_cast(torch.randn(48, 64), E4M3)
    gathered = Float8GatheredWeight(data, scale, torch.bfloat16)
    got_data, got_scale = cast_operand(gathered, TENSORWISE_E4M3, contraction_dim=0)
    assert got_data is data and got_scale is scale
    # The forward multiplies by weight^T: a view of the same bytes, with the same scale.
    got_data, got_scale = cast_operand(gathered.t(), TENSORWISE_E4M3, contraction_dim=0)
    assert got_data.data_ptr() == data.data_ptr() and got_data.shape == (64, 48) and got_scale is scale
    # Any other op sees the dequantized weight; writes are refused (FSDP discards the gathered weight).
    torch.testing.assert_close(gathered + 0, dequantize(data, scale, torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="all-gathered float8 weight"):
        gathered.add_(1)


@pytest.mark.parametrize("recipe_name", ["rowwise", "rowwise_with_gw_hp"])
def test_weights_cast_axiswise_are_refused(recipe_name: str) -> None:
    """Both recipes scale the weight per row in the output matmul, which one gathered scale cannot serve."""
    model = nn.Sequential(Float8Linear.from_linear(nn.Linear(64, 48), recipe_name=recipe_name, emulate=False))
    with pytest.raises(ValueError, match="--float8.recipe_name tensorwise"):
        apply_float8_all_gather(model)


def test_tensor_parallel_pieces_are_refused() -> None:
    """Under TP the shard is a piece of a TP-local weight, whose amax would not be the full weight's."""
    model = nn.Sequential(float8_linear())
    apply_float8_all_gather(model)
    with pytest.raises(NotImplementedError, match="--parallelism.tensor_parallel_degree"):
        model[0].weight.fsdp_pre_all_gather(None, torch.Size([24, 64]), (64, 1), model[0], None)
