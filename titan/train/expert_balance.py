"""Keeping experts evenly loaded between steps: each MoE layer's routed-token counts summed over the ranks that see
different tokens, the auxiliary-loss-free bias update (DeepSeek-V3, arXiv:2408.15664), and the load the metrics
report, for every layer of the model, whichever pipeline stage holds it."""

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan.models.common.moe import MoEArgs, moe_layers
from titan.train.readback import Readback

NO_EXPERT_METRICS = {"moe_imbalance": None, "tokens_per_expert": None}
"""The load entries of a model without experts."""


def moe_layers_by_block(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE layers of `model` (a whole model or this rank's pipeline stages, which keep the whole model's FQNs)
    by the index of their block, layers.<index>, in the whole model."""
    return {int(name.split(".")[1]): layer for name, layer in moe_layers(model).items()}


class ExpertBalancer:
    """This rank's MoE layers, read after every optimizer step: the step's token counts (all data-parallel and
    context-parallel ranks together) move each expert's routing bias by `coeff` towards the mean load, and, with
    every pipeline stage's counts, stay as `last_counts` for the metrics. The counts restart at zero for the next
    step."""

    def __init__(self, model: nn.Module, num_blocks: int, num_experts: int, coeff: float,
                 count_mesh: DeviceMesh | None, device: torch.device) -> None:
        """`num_blocks`, `num_experts`: the whole model's blocks and each MoE layer's experts. `count_mesh`: the ranks
        whose counts add up, every pipeline stage's and every data- and context-parallel rank's (Meshes.loss); None on
        one process. A pipeline rank whose stages hold only dense blocks has no layers of its own, but joins the
        all-reduce all the same: its peers run it over every rank of the mesh."""
        self.layers = dict(sorted(moe_layers_by_block(model).items()))
        self.num_blocks = num_blocks
        self.num_experts = num_experts
        self.device = device
        self.coeff = coeff
        self.mesh = count_mesh
        self.last_counts: Readback | None = None
        """The last step's table over every block, (blocks x (experts + 1)) flattened, on its way to the host: a
        MoE block's routed tokens per expert, then how many ranks counted them (0 for a dense block)."""

    @torch.no_grad()
    def after_optimizer_step(self, skip: Tensor | None) -> None:
        """Read and reset the counts, and move the biases unless the update was skipped (`skip`, a 0-dim bool on
        the device; None: applied)."""
        table = self.count_table()
        if self.mesh is not None and self.mesh.size() > 1:
            # One all-reduce gives both: a block's row is non-zero only on the pipeline stage that holds it, so the
            # sum over pp x dp x cp is, in this rank's rows, the sum over its data- and context-parallel peers.
            table = funcol.all_reduce(table, reduceOp="sum", group=self.mesh)
        self.last_counts = Readback(table.flatten())
        for index, layer in self.layers.items():
            layer.tokens_per_expert.zero_()
            bias = layer.router.expert_bias
            if bias is None:
                continue
            counts = table[index, :-1]
            # Experts under the mean load go up, those over it down, by the same step however many tokens there
            # were (DeepSeek-V3's sign update).
            step = self.coeff * torch.sign(counts.mean() - counts)
            bias.add_(step if skip is None else step * (~skip).to(step.dtype))

    def count_table(self) -> Tensor:
        """(blocks, experts + 1) on the device: this rank's MoE blocks' counts and a 1 after them, zero rows for
        the blocks other stages hold. Stacked, not indexed into, so no index tensor travels from the host."""
        rows = {index: torch.cat([layer.tokens_per_expert, torch.ones_like(layer.tokens_per_expert[:1])])
                for index, layer in self.layers.items()}
        absent = torch.zeros(self.num_experts + 1, device=self.device)
        return torch.stack([rows.get(index, absent) for index in range(self.num_blocks)])

    def load_metrics(self) -> dict[str, object]:
        """The last step's load over every MoE layer of the model as record entries: moe_imbalance, the most loaded
        expert's tokens over the mean (1.0 is perfect balance), in the worst layer; tokens_per_expert, each layer's
        counts by its block's FQN, in model order. Waits only for the copy queued after that step's update, not for
        the step queued since; the rest is Python on the host."""
        values = self.last_counts.values()
        width = len(values) // self.num_blocks  # experts + 1
        rows = [values[index * width:(index + 1) * width] for index in range(self.num_blocks)]
        per_layer = {f"layers.{index}": [int(count) for count in row[:-1]]
                     for index, row in enumerate(rows) if row[-1] > 0}
        imbalance = max(max(counts) / max(sum(counts) / len(counts), 1) for counts in per_layer.values())
        return {"moe_imbalance": imbalance, "tokens_per_expert": per_layer}


def build_expert_balancer(model: nn.Module, moe: MoEArgs | None, coeff: float, count_mesh: DeviceMesh | None,
                          device: torch.device) -> ExpertBalancer | None:
    """A balancer over the MoE layers of `model` (this rank's share, whose `args` give the whole model's blocks),
    or None when the whole model has no experts (`moe`, the whole model's MoEArgs: None for a dense flavor), on
    every rank alike. `count_mesh`: see ExpertBalancer."""
    if moe is None:
        return None
    return ExpertBalancer(model, model.args.n_layers, moe.num_experts, coeff, count_mesh, device)
