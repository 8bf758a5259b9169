"""Shared fixtures."""

import logging
from collections.abc import Iterator

import pytest

from titan.metrics.log import logger


@pytest.fixture
def titan_records() -> Iterator[list[logging.LogRecord]]:
    """Every record the `titan` logger emits during the test, exactly once, whatever handlers or
    propagation init_logger or pytest set up."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.INFO)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(previous_level)
