"""The changes that made Titan's eager step leaner (issue 51), each of which a process can switch off to measure it:
scripts/step_budget.py's before/after, scripts/gpu_check.py's lever rows (through scripts/train_levers_off.py) and
`scripts/benchmark.py ablation` on the CPU. Each lever off restores the code path it replaced, by patching the function
the model calls, so that the model's own code keeps no switch."""

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch.nn.functional as F
from torch import Tensor

from titan.models.common import attention, rotary, swiglu
from titan.models.common.norms import RMSNorm, two_step_rms_norm


def norm_in_two_steps(self: RMSNorm, x: Tensor) -> Tensor:
    """RMSNorm as it was, whatever the weight's dtype."""
    return two_step_rms_norm(x, self.normalized_shape, self.weight, self.eps)


def unfused_gate(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


@dataclass(frozen=True)
class Lever:
    what: str
    """What the lever does, on when the lever is on."""
    off: Callable[[], contextlib.AbstractContextManager]
    """A context in which the lever is off."""


LEVERS: dict[str, Lever] = {
    "fused_norm": Lever("RMSNorm as one F.rms_norm call (a fused kernel on CUDA)",
                        lambda: mock.patch.object(RMSNorm, "forward", norm_in_two_steps)),
    "complex_rope": Lever("eager RoPE as a complex product (the real tables only under compile)",
                          lambda: mock.patch.object(rotary, "complex_rotation", rotary.real_rotation)),
    "fused_swiglu": Lever("SwiGLU's gate as one Triton kernel each way (titan::swiglu)",
                          lambda: mock.patch.object(swiglu, "swiglu", unfused_gate)),
    "saved_flex": Lever("FlexAttention's compiled region visible to selective AC, which saves it",
                        lambda: mock.patch.object(attention, "VISIBLE_REGION_OPTIONS", {})),
}


def unknown_levers(names: Iterable[str]) -> list[str]:
    """The names among `names` that are no key of LEVERS, sorted."""
    return sorted(set(names) - set(LEVERS))


@contextlib.contextmanager
def levers_off(names: Iterable[str]) -> Iterator[None]:
    """The levers `names` (keys of LEVERS) off while active."""
    unknown = unknown_levers(names)
    if unknown:
        raise ValueError(f"no lever {unknown}: the levers are {sorted(LEVERS)}")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(LEVERS[name].off())
        yield
