"""torchrun for Titan: `python -m titan.launch [torchrun flags] train.py [titan flags]`.

It checks its own environment and the Titan flags once, in this process, before any rank starts: a mistake then
prints one message and exits 2 instead of failing in every rank. It then runs torchrun itself
(torch.distributed.run) and passes a failed rank's exit code through, without torchrun's own traceback: the rank
has already said what went wrong. `--help` shows torchrun's flags, then Titan's fields.
"""

import logging
import sys
from argparse import Namespace

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser, run

from titan.config.check import load_job_config
from titan.config.errors import KNOWN_EXIT_CODES, ConfigError
from titan.config.load import parse_args as parse_titan_args
from titan.exits import run_main
from titan.metrics.log import init_logger, logger, logging_ranks

HELP_FLAGS = ("-h", "--help")


def nodes_and_processes(args: Namespace) -> tuple[int, int]:
    """(nodes, processes per node) as torchrun will read them: the upper end of an elastic `min:max` node range,
    and torchrun's own reading of --nproc_per_node (gpu/auto: one per visible GPU, cpu: one per core)."""
    problems = []
    nodes = args.nnodes.split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        problems.append(f"--nnodes {args.nnodes!r} must be a whole number of nodes, at least 1, or a range "
                        f"min:max such as 1:4.")
    try:
        per_node = determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        per_node = 0
        problems.append(f"--nproc_per_node {args.nproc_per_node!r} (NGPU for run_train.sh) must be a whole number of "
                        f"processes, at least 1, or one of gpu, cpu, auto (torchrun: {error}). Try NGPU=1.")
    else:
        if per_node < 1:
            problems.append(f"--nproc_per_node {args.nproc_per_node!r} (NGPU for run_train.sh) must be at least 1. "
                            f"Try NGPU=1.")
    if problems:
        raise ConfigError(problems)
    return int(nodes), per_node


def check_log_ranks(world_size: int) -> None:
    """LOG_RANK must name a rank of this job, or no rank would print the training log."""
    ranks = logging_ranks()
    if min(ranks) >= world_size:
        raise ConfigError(f"LOG_RANK={','.join(map(str, sorted(ranks)))} names no rank of this job (ranks 0 to "
                          f"{world_size - 1}), so no rank would print the training log. Use LOG_RANK=0 (the default).")


def exit_code(failure_code: int) -> int:
    """A rank's exit code as a shell reports it: a rank killed by signal N gives 128 + N."""
    return 128 - failure_code if failure_code < 0 else failure_code or 1


def first_explained_failure(error: ChildFailedError) -> tuple[int, int]:
    """(rank, exit code) to report: the earliest rank that exited with a known stop's code (its message explains
    it), else the earliest failure. Peers of a stopped rank fail after it, but a signal can reorder that."""
    failures = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    explained = [(rank, failure) for rank, failure in failures if failure.exitcode in KNOWN_EXIT_CODES]
    rank, failure = (explained or failures)[0]
    return rank, exit_code(failure.exitcode)


def launch(argv: list[str]) -> int:
    init_logger()
    parser = get_args_parser()
    parser.prog = "python -m titan.launch"
    if any(arg in HELP_FLAGS for arg in argv) and not any(arg.endswith(".py") for arg in argv):
        parser.print_help()
        print("\nTitan's fields (give them after train.py):\n")
        parse_titan_args(["--help"])
    args = parser.parse_args(argv)
    nodes, per_node = nodes_and_processes(args)
    world_size = nodes * per_node
    check_log_ranks(world_size)
    load_job_config(args.training_script_args, world_size)
    # torchrun logs each failed rank at ERROR level; the rank's own message is the useful one.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as error:
        rank, code = first_explained_failure(error)
        logger.error(f"Rank {rank} exited with code {code}; its messages above say why.")
        return code
    return 0


def main(argv: list[str]) -> int:
    return run_main(lambda: launch(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
