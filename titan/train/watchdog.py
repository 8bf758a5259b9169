"""Hangs: a rank that sees no progress for --comm.train_timeout_seconds writes its stacks and exits with code 5.

Once the first step of this process is done (setup and that step are what --comm.init_timeout_seconds covers),
each rank's one watchdog thread holds a deadline: the limit after the last step boundary or step start. A step
is one window; what runs between two steps (logging, a checkpoint save, an evaluation) is the next. When a
deadline passes, the main thread is stuck (in a collective whose peer never came, a filesystem, a kernel), so the
watchdog writes every thread's Python stack to <dump_folder>/hang/rank_<r>.txt and the flight recorder's record of
the collectives this rank ran and is waiting in (NCCL's and gloo's; --comm.trace_buf_size) to
<dump_folder>/comm_traces/rank_<r> and gloo_rank_<r>, in torch's format, reads every rank's progress from
the process group's store to name the slowest rank, waits briefly for the other ranks' stacks, and ends the
process with os._exit (the main thread cannot be interrupted).

Every rank records "<last completed step> <unix time>" in the store at each step boundary. A rank stuck before it
completes a step its peers completed (they then wait in the next collective) is the slowest. When every rank
completed the same step, they all stalled inside the next one: the stacks show which rank is not waiting in a
collective. The collective timeout is set COLLECTIVE_TIMEOUT_MARGIN beyond the watchdog's limit, so the watchdog
fires first and the stacks get written instead of a gloo or NCCL timeout traceback.
"""

import faulthandler
import math
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from titan.exits import EXIT_HUNG, announce_stop
from titan.metrics.log import logger
from titan.parallel.dims import has_nccl

PEER_DUMP_WAIT = timedelta(seconds=10)
"""How long a hung rank waits for the other ranks' stack files before it exits (they fire within moments of it,
since every rank's deadline follows the same step boundary)."""
STORE_READ_TIMEOUT = timedelta(seconds=5)
"""Longest a hung rank waits on the store while it reads the other ranks' progress."""
COLLECTIVE_TIMEOUT_MARGIN = 30
"""Seconds that the process groups' collective timeout exceeds --comm.train_timeout_seconds: time for the watchdog
to fire, write the stacks and wait PEER_DUMP_WAIT for its peers' before any collective times out."""
MAX_NAMED_RANKS = 8
"""Slowest ranks listed by number in the message; the rest are counted."""


def progress_key(rank: int) -> str:
    """Store key holding "<last completed step> <unix time>" of `rank`."""
    return f"titan/progress/rank_{rank}"


def dumped_key(rank: int) -> str:
    """Store key that `rank` sets once its stack file is written."""
    return f"titan/hang/rank_{rank}"


def describe_ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1, 5' or 'ranks 0, 1, ... (and 12 more)'."""
    shown = ", ".join(map(str, ranks[:MAX_NAMED_RANKS]))
    more = f" (and {len(ranks) - MAX_NAMED_RANKS} more)" if len(ranks) > MAX_NAMED_RANKS else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def is_are(ranks: list[int]) -> str:
    return "are" if len(ranks) > 1 else "is"


