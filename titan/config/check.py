"""Parse, then validate: the one way a JobConfig is made from command-line arguments."""

from titan.config.job import JobConfig
from titan.config.load import parse_args
from titan.config.validate import validate


def load_job_config(argv: list[str], world_size: int) -> JobConfig:
    """The validated JobConfig for `argv` (without the program name) in a run of `world_size` processes."""
    cfg = parse_args(argv)
    validate(cfg, world_size)
    return cfg
