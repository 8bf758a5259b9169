"""Run a few Titan train steps under torchrun and save the losses and final full weights, for parity tests.

    torchrun --nproc_per_node 2 tests/parallel_harness.py OUT.pt DATA_SHARDS [titan flags]

The whole pipeline is Titan's own (parallelize, init, loss, clipping, optimizer); only the batches differ
for a reference run: with DATA_SHARDS = D > 1 on one process, each step reads the batches of data-parallel
ranks 0..D-1 and concatenates them, so it sees exactly the global batch that D data-parallel ranks see.
"""

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan.config.check import load_job_config  # noqa: E402
from titan.data.loader import build_dataloader  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402


def concatenated_shards(trainer: Trainer, num_shards: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of every data-parallel shard, concatenated along the batch."""
    per_shard = trainer.cfg.training.local_batch_size // num_shards
    shard_cfg = dataclasses.replace(trainer.cfg.training, local_batch_size=per_shard)
    iterators = [iter(build_dataloader(trainer.tokenizer, shard_cfg, rank, num_shards)) for rank in range(num_shards)]
    while True:
        batches = [next(it) for it in iterators]
        yield torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def main() -> None:
    out, num_shards, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    init_logger()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(load_job_config(flags, world_size), world_size)
    data = concatenated_shards(trainer, num_shards) if num_shards > 1 else iter(trainer.dataloader)
    losses = []
    for _ in range(trainer.cfg.training.steps):
        trainer.step += 1
        losses.append(trainer.train_step(data)[0])
    if world_size == 1:
        weights = {name: value.detach().cpu() for name, value in trainer.model.state_dict().items()}
    else:
        weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.rank == 0:
        torch.save({"losses": losses, "weights": weights}, out)
    destroy_distributed(wait_for_peers=True)


if __name__ == "__main__":
    main()