def read_progress(world_size: int) -> dict[int, tuple[int, float]]:
    """(last completed step, unix time) of every rank that recorded one, read from the store with a short timeout."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(STORE_READ_TIMEOUT)  # the process is about to exit; no one else waits on this store again
    progress = {}
    for rank in range(world_size):
        if store.check([progress_key(rank)]):
            step, unix_time = store.get(progress_key(rank)).decode().split()
            progress[rank] = (int(step), float(unix_time))
    return progress


def slowest_ranks(progress: dict[int, tuple[int, float]], world_size: int) -> str:
    """A sentence naming the ranks with the lowest completed step, and how far the others got."""
    missing = sorted(set(range(world_size)) - set(progress))
    if missing:
        return f"The slowest {is_are(missing)} {describe_ranks(missing)}, which recorded no completed step."
    lowest = min(step for step, _ in progress.values())
    slow = sorted(rank for rank, (step, _) in progress.items() if step == lowest)
    if len(slow) == world_size:
        return (f"Every rank completed step {lowest}, so all of them are stuck inside step {lowest + 1} (or what "
                f"follows it): in the stack files, the rank that is not waiting in a collective is the slow one.")
    others = max(step for step, _ in progress.values())
    since = time.time() - max(progress[rank][1] for rank in slow)
    return (f"The slowest {is_are(slow)} {describe_ranks(slow)}, which last completed step {lowest}, {since:.0f}s "
            f"ago; the other ranks got to step {others}.")


class Watchdog:
    """One thread per rank that ends the process with code 5 once no step starts or ends within `limit_seconds`."""

    def __init__(self, limit_seconds: int, dump_folder: Path, rank: int, world_size: int,
                 traces_folder: Path | None) -> None:
        """`traces_folder`: where the flight recorder's dumps go; None when it is off."""
        self.limit_seconds = limit_seconds
        self.stack_file = dump_folder / "hang" / f"rank_{rank}.txt"
        self.traces_folder = traces_folder if world_size > 1 else None  # one process has no process group
        self.rank, self.world_size = rank, world_size
        self.deadline = math.inf
        self.window = ""
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.thread is not None

    def record_progress(self, step: int) -> None:
        """Tell the other ranks' watchdogs that this rank completed `step` (called at each step boundary)."""
        if self.world_size > 1:
            dist.distributed_c10d._get_default_store().set(progress_key(self.rank), f"{step} {time.time():.3f}")

    def step_ended(self, step: int) -> None:
        """At the boundary after `step`: a new deadline for what follows it. The first call starts the thread."""
        self.arm(f"after step {step} (logging, a checkpoint save or an evaluation)")
        if self.thread is None:
            self.closed = threading.Event()
            self.thread = threading.Thread(target=self.watch, name="titan-watchdog", daemon=True)
            self.thread.start()

    def step_started(self, step: int) -> None:
        """Before `step`: a new deadline for the step, once watching."""
        if self.thread is not None:
            self.arm(f"in step {step}")

    def arm(self, window: str) -> None:
        """A deadline `limit_seconds` from now, for the work that `window` describes."""
        self.window = window
        self.deadline = time.monotonic() + self.limit_seconds

    def close(self) -> None:
        """Stop watching (the loop ended, normally or by an error the main thread reports itself)."""
        self.closed.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def watch(self) -> None:
        # Wakes at the deadline; a deadline moved on by a step boundary meanwhile just means waiting again.
        while not self.closed.wait(max(self.deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= self.deadline:
                self.fire()

    def fire(self) -> None:
        """Write this rank's stacks, name the slowest rank, let the peers write theirs, exit with EXIT_HUNG."""
        window = self.window
        self.write_stacks(window)
        traces = self.write_comm_traces()
        message = (f"Rank {self.rank}: the run made no progress for {self.limit_seconds}s {window} "
                   f"(--comm.train_timeout_seconds {self.limit_seconds}), so it is hung. ")
        if self.world_size > 1:
            message += self.peer_report() + " "
        others = "; the other ranks' are next to it" if self.world_size > 1 else ""
        message += f"Every thread's Python stack of this rank is in {self.stack_file}{others}. "
        if traces:
            message += (f"The collectives it ran and waits in are in {', '.join(map(str, traces))} (read them with "
                        f"python -m torch.distributed.flight_recorder.fr_trace {self.traces_folder}). ")
        message += ("If steps, saves or evaluations of this run legitimately take longer, raise "
                    "--comm.train_timeout_seconds.")
        logger.error(message)
        if self.world_size > 1:
            self.wait_for_peer_stacks()
            announce_stop(EXIT_HUNG)
        for handler in logger.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)  # the main thread is stuck: sys.exit from this thread would wait for it forever

    def write_stacks(self, window: str) -> None:
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        with self.stack_file.open("w") as file:
            file.write(f"Rank {self.rank}: no progress for {self.limit_seconds}s {window}. Python stacks of every "
                       f"thread (the main thread is the one training):\n\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)

    def write_comm_traces(self) -> list[Path]:
        """Dump each flight recorder this torch has (NCCL's on CUDA builds, with NCCL in use; gloo's), as torch
        would on a collective's timeout. Returns the files written."""
        if self.traces_folder is None:
            return []
        c10d = torch._C._distributed_c10d
        dumps = [("gloo_rank_", c10d._dump_fr_trace)]
        if has_nccl(dist.get_backend()):
            dumps.insert(0, ("rank_", c10d._dump_nccl_trace))
        written = []
        for prefix, dump in dumps:
            path = self.traces_folder / f"{prefix}{self.rank}"
            path.write_bytes(dump(includeCollectives=True, includeStackTraces=True, onlyActive=False))
            written.append(path)
        return written

    def peer_report(self) -> str:
        """Mark this rank's stacks written and name the slowest rank, or say why the store could not tell."""
        try:
            dist.distributed_c10d._get_default_store().set(dumped_key(self.rank), "1")
            return slowest_ranks(read_progress(self.world_size), self.world_size)
        except (RuntimeError, ValueError) as error:  # the store's host is gone, or a key was garbled
            return f"The other ranks' progress could not be read from the store ({str(error).splitlines()[0]})."

    def wait_for_peer_stacks(self) -> None:
        """Give the other ranks' watchdogs a moment to write their stacks before this rank's exit breaks their
        collectives."""
        store = dist.distributed_c10d._get_default_store()
        try:
            store.wait([dumped_key(rank) for rank in range(self.world_size)], PEER_DUMP_WAIT)
        except RuntimeError:  # a rank whose watchdog cannot run (its main thread holds the GIL) never writes one
            pass
