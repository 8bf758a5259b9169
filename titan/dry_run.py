"""Simulate ranks of a job at its real world size on this machine, one at a time, and print each one's report:
    python -m titan.dry_run --world_size 512 --rank 0 --rank 511 --job.config_file configs/llama3_405b.toml
--rank may repeat; without it, rank 0 and the last rank (the first and last pipeline stages, which hold the
embedding and the output) are simulated. Every other flag is Titan's. Exit codes are train.py's: 2 when the config
is invalid for that world size or a rank's predicted peak does not fit in the GPU (--estimate.gpu).
`./run_train.sh --job.dry_run` runs the same for NGPU ranks."""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.load import parse_args, to_toml
from titan.exits import run_main
from titan.metrics.log import init_logger, logger
from titan.validate import find_problems, load_job_config

PROGRAM = "python -m titan.dry_run --world_size N [--rank R ...]"


def documented_world_size(config: Path) -> int:
    """The world size a shipped config is meant for, from its '# World size: N (...)' comment line."""
    found = re.search(r"^# World size: (\d+) ", config.read_text(), re.MULTILINE)
    if found is None:
        raise ConfigError(f"{config} does not say which world size it is meant for. Add a comment line "
                          f"'# World size: N (where)'.")
    return int(found.group(1))


def dry_run(cfg: JobConfig, world_size: int, ranks: list[int] | None) -> int:
    """Simulate and report each of `ranks` (default: first and last) of the job `cfg`, validated for `world_size`,
    each rank in a process of its own (titan/estimate/gpu_rank.py). Returns 0; raises a ConfigError naming every rank
    whose peak does not fit the GPU, after reporting them all."""
    # Imported here: the trainer's imports are slow, and a config error should come out before them.
    from titan.estimate.report import check_fits, format_report, warn_slow_data
    from titan.estimate.simulate import run_dry_run

    ranks = ranks if ranks is not None else sorted({0, world_size - 1})
    outside = [rank for rank in ranks if not 0 <= rank < world_size]
    if outside:
        raise ConfigError(f"--rank {', '.join(map(str, outside))} is not a rank of a job of --world_size {world_size} "
                          f"(ranks 0 to {world_size - 1}).")
    problems = []
    for rank in ranks:
        result = run_dry_run(cfg, world_size, rank)
        logger.info(format_report(result, cfg.estimate))
        warn_slow_data(result, cfg.estimate)
        try:
            check_fits(result, cfg.estimate)
        except ConfigError as error:
            problems += error.problems
    if problems:
        raise ConfigError(problems)
    return 0


def print_config(cfg: JobConfig, world_size: int) -> None:
    """Write `cfg` as TOML to stdout, then what would stop it running here (files this machine lacks, a GPU it has
    not) as comments headed "Warning": the output stays a job file that `--job.config_file` reads (without
    print_config, so that it runs the job)."""
    job = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, print_config=False))
    _, on_this_machine = find_problems(cfg, world_size)
    warnings = "".join(f"# Warning: on this machine, {problem}\n" for problem in on_this_machine)
    processes = f"{world_size} process" + ("es" if world_size > 1 else "")
    sys.stdout.write(f"# The resolved config of a run of {processes}.\n{to_toml(job)}{warnings}")
    sys.stdout.flush()


def print_or_dry_run(cfg: JobConfig, world_size: int, rank: int | None) -> bool:
    """Do what --job.print_config or --job.dry_run asks instead of training; False when neither is set. `rank` is
    this process's rank under torchrun (train.py): it prints on rank 0 only and simulates its own rank (run_train.sh
    simulates rank 0 and the last itself). None is one process standing for the whole job before any rank starts
    (the launcher): it prints, with no ranks running, and simulates the first and last rank, whatever NGPU is."""
    if cfg.job.print_config:
        if rank in (None, 0):
            print_config(cfg, world_size)
        return True
    if cfg.job.dry_run:
        dry_run(cfg, world_size, ranks=None if rank is None else [rank])
        return True
    return False


def main(argv: list[str]) -> int:
    init_logger()
    parser = argparse.ArgumentParser(prog="python -m titan.dry_run", add_help=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, required=True, help="Ranks of the simulated job (GPUs).")
    parser.add_argument("--rank", type=int, action="append", help="A rank to simulate; repeat for more.")
    if any(arg in ("-h", "--help") for arg in argv):
        parser.print_help()
        print("\nTitan's fields:\n")
        parse_args(["--help"], program=PROGRAM)  # prints them and exits 0
    known, titan_args = parser.parse_known_args(argv)
    return run_main(lambda: dry_run_cli(titan_args, known.world_size, known.rank))


def dry_run_cli(titan_args: list[str], world_size: int, ranks: list[int] | None) -> int:
    """The command line's dry run: the world size checked, the config parsed and validated once for it."""
    if world_size < 1:
        raise ConfigError(f"--world_size {world_size} must be at least 1: the number of GPUs the job is meant for.")
    return dry_run(load_job_config([*titan_args, "--job.dry_run"], world_size), world_size, ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
