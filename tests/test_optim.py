"""Optimizer kernels: fused AdamW (the default) against foreach and the for-loop reference, and the device fallback."""

import pytest
import torch
from torch import nn

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.config.job import Optimizer
from titan.train.optim import build_optimizer, kernel_for_device


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
