"""torchrun for Titan: `python -m titan.launch [torchrun flags] train.py [titan flags]`.

It checks the Titan flags once, in this process, before any rank starts: a config mistake then prints one
message and exits 2 instead of failing in every rank. It then runs torchrun itself (torch.distributed.run)
and passes a failed rank's exit code through, without torchrun's own traceback: the rank has already
said what went wrong.
"""

import logging
import os
import sys

import torch

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.metrics.log import init_logger, logger


def world_size(nnodes: str, nproc_per_node: str) -> int:
    """Processes in the job: nodes (the upper end of an elastic `min:max` range) times processes per node,
    where torchrun's `gpu`/`auto` mean one per visible GPU and `cpu` one per core."""
    max_nodes = int(nnodes.split(":")[-1])
    if nproc_per_node.isdigit():
        per_node = int(nproc_per_node)
    elif nproc_per_node in ("gpu", "auto") and torch.cuda.is_available():
        per_node = torch.cuda.device_count()
    else:
        per_node = os.cpu_count() or 1
    return max_nodes * per_node


def exit_code(failure_code: int) -> int:
    """A rank's exit code as a shell reports it: a rank killed by signal N gives 128 + N."""
    return 128 - failure_code if failure_code < 0 else failure_code or 1


def main(argv: list[str]) -> int:
    init_logger()
    args = parse_args(argv)
    try:
        load_job_config(args.training_script_args, world_size(args.nnodes, args.nproc_per_node))
    except ConfigError as e:
        logger.error(str(e))
        return e.exit_code
    # torchrun logs each failed rank at ERROR level; the rank's own message is the useful one.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        logger.error(f"Rank {rank} exited with code {failure.exitcode}; its messages above say why.")
        return exit_code(failure.exitcode)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
