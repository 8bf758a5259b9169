"""Stragglers: a rank whose own work is slower than its peers'. In a synchronous job every rank's step takes the same
time, since the fast ranks wait for the slow one inside the collectives; the optimizer step has no collective in it,
so its time is the rank's own speed (a throttled or faulty GPU, a busy host). At each logged step every rank puts the
median of its last --metrics.straggler_window optimizer-step times in its slot of one vector that the step boundary's
all-reduce already carries (titan/train/preemption.py Stopper.agree); a rank whose relative performance (the median
rank's time over its own) is below --metrics.straggler_threshold names itself, once, with its host."""

import socket
import statistics
from collections import deque

from titan.metrics.log import logger


class StragglerWatch:
    def __init__(self, threshold: float, window: int, rank: int, world_size: int) -> None:
        self.threshold = threshold
        self.rank, self.world_size = rank, world_size
        self.times: deque[float] = deque(maxlen=window)
        self.named = False
        self.enabled = threshold > 0 and world_size > 1

    def slots(self, update_seconds: float) -> list[float]:
        """Record this logged step's optimizer-step time; the vector for the all-reduce MAX, this rank's median in
        its slot (0 elsewhere, and everywhere until the window is full). Empty when off."""
        if not self.enabled:
            return []
        self.times.append(update_seconds)
        vector = [0.0] * self.world_size
        if len(self.times) == self.times.maxlen:
            vector[self.rank] = statistics.median(self.times)
        return vector

    def judge(self, medians: list[float]) -> None:
        """Warn once if this rank is a straggler among `medians` (every rank's, from the all-reduce)."""
        if not self.enabled or self.named or min(medians) <= 0:
            return
        typical, mine = statistics.median(medians), medians[self.rank]
        if typical / mine >= self.threshold:
            return
        self.named = True
        slowest = sorted(range(self.world_size), key=medians.__getitem__)[-3:][::-1]
        logger.warning(f"Rank {self.rank} on host {socket.gethostname()} is a straggler: its optimizer step takes "
                       f"{1000 * mine:.1f}ms (median of the last {len(self.times)} logged steps) against the median "
                       f"rank's {1000 * typical:.1f}ms, a relative performance of {typical / mine:.2f} "
                       f"(--metrics.straggler_threshold {self.threshold}). The whole job runs at its pace. Slowest "
                       f"ranks: {', '.join(map(str, slowest))}. Check that host's GPU clocks and temperature "
                       f"(nvidia-smi -q -d PERFORMANCE) and what else runs there.")
