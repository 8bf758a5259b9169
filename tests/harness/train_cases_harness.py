"""Training runs that only have to finish, in one torchrun launch per world size, as run_cases runs parity cases:
each case's flags are the folder it runs in, then train.py's arguments. tests/test_doc_commands.py runs the
documented multi-process commands through it, tests/test_checkpoint.py the straight runs its resumes start from.

    torchrun --nproc_per_node 2 tests/harness/train_cases_harness.py FOLDER CASES.json

Each case is what a rank of `NGPU=N ./run_train.sh ARGS` runs (train.py's train()); only the launcher's own start,
which tests/test_launch.py runs, is shared. Rank 0 writes what the case logged to CONSOLE_LOG in its folder.
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# Run as a script (torchrun): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.metrics.log import init_logger, logger  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402

from harness.torchrun import finish_rank, run_each_case  # noqa: E402
from harness.train_script import TRAIN  # noqa: E402

CONSOLE_LOG = "console.log"
"""Where in its folder a case's rank-0 log lines go (the console lines of the run, without time and level)."""


@contextlib.contextmanager
def console_log(path: Path) -> Iterator[None]:
    """Copy the titan logger's records to `path` (on rank 0), as long as the block runs."""
    if os.environ["RANK"] != "0":
        yield
        return
    handler = logging.FileHandler(path, mode="w")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()


def run_case(flags: list[str], world_size: int) -> dict:
    """Train the case's job from its folder (its relative paths, its outputs); a failure ends the launch."""
    folder, argv = Path(flags[0]), flags[1:]
    os.chdir(folder)
    with console_log(folder / CONSOLE_LOG):
        TRAIN.train(argv)
    return {}


if __name__ == "__main__":
    init_logger()
    run_each_case(run_case)
    destroy_distributed(wait_for_peers=True)
    finish_rank()
