"""Keeping experts evenly loaded between steps: each MoE layer's routed-token counts summed over the ranks that see
different tokens, the auxiliary-loss-free bias update (DeepSeek-V3, arXiv:2408.15664), and the load the metrics
report."""

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan.models.qwen3.model import moe_layers
from titan.train.readback import Readback

NO_EXPERT_METRICS = {"moe_imbalance": None, "tokens_per_expert": None}
"""The load entries of a model without experts."""


class ExpertBalancer:
    """This rank's MoE layers, read after every optimizer step: the step's token counts (all data-parallel and
    context-parallel ranks together) move each expert's routing bias by `coeff` towards the mean load, and stay as
    `last_counts` for the metrics. The counts restart at zero for the next step."""

    def __init__(self, model: nn.Module, coeff: float, dp_cp_mesh: DeviceMesh | None) -> None:
        self.layers = moe_layers(model)
        self.coeff = coeff
        self.mesh = dp_cp_mesh
        self.last_counts: Readback | None = None
        """The routed tokens of the last step, (layers x experts) flattened, on their way to the host."""

    @torch.no_grad()
    def after_optimizer_step(self, skip: Tensor | None) -> None:
        """Read and reset the counts, and move the biases unless the update was skipped (`skip`, a 0-dim bool on
        the device; None: applied)."""
        counts = torch.stack([layer.tokens_per_expert for layer in self.layers.values()])  # (layers, experts)
        if self.mesh is not None and self.mesh.size() > 1:
            counts = funcol.all_reduce(counts, reduceOp="sum", group=self.mesh)
        self.last_counts = Readback(counts.flatten())
        for index, layer in enumerate(self.layers.values()):
            layer.tokens_per_expert.zero_()
            bias = layer.router.expert_bias
            if bias is None:
                continue
            # Experts under the mean load go up, those over it down; sign() makes the step independent of how
            # many tokens were counted (activation checkpointing counts recomputed blocks twice).
            step = self.coeff * torch.sign(counts[index].mean() - counts[index])
            bias.add_(step if skip is None else step * (~skip).to(step.dtype))

    def load_metrics(self) -> dict[str, object]:
        """The last step's load as record entries: moe_imbalance, the most loaded expert's tokens over the mean
        (1.0 is perfect balance), in the worst layer; tokens_per_expert, each layer's counts. Waits only for the
        copy queued after that step's update, not for the step queued since."""
        counts = torch.tensor(self.last_counts.values()).view(len(self.layers), -1)  # (layers, experts)
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1)).max().item()
        per_layer = {name.removesuffix(".moe"): [int(c) for c in row.tolist()]
                     for name, row in zip(self.layers, counts)}
        return {"moe_imbalance": imbalance, "tokens_per_expert": per_layer}


def build_expert_balancer(model: nn.Module, coeff: float, dp_cp_mesh: DeviceMesh | None) -> ExpertBalancer | None:
    """A balancer over the MoE layers of `model` (this rank's share), or None for a model without experts."""
    return ExpertBalancer(model, coeff, dp_cp_mesh) if moe_layers(model) else None
