"""torchrun for Titan: `python -m titan.launch [torchrun flags] train.py [titan flags]`.

It checks its own environment and the Titan flags once, in this process, before any rank starts: a mistake then
prints one message and exits 2 instead of failing in every rank. It then runs torchrun itself
(torch.distributed.run) and passes a failed rank's exit code through, without torchrun's own traceback: the rank
has already said what went wrong. `--help` shows torchrun's flags, then Titan's fields.

Stop signals (SIGTERM, SIGINT, SIGUSR1: titan.exits.STOP_SIGNALS) are passed on to every rank, which saves and
exits with code 4, and the launcher keeps waiting for the ranks and reports their code. torchrun on its own would
pass on SIGTERM and SIGINT (not SIGUSR1, which would kill it), SIGKILL the ranks still running 30 s later
(--shutdown_timeout), and exit 1 with a traceback. Here only the scheduler's own grace period bounds the save.
"""

import contextlib
import logging
import os
import signal
import sys
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser, run

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.config.load import parse_args as parse_titan_args
from titan.config.print_config import print_config
from titan.dry_run import dry_run
from titan.exits import KNOWN_EXIT_CODES, STOP_SIGNALS, run_main
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


def child_pids() -> list[int]:
    """The processes this one started, the ranks, from /proc (Linux, where schedulers send stop signals)."""
    me = os.getpid()
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, then ppid
        except OSError:  # exited while we looked
            continue
        if parent == me:
            children.append(int(stat.parent.name))
    return children


def forward_to_ranks(signum: int, frame: FrameType | None) -> None:
    """Pass a stop signal on to every rank: each saves at its next step boundary and exits with code 4."""
    logger.warning(f"The launcher received {signal.Signals(signum).name} and passed it on to its ranks.")
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def forwarding_stop_signals(args: Namespace) -> Iterator[None]:
    """While the ranks run, the launcher passes STOP_SIGNALS on instead of torchrun (on Linux, which lists its
    children in /proc; elsewhere torchrun's own handling stays)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    names = {sig.name for sig in STOP_SIGNALS}
    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",") if name.strip() not in names)
    previous = {signum: signal.signal(signum, forward_to_ranks) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
    cfg = load_job_config(args.training_script_args, world_size)
    if cfg.job.print_config:
        print_config(cfg, world_size)  # no ranks: nothing runs
        return 0
    if cfg.job.dry_run:
        # No torchrun, whatever NGPU is: the job's first and last rank are simulated one after the other, each in a
        # process of its own (titan/estimate/gpu_rank.py).
        return dry_run(cfg, world_size, ranks=None)
    # torchrun logs each failed rank at ERROR level; the rank's own message is the useful one.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with forwarding_stop_signals(args):
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
