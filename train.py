"""Titan's entry point: parse and validate the config, then train. Launched by run_train.sh through torchrun."""

import os
import sys

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.metrics.log import init_logger, logger
from titan.parallel.dims import destroy_distributed
from titan.train.nan_guard import NonFiniteLossError
from titan.train.trainer import Trainer


def main(argv: list[str]) -> int:
    init_logger()
    # Every rank reaches the end together after a finished run, and after a non-finite loss (all ranks see the
    # same global loss); after any other error a peer may never arrive.
    all_ranks_done = False
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        Trainer(load_job_config(argv, world_size), world_size).run()
        all_ranks_done = True
    except (ConfigError, NonFiniteLossError) as e:
        # User mistakes and diverged runs explain themselves; a traceback would bury the message.
        logger.error(str(e))
        all_ranks_done = isinstance(e, NonFiniteLossError)
        return e.exit_code
    finally:
        destroy_distributed(wait_for_peers=all_ranks_done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
