"""Optimizer kernels: fused AdamW (the default) against foreach and the for-loop reference, and the device fallback;
parameter groups; bfloat16 optimizer state (BF16StateAdam) against torch's Adam and torchao's stochastic rounding."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from titan.config.errors import ConfigError
from titan.config.job import Optimizer
from titan.train.bf16_state import BF16StateAdam, round_with, rounding_bits, rounding_keys
from titan.train.optim import build_optimizer, kernel_for_device
from titan.validate import load_job_config


def train_copies(implementation: str, steps: int = 5) -> list[torch.Tensor]:
    """A small MLP after `steps` AdamW steps on fixed random batches, with the given kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 8))
    optimizer = build_optimizer(model, Optimizer(lr=1e-2, weight_decay=0.1, implementation=implementation))
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_kernels_match_for_loop(implementation: str) -> None:
    """The fused kernel computes AdamW's update in one pass, in a different order of fp32 operations than the
    for-loop: equal to fp32 rounding (the step size 1e-2 makes differences visible if the math were off)."""
    for got, want in zip(train_copies(implementation), train_copies("for-loop"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(train_copies("fused", steps=1)[0], train_copies("fused", steps=2)[0])


def test_fused_is_the_default_and_used_on_cpu() -> None:
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, Optimizer())
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]


def test_device_without_fused_kernel_falls_back_to_foreach() -> None:
    assert kernel_for_device("fused", "cpu") == "fused"
    assert kernel_for_device("fused", "meta") == "foreach"
    assert kernel_for_device("for-loop", "meta") == "for-loop"


class Toy(nn.Module):
    """An embedding, a norm and a biased output layer: one parameter of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.norm = nn.RMSNorm(4)
        self.output = nn.Linear(4, 8)


def settings_by_fqn(model: nn.Module, cfg: Optimizer) -> dict[str, tuple[float, float]]:
    """(weight decay, learning rate) of each parameter's group."""
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    return {names[id(param)]: (group["weight_decay"], group["lr"])
            for group in build_optimizer(model, cfg).param_groups for param in group["params"]}


def test_groups_leave_norms_biases_and_embeddings_undecayed_and_scale_learning_rates() -> None:
    model = Toy()
    cfg = Optimizer(lr=1e-3, weight_decay=0.1, lr_multipliers=["tok_embeddings=0.5", "output=2"])
    assert settings_by_fqn(model, cfg) == {"tok_embeddings.weight": (0.0, 5e-4), "norm.weight": (0.0, 1e-3),
                                           "output.weight": (0.1, 2e-3), "output.bias": (0.0, 2e-3)}
    everything = Optimizer(lr=1e-3, weight_decay=0.1, decay_norm_and_bias=True, decay_embeddings=True)
    assert set(settings_by_fqn(model, everything).values()) == {(0.1, 1e-3)}


def test_malformed_lr_multipliers_are_config_errors() -> None:
    with pytest.raises(ConfigError) as error:
        load_job_config(["--optimizer.lr_multipliers", "tok_embeddings", "output=-1", "norm=2"], world_size=1)
    assert str(error.value).count("--optimizer.lr_multipliers") == 2 and "'norm=2'" not in str(error.value)


