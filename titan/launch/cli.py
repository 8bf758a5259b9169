"""The launcher's command line and environment, checked before any rank starts: torchrun's flags (--nnodes,
--nproc_per_node, --max-restarts), LOG_RANK, and --help, which lists torchrun's flags and then Titan's fields."""

from argparse import ArgumentParser, Namespace

from torch.distributed.run import determine_local_world_size, get_args_parser

from titan.config.errors import ConfigError
from titan.config.load import parse_args as parse_titan_args
from titan.metrics.log import logging_ranks

HELP_FLAGS = ("-h", "--help")


def parse_launch_args(argv: list[str]) -> tuple[Namespace, int]:
    """torchrun's arguments from `argv`, checked, with --max-restarts read as a count, and the job's world size.
    --help before the training script prints torchrun's flags, then Titan's fields, and exits."""
    parser = get_args_parser()
    parser.prog = "python -m titan.launch"
    read_max_restarts_as_text(parser)
    if any(arg in HELP_FLAGS for arg in argv) and not any(arg.endswith(".py") for arg in argv):
        parser.print_help()
        print("\nTitan's fields (give them after train.py):\n")
        parse_titan_args(["--help"])
    args = parser.parse_args(argv)
    nodes, per_node = nodes_and_processes(args)
    world_size = nodes * per_node
    args.max_restarts = read_max_restarts(args.max_restarts)
    check_restarts_across_nodes(args, nodes)
    check_log_ranks(world_size)
    return args, world_size


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


def read_max_restarts_as_text(parser: ArgumentParser) -> None:
    """Have torchrun's parser keep --max-restarts as written, for read_max_restarts to read: as an int, a mistake
    would end in torchrun's usage text, which never names MAX_RESTARTS, the variable run_train.sh users set."""
    for action in parser._actions:  # argparse has no public way to look an option up
        if "--max-restarts" in action.option_strings:
            action.type = str


def read_max_restarts(text: str) -> int:
    """--max-restarts as written (read_max_restarts_as_text) as the count torchrun takes: 0 or more."""
    try:
        restarts = int(text)
    except ValueError:
        restarts = -1
    if restarts < 0:
        raise ConfigError(f"MAX_RESTARTS={text} (--max-restarts for python -m titan.launch) must be a whole number, 0 "
                          f"or more: how many times a failed job restarts from its newest checkpoint. Try "
                          f"MAX_RESTARTS=3.")
    return restarts


def check_restarts_across_nodes(args: Namespace, nodes: int) -> None:
    """In-job restarts of several nodes need a rendezvous in which every node's agent learns of another's failure
    and agrees on the next attempt (c10d's rounds); torchrun's static one has no rounds: a node restarts alone."""
    if args.max_restarts > 0 and nodes > 1 and args.rdzv_backend == "static":
        raise ConfigError(f"--max-restarts {args.max_restarts} across --nnodes {args.nnodes} needs --rdzv_backend c10d "
                          f"(with --rdzv_endpoint HEAD:PORT and --rdzv_id JOB_ID on every node): torchrun's static "
                          f"rendezvous restarts each node on its own, and the nodes never meet again.")
