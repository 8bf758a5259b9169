"""Python's garbage collection on a schedule (--training.gc_freq), the same steps on every rank.

CPython collects whenever enough objects were allocated since the last collection: a different moment on every
rank, and a collection of a large heap pauses its rank for tens of milliseconds. At scale each such pause is a
straggler every other rank waits for in the next collective. So automatic collection is off while training runs,
and every rank collects at the same steps instead (torchtitan's gc_freq). Generation 1, as torchtitan does: the
young objects a step creates, without walking the whole long-lived heap each time.
"""

import gc
import time
from types import TracebackType

from titan.metrics.log import logger

GENERATION = 1


class ScheduledCollector:
    """A context manager over the training loop: automatic collection off inside it, a collection every `gc_freq`
    steps through step(), and the pause time since the last take_pause_seconds()."""

    def __init__(self, gc_freq: int) -> None:
        self.gc_freq = gc_freq
        self.was_enabled = False
        self.pause_seconds = 0.0

    def __enter__(self) -> "ScheduledCollector":
        self.was_enabled = gc.isenabled()
        gc.disable()
        self.collect()  # setup's garbage, so the first scheduled collection is no bigger than the rest
        logger.info(f"Garbage collection every {self.gc_freq} steps (--training.gc_freq), automatic collection off")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.was_enabled:
            gc.enable()

    def step(self, step: int) -> None:
        """Collect after every gc_freq-th step."""
        if step % self.gc_freq == 0:
            self.collect()

    def collect(self) -> None:
        start = time.perf_counter()
        gc.collect(GENERATION)
        self.pause_seconds += time.perf_counter() - start

    def take_pause_seconds(self) -> float:
        """Seconds paused in collections since the last call (for the metrics record)."""
        seconds, self.pause_seconds = self.pause_seconds, 0.0
        return seconds
