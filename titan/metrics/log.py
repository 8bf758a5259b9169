"""The one logger, `titan`, and the rule for which ranks print.

Info comes from the ranks listed in LOG_RANK (default "0", comma-separated, set by run_train.sh);
every rank prints warnings and errors, prefixed with its rank so a single-rank problem is findable.
"""

import logging
import os
import sys
from typing import TextIO

from titan.config.errors import ConfigError

logger = logging.getLogger("titan")


def current_rank() -> int:
    """This process's global rank as torchrun exported it; 0 outside torchrun."""
    return int(os.environ.get("RANK", "0"))


def logging_ranks() -> set[int]:
    """Ranks whose info lines are printed, from LOG_RANK ("0", "0,1", ...)."""
    value = os.environ.get("LOG_RANK", "0")
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise ConfigError(f"LOG_RANK={value!r} must list the ranks that print info, as comma-separated whole "
                          f"numbers: LOG_RANK=0 (the default) or LOG_RANK=0,1.")
    return {int(part) for part in parts}


class _RankFilter(logging.Filter):
    """Drops info from non-logging ranks and prefixes multi-process lines with the rank."""

    def __init__(self, rank: int, world_size: int, info_ranks: set[int]) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.info_ranks = info_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank{self.rank}] " if self.world_size > 1 else ""
        return record.levelno >= logging.WARNING or self.rank in self.info_ranks


class StdoutHandler(logging.StreamHandler):
    """A StreamHandler that writes to sys.stdout as it is when each record is emitted, not as it was when the handler
    was made: a process that replaces sys.stdout later (a test's capture, which is closed after the test) keeps its
    log, and no record goes to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        """StreamHandler sets its stream on creation; it is always sys.stdout."""


def init_logger() -> None:
    """Send `titan` records to stdout once per process, filtered by rank. Safe to call twice."""
    if logger.handlers:
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    handler = StdoutHandler()
    handler.addFilter(_RankFilter(current_rank(), world_size, logging_ranks()))
    handler.setFormatter(logging.Formatter("%(asctime)s %(rank_prefix)s%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
