"""Titan's entry point: parse and validate the config, then train. Launched by run_train.sh through torchrun."""

import faulthandler
import os
import sys

from titan.dry_run import print_or_dry_run
from titan.exits import exit_process, run_main
from titan.metrics.log import current_rank, init_logger
from titan.parallel.dims import destroy_distributed
from titan.train.trainer import Trainer
from titan.validate import load_job_config


def train(argv: list[str]) -> None:
    init_logger()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_job_config(argv, world_size)
    if not print_or_dry_run(cfg, world_size, rank=current_rank()):
        Trainer(cfg, world_size).run()


def main(argv: list[str]) -> int:
    # Ranks meet at a barrier before leaving the process group only when all of them got there (a finished run,
    # a non-finite loss); after a rank's own error a peer may never arrive.
    return run_main(lambda: train(argv), on_exit=lambda ranks_agree: destroy_distributed(wait_for_peers=ranks_agree))


if __name__ == "__main__":
    # A crash in native code (a kernel, a collective library) prints every thread's Python stack, not just a signal.
    faulthandler.enable()
    exit_process(main(sys.argv[1:]))