def test_stochastic_rounding_is_torchaos() -> None:
    """The same rounding as torchao's bf16 stochastic rounding (torchao.optim), bit for bit from the same random
    bits, including negatives, subnormals, values already in bfloat16, and infinities."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    values = torch.cat([torch.randn(4096) * 10.0 ** torch.randint(-40, 30, (4096,)),
                        torch.tensor([0.0, -0.0, 1.0, -3.5, 1e-40, float("inf"), float("-inf")])])
    torch.manual_seed(3)
    theirs = _fp32_to_bf16_sr(values)
    torch.manual_seed(3)  # torchao draws its bits so
    ours = round_with(values, torch.randint(0, 1 << 16, values.shape, dtype=torch.int32))
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def test_rounding_bits_are_uniform_and_a_function_of_their_inputs() -> None:
    """The bits are the same wherever (element, step, parameter, moment) are (so replicated ranks round alike and a
    resume continues them), change with each, and are uniform: 2^20 of them in 16 buckets by their top and by their
    bottom 4 bits pass a chi-square test at p = 0.001 (37.7 for 15 degrees of freedom)."""
    numel = 1 << 20
    keys = rounding_keys(torch.tensor(7.0), param_index=3)
    bits = rounding_bits(numel, keys[0])
    assert torch.equal(bits, rounding_bits(numel, rounding_keys(torch.tensor(7.0), 3)[0]))
    for other in (rounding_keys(torch.tensor(8.0), 3)[0], rounding_keys(torch.tensor(7.0), 4)[0], keys[1]):
        assert (rounding_bits(numel, other) == bits).float().mean() < 0.001
    assert bits.min() >= 0 and bits.max() < 1 << 16
    for buckets in (bits >> 12, bits & 0xF):
        counts = torch.bincount(buckets, minlength=16).float()
        assert ((counts - numel / 16) ** 2 / (numel / 16)).sum() < 37.7


def test_stochastic_rounding_keeps_increments_that_nearest_rounding_loses() -> None:
    """Adam's second moment with beta2 = 0.999 at 1.0, gradients^2 at 2.0: each step adds 0.001, under half of
    bfloat16's spacing at 1.0 (2^-7), so round-to-nearest never moves it; stochastic rounding follows the exact
    value on average (over 256 copies, each with its own bits), within a few percent of the distance travelled."""
    exact = torch.ones(())
    nearest = torch.ones((), dtype=torch.bfloat16)
    stochastic = torch.ones(256, dtype=torch.bfloat16)
    for step in range(200):
        exact = exact.lerp(torch.tensor(2.0), 0.001)
        nearest = nearest.float().lerp(torch.tensor(2.0), 0.001).bfloat16()
        bits = rounding_bits(256, rounding_keys(torch.tensor(float(step)), 0)[1])
        stochastic = round_with(stochastic.float().lerp(torch.full((256,), 2.0), 0.001), bits)
    assert nearest.item() == 1.0 and exact.item() == pytest.approx(1.1814, abs=1e-4)
    assert stochastic.float().mean().item() == pytest.approx(exact.item(), abs=0.05 * (exact.item() - 1))


def mlp_after_steps(optimizer_for: Callable[[list[dict]], torch.optim.Optimizer], steps: int = 5,
                    skip_at: int | None = None) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The MLP of train_copies in two groups (decayed matrices, undecayed biases) after `steps` updates; with
    `skip_at`, that step's gradients hold a NaN and an inf, as the steps the trainer skips do, and its update is
    skipped through found_inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 8))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    optimizer = optimizer_for([{"params": matrices, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}])
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == skip_at:
            matrices[0].grad[0, 0] = float("nan")
            biases[-1].grad[0] = float("inf")
            optimizer.found_inf = torch.ones(())
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
    return [p.detach().clone() for p in model.parameters()], optimizer


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_float32_state_is_torchs_adam(decoupled: bool) -> None:
    """With its moments unrounded (float32), BF16StateAdam's update is torch's Adam(W), to fp32 rounding: the
    rounding to bfloat16 is the only change."""
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    got, _ = mlp_after_steps(lambda groups: BF16StateAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                                          weight_decay=0.1, decoupled=decoupled,
                                                          state_dtype=torch.float32))
    want, _ = mlp_after_steps(lambda groups: torch_class(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False))
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_bf16_state_is_bfloat16_and_close_to_float32() -> None:
    build = lambda dtype: lambda groups: BF16StateAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,  # noqa: E731
                                                       weight_decay=0.1, decoupled=True, state_dtype=dtype)
    got, optimizer = mlp_after_steps(build(torch.bfloat16))
    want, _ = mlp_after_steps(build(torch.float32))
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state["step"].item() == 5
    # torch's load_state_dict casts states to the parameters' dtype; a resume must keep them bfloat16, unchanged
    saved = {key: value.clone() for key, value in state.items()}
    optimizer.load_state_dict(optimizer.state_dict())
    loaded = next(iter(optimizer.state.values()))
    assert all(loaded[key].dtype == saved[key].dtype and torch.equal(loaded[key], saved[key]) for key in saved)
    for ours, reference in zip(got, want, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-3)  # 5 steps of 1e-2, moments off by <2^-8


def optimizer_states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor (step counts and moments) of every parameter, in parameter order, as copies."""
    return [value.clone() for state in optimizer.state.values() for value in state.values()]


SKIPPING_OPTIMIZERS = {
    "bf16 state": lambda groups: BF16StateAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                               decoupled=True, state_dtype=torch.bfloat16),
    "float32 state": lambda groups: BF16StateAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                                  decoupled=True, state_dtype=torch.float32),
    "fused AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True),
}
"""The optimizers the trainer skips an update of through found_inf (TrainingStep.skips_on_device)."""


@pytest.mark.parametrize("name", SKIPPING_OPTIMIZERS)
def test_found_inf_skips_the_whole_update(name: str) -> None:
    """A step skipped through found_inf, with a NaN and an inf among its gradients as a skipped step has, leaves
    weights, moments and step counts bit for bit as they were: 3 steps with the 3rd skipped end where 2 steps do.
    5 steps with the 3rd skipped count 4 updates and go on past the skip."""
    build = SKIPPING_OPTIMIZERS[name]
    first_two, two_steps = mlp_after_steps(build, steps=2)
    three, skipped_third = mlp_after_steps(build, steps=3, skip_at=3)
    for after_skip, before in zip(three + optimizer_states(skipped_third), first_two + optimizer_states(two_steps),
                                  strict=True):
        assert after_skip.dtype == before.dtype and torch.equal(after_skip, before)
    skipped, optimizer = mlp_after_steps(build, steps=5, skip_at=3)
    assert all(state["step"].item() == 4 for state in optimizer.state.values())
    assert all(param.isfinite().all() for param in skipped)
    assert not all(torch.equal(a, b) for a, b in zip(skipped, three, strict=True))


def test_state_dtype_bfloat16_builds_bf16_state_adam() -> None:
    optimizer = build_optimizer(nn.Linear(4, 4), Optimizer(state_dtype="bfloat16"))
    assert isinstance(optimizer, BF16StateAdam) and optimizer.decoupled
    assert not build_optimizer(nn.Linear(4, 4), Optimizer(name="Adam", state_dtype="bfloat16")).decoupled
