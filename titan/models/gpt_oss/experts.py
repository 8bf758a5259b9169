"""GPT-OSS's expert: a clamped SwiGLU with a sigmoid gain, over the shared experts' matmuls by name
(titan/models/common/moe.py ExpertFunction). transformers' GptOssExperts._apply_gate is the reference."""

from dataclasses import dataclass

import torch
from torch import Tensor

from titan.models.common.moe import GroupedLinear


@dataclass(frozen=True)
class ClampedSwiGLU:
    """w2((up + 1) * gate * sigmoid(alpha * gate)) + biases, with gate = w1 x clamped above at `limit` and up = w3 x
    clamped to [-limit, limit]. A zero row stays a zero row (gate 0 gives 0 whatever up is), as padded low-precision
    blocks need."""

    alpha: float = 1.702
    """The sigmoid's gain: gate * sigmoid(1.702 gate) approximates GELU."""
    limit: float = 7.0
    """Clamp of the gate (above) and of the up projection (both sides), which bounds activations in low precision."""

    def __call__(self, x: Tensor, linear: GroupedLinear) -> Tensor:
        gate = linear(x, "w1").clamp(max=self.limit)
        up = linear(x, "w3").clamp(min=-self.limit, max=self.limit)
        return linear((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), "w2")
