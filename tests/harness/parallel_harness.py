"""Run a few Titan train steps under torchrun and save the losses and final full weights, for parity tests: every
case of one world size in one launch (tests/harness/torchrun.py run_cases).

    torchrun --nproc_per_node 2 tests/harness/parallel_harness.py FOLDER CASES.json

The whole pipeline is Titan's own (data, parallelize, init, loss, clipping, optimizer). A reference run for D
data-parallel ranks of batch B is one process of batch B x D: the data order is global, so it trains on exactly
the global batches the D ranks see. Under FSDP it also saves what one more forward put on the wire: the bytes
each rank sent into all-gathers.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

# Run as a script (torchrun, titan.launch): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.metrics.log import init_logger  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.quant.float8.linear import Float8Linear  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402
from titan.validate import load_job_config  # noqa: E402

from harness.torchrun import finish_rank, run_each_case  # noqa: E402
from harness.trainer_probe import run_case as run_probe  # noqa: E402

PROBE_CASE = "probe"
"""A case whose flags start with this is a probe of tests/harness/trainer_probe.py (its flags follow): the parity
tests' launches run their probes too, since starting the ranks costs more than a case."""


class AllGatherBytes(TorchDispatchMode):
    """Counts the bytes this rank sends into c10d all-gathers, the collective FSDP2 gathers parameters with."""

    def __init__(self) -> None:
        super().__init__()
        self.num_bytes = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        if func is torch.ops.c10d._allgather_base_.default:
            sent = args[1]  # (output, input, process group, async_op)
            self.num_bytes += sent.numel() * sent.element_size()
        return func(*args, **(kwargs or {}))


def forward_wire_record(trainer: Trainer, inputs: torch.Tensor) -> dict:
    """The bytes this rank sends in the all-gathers of one forward, with what they should add up to: each
    parameter's (global) shape, and which linears are Float8Linear. The last backward resharded every parameter,
    so the forward gathers each of them once."""
    counter = AllGatherBytes()
    with torch.no_grad(), counter:
        trainer.training.model(inputs.to(trainer.device))
    return {"all_gather_bytes": counter.num_bytes,
            "parameter_shapes": {name: tuple(p.shape) for name, p in trainer.training.model.named_parameters()},
            "float8_linear_fqns": sorted(fqn for fqn, module in trainer.training.model.named_modules()
                                         if isinstance(module, Float8Linear))}


def rank_0_metrics(trainer: Trainer) -> list[dict]:
    """The training records rank 0 wrote to metrics.jsonl (the only rank that writes it); empty on the other ranks."""
    path = trainer.dump_folder / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if trainer.rank == 0 else []
    return [record for record in records if "loss" in record]


def replicated_over_tp(param: DTensor) -> bool:
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(param.placements[names.index("tp")], Replicate)


def replicated_by_tp_rank(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Each tensor-parallel rank's own copy (its FSDP shard, if any) of every parameter that TP replicates (the
    norms), in TP rank order: copies that must stay bit for bit the same, which the full state dict, taking one
    rank's, cannot show."""
    own = {name: param.to_local().detach().clone() for name, param in trainer.training.model.named_parameters()
           if isinstance(param, DTensor) and replicated_over_tp(param)}
    copies: list[dict] = [{} for _ in range(trainer.dims.tp)]
    dist.all_gather_object(copies, own, group=trainer.training.meshes.tp.get_group())
    return copies


def run_case(flags: list[str], world_size: int) -> dict:
    """The losses of the job `flags`, its final full weights, its validation loss, rank 0's metrics records, under
    TP each TP rank's copy of the replicated parameters and, under FSDP alone, what one more forward put on the
    wire."""
    trainer = Trainer(load_job_config(flags, world_size), world_size)
    data = iter(trainer.dataloader)
    losses = []
    for _ in range(trainer.cfg.training.steps):
        trainer.step += 1
        trainer.train_step(data)
        losses.append(trainer.finish_step().loss)
    if not trainer.dims.dp_enabled and world_size == 1:
        weights = {name: value.detach().cpu() for name, value in trainer.training.model.state_dict().items()}
    elif trainer.dims.pp_enabled:
        # Each pipeline rank holds its stages' weights: gather every rank's full tensors and merge them.
        own = get_model_state_dict(trainer.training.model, options=StateDictOptions(full_state_dict=True))
        shares: list[dict] = [{} for _ in range(world_size)]
        dist.all_gather_object(shares, {name: value.detach().cpu() for name, value in own.items()})
        weights = {name: value for share in shares for name, value in share.items()}
    else:
        weights = get_model_state_dict(trainer.training.model,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = {"losses": losses, "weights": weights, "metrics": rank_0_metrics(trainer)}
    if trainer.dims.tp_enabled:
        result["replicated_by_tp_rank"] = replicated_by_tp_rank(trainer)
    if trainer.validation_batches is not None:
        # Evaluation under the same layout: the held-out loss of the trained weights, the same on every layout.
        result["val_loss"] = trainer.run_validation().loss
    # A pipeline has no single forward to record, and under context parallel a forward takes the tokens' CP shard.
    if trainer.dims.dp_shard > 1 and not (trainer.dims.pp_enabled or trainer.dims.cp_enabled):
        result.update(forward_wire_record(trainer, next(data)[0]))
    return result


def run_parity_case_or_probe(flags: list[str], world_size: int) -> dict:
    if flags[:1] == [PROBE_CASE]:
        return run_probe(flags[1:], world_size)
    return run_case(flags, world_size)


if __name__ == "__main__":
    init_logger()
    run_each_case(run_parity_case_or_probe)
    destroy_distributed(wait_for_peers=True)
    finish_rank()
