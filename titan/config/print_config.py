"""--job.print_config: the resolved job as TOML, on any machine, instead of running it."""

import dataclasses
import sys

from titan.config.job import JobConfig
from titan.config.load import to_toml
from titan.config.validate import find_problems


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
