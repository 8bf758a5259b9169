"""Run Titan's training loop (Trainer.run) under torchrun and save what losses can't show, for the parallel tests:
every case of one world size in one launch (tests/torchrun.py run_cases).

    torchrun --nproc_per_node 2 tests/trainer_probe.py FOLDER CASES.json

Each case's result holds rank 0's view: which parameters were sharded by FSDP right after the first forward, each process group's
collective timeout after setup and after training, and the local gradient shards of the last step.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan.config.check import load_job_config  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.parallel.dims import MESH_DIMS, destroy_distributed  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402
from torchrun import finish_rank, run_each_case  # noqa: E402


def fsdp_sharded(module: nn.Module) -> bool:
    """Whether `module`'s first parameter is FSDP's shard (a DTensor on a mesh with the flattened dp_shard x cp
    dimension FSDP shards over) rather than the gathered parameter (a plain tensor, or a DTensor on the tp mesh
    alone)."""
    param = next(module.parameters())
    return isinstance(param, DTensor) and "dp_shard_cp" in (param.device_mesh.mesh_dim_names or ())


def group_timeouts(trainer: Trainer) -> dict[str, float]:
    """Collective timeout in seconds of the default process group and of each mesh dimension's group."""
    groups = {"default": dist.distributed_c10d._get_default_group()}
    groups.update({name: trainer.training.meshes.root[name].get_group() for name in MESH_DIMS})
    groups.update({"dp": trainer.training.meshes.dp.get_group(), "fsdp": trainer.training.meshes.fsdp.get_group(),
                   "loss": trainer.training.meshes.loss.get_group()})
    return {name: group._get_backend(trainer.device).options._timeout.total_seconds()
            for name, group in groups.items()}


def run_case(flags: list[str], world_size: int) -> dict:
    trainer = Trainer(load_job_config(flags, world_size), world_size)
    setup_timeouts = group_timeouts(trainer)
    after_forward: list[dict] = []

    def record(model: nn.Module, args: tuple, output: torch.Tensor) -> None:
        after_forward.append({"blocks": [fsdp_sharded(block) for block in model.layers.values()],
                              "root": fsdp_sharded(model.tok_embeddings)})

    trainer.training.model.register_forward_hook(record)  # runs after FSDP's own post-forward hooks, registered earlier
    trainer.run()
    gradients = {fqn: param.grad.to_local() for fqn, param in trainer.training.model.named_parameters()}
    return {"after_forward": after_forward[0], "setup_timeouts": setup_timeouts,
            "train_timeouts": group_timeouts(trainer), "gradients": gradients}


if __name__ == "__main__":
    init_logger()
    run_each_case(run_case)
    destroy_distributed(wait_for_peers=True)
    finish_rank()
