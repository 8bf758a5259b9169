"""The fault-injection harness ([fault]): kill, hang, stop or slow a rank, or take the checkpoint storage away, at a
chosen step or time, or at random times; for the restart tests and for proving recovery on a real cluster.

It never runs unless --fault.kind asks, and it logs a warning when it is armed and when it strikes. Each strike is
also an event in the goodput log (titan/metrics/goodput.py), so the time from a fault to the first new step can be
measured. By default only the first attempt of a launch is hit, so that an in-job restart recovers; random faults
draw new times in each attempt. Every rank draws the same random schedule from --fault.seed, and the drawn rank acts.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.config.job import Fault
from titan.metrics.goodput import EventLog, attempt_number
from titan.metrics.log import logger

RANDOM_KINDS = ("kill", "hang", "sigstop")
"""What a random fault does: the failures a long run meets most (a lost process or node, a stuck rank)."""
STORAGE_STAND_IN_SUFFIX = ".outage"
"""The checkpoint folder's name, plus this, while a storage fault holds it aside."""


@dataclass(frozen=True)
class Strike:
    """One fault to inject: what, on which rank, and when (at the end of `step`, or `seconds` after the first step)."""

    kind: str
    rank: int
    step: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        when = f"at the end of step {self.step}" if self.step else f"{self.seconds:.1f}s after the first step"
        return f"{self.kind} on rank {self.rank} {when}"


def planned_strikes(fault: Fault, world_size: int, horizon_seconds: float = 7 * 24 * 3600) -> list[Strike]:
    """This attempt's strikes, in time order. Random ones are drawn from --fault.seed and the attempt number, up to
    `horizon_seconds` (a week) of training."""
    attempt = attempt_number()
    if fault.kind == "none" or (fault.kind != "random" and attempt > 0 and not fault.every_attempt):
        return []
    if fault.kind != "random":
        return [Strike(fault.kind, fault.rank, fault.step, fault.after_seconds)]
    draw = random.Random(fault.seed * 1_000_003 + attempt)
    strikes, at = [], 0.0
    while True:
        at += draw.expovariate(1.0 / fault.mean_interval_seconds)
        if at > horizon_seconds:
            return strikes
        strikes.append(Strike(draw.choice(RANDOM_KINDS), draw.randrange(world_size), seconds=at))


def hang_forever() -> None:
    """A rank stuck in its training thread: its peers wait for it in their next collective."""
    while True:
        time.sleep(3600)


class FaultInjector:
    """Strikes this rank's planned faults: step faults from the training loop (step_ended), timed ones from a thread
    started at the first step's end. A timed hang is left for the training thread to take at its next step end."""

    def __init__(self, fault: Fault, rank: int, world_size: int, checkpoint_folder: Path, dump_folder: Path,
                 optimizer: torch.optim.Optimizer) -> None:
        self.fault = fault
        self.optimizer = optimizer
        self.rank = rank
        self.checkpoint_folder = checkpoint_folder
        self.dump_folder = dump_folder
        strikes = planned_strikes(fault, world_size)
        self.step_strikes = {strike.step: strike for strike in strikes if strike.step and strike.rank == rank}
        self.timed_strikes = [strike for strike in strikes if not strike.step and strike.rank == rank]
        self.pending_hang: Strike | None = None
        self.started = False
        if strikes:
            shown = "; ".join(strike.describe() for strike in strikes[:3])
            more = f" (and {len(strikes) - 3} more)" if len(strikes) > 3 else ""
            logger.warning(f"Fault injection is on (--fault.kind {fault.kind}): {shown}{more}. This run will fail "
                           f"on purpose.")

    def step_ended(self, step: int) -> None:
        """At the end of `step`: strike a fault planned for it, or take a timed hang; start the timer once."""
        if not self.started:
            self.started = True
            if self.timed_strikes:
                threading.Thread(target=self.strike_on_time, name="titan-faults", daemon=True).start()
        strike = self.step_strikes.get(step) or self.pending_hang
        if strike is not None:
            self.strike(strike, step)

    def strike_on_time(self) -> None:
        start = time.monotonic()
        for strike in self.timed_strikes:
            time.sleep(max(strike.seconds - (time.monotonic() - start), 0.0))
            if strike.kind == "hang":
                self.pending_hang = strike  # only the training thread can be stuck in it
                return
            self.strike(strike, step=None)

    def strike(self, strike: Strike, step: int | None) -> None:
        at = f"at the end of step {step}" if step is not None else f"{strike.seconds:.1f}s after the first step"
        logger.warning(f"Fault injection: {strike.kind} on rank {self.rank} {at} (--fault.kind {self.fault.kind}).")
        events = EventLog(self.dump_folder, enabled=True)
        events.write("fault", kind=strike.kind, rank=self.rank, step=step)
        events.close()
        for handler in logger.handlers:
            handler.flush()
        if strike.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif strike.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif strike.kind == "hang":
            hang_forever()
        elif strike.kind == "storage":
            self.take_storage_away()
        elif strike.kind == "slow":
            seconds = self.fault.slow_seconds
            self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: time.sleep(seconds))

    def take_storage_away(self) -> None:
        """Hold the checkpoint folder aside and put a file in its place for --fault.storage_seconds: every write
        under it fails (root's too), as in a storage outage. A process of its own puts it back, so that the outage
        ends on time even when this rank is killed or restarted meanwhile."""
        folder = self.checkpoint_folder
        aside = folder.with_name(folder.name + STORAGE_STAND_IN_SUFFIX)
        folder.mkdir(parents=True, exist_ok=True)  # before the first save there may be none yet
        folder.rename(aside)
        folder.write_text("Titan's fault injection (--fault.kind storage) holds the checkpoint folder aside.\n")
        restore = ("import os, sys, time; time.sleep(float(sys.argv[1])); os.unlink(sys.argv[2]); "
                   "os.rename(sys.argv[3], sys.argv[2])")
        subprocess.Popen([sys.executable, "-c", restore, str(self.fault.storage_seconds), str(folder), str(aside)],
                         start_new_session=True)
