"""Goodput: the share of a job's wall-clock time that trained the model, from the event log its processes append to.

A job is its dump folder, as for resuming: every attempt that trains there (the first launch, each in-job restart,
each rerun after a preemption) appends to <dump_folder>/goodput/events.jsonl, so one record describes the whole job.
Rank 0 of each attempt writes its process start, its build, its resume, the end of every step, each save and
evaluation, and its end; the launcher writes each failure it sees; the fault harness writes each fault it injects.

The wall time of each launch (from the launcher's start to its last attempt's end; the time between launches, a
queue wait, is not the job's) is split into categories that tile it, after MaxText's goodput package:
- productive: steps whose result the job kept;
- lost: steps trained again later (after a restart or a rollback), and the time from an attempt's last step to the
  launcher seeing it fail (the step in progress, and for a hang the watchdog's wait);
- checkpoint: the blocking part of saves;
- evaluation: validation runs;
- startup: from a process's start to its first step (imports, build, checkpoint read), the launcher's own start,
  and the shutdown after the last step;
- restart: from a failure being seen to the restarted processes starting (stopping the survivors, spawning).
"""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EVENTS_FILE = Path("goodput") / "events.jsonl"
"""Under --job.dump_folder."""
LAUNCH_TIME_ENV = "TITAN_LAUNCH_TIME"
"""Unix time at which titan.launch started, which it hands its ranks: a launch's wall time starts there."""
ATTEMPT_ENV = "TITAN_ATTEMPT"
"""The attempt of its launch that titan.launch starts its ranks for, numbered alike on every node."""
CATEGORIES = ("productive_s", "lost_s", "checkpoint_s", "evaluation_s", "startup_s", "restart_s")


def process_start_time() -> float:
    """Unix time at which this process started (Linux: from /proc, so the interpreter's start and imports count, to
    the clock's tick); elsewhere, now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def launch_time() -> float:
    """When this job's launch started: titan.launch's start, or this process's under plain torchrun."""
    return float(os.environ.get(LAUNCH_TIME_ENV) or process_start_time())


def attempt_number() -> int:
    """Which attempt of its launch this process belongs to (0 for the first), the same number on every node:
    titan.launch's (ATTEMPT_ENV). Under plain torchrun, its agent's restart count, which one node alone counts right
    (a restart of several nodes is refused there: titan/parallel/dims.py attempt_store)."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class EventLog:
    """Appends one JSON line per event to <dump_folder>/goodput/events.jsonl, each in one write to a file opened for
    appending, so that lines from the launcher and a rank never interleave. A process that writes nothing (ranks
    other than 0) passes `enabled=False`."""

    def __init__(self, dump_folder: Path, enabled: bool) -> None:
        self.path = dump_folder / EVENTS_FILE
        self.fd: int | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        """Record `event` at unix time `t` (default now) with `fields`."""
        if self.fd is not None:
            line = json.dumps({"event": event, "t": round(time.time() if t is None else t, 4), **fields})
            os.write(self.fd, (line + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_events(dump_folder: Path) -> list[dict[str, Any]]:
    """The job's events in the order written. A line cut short by a killed process is skipped."""
    path = dump_folder / EVENTS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


@dataclass
class Attempt:
    """One process group's life as the event log tells it (rank 0's view)."""

    launch: float
    start: float
    ready: float | None = None
    steps: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds of training) of each step it finished, in order."""
    checkpoint_s: float = 0.0
    evaluation_s: float = 0.0
    last: float = 0.0
    """Time of its last event (its start, before any)."""
    end: float | None = None
    """When it ended cleanly (finished, or a known stop), or when the launcher saw it fail."""
    failed: bool = False


@dataclass
class Goodput:
    """The job's wall time, its split (the categories tile it), and what was lost."""

    wall_s: float
    productive_s: float
    lost_s: float
    checkpoint_s: float
    evaluation_s: float
    startup_s: float
    restart_s: float
    steps_lost: int
    """Step trainings whose result was thrown away: the steps trained more than once, counted once per extra time."""
    restarts: int
    """Attempts that followed a failure within a launch."""
    launches: int

    @property
    def goodput_pct(self) -> float:
        return 100.0 * self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def record(self, step: int) -> dict[str, Any]:
        """The metrics record (titan/metrics/sinks.py GOODPUT_KEYS), at the job's last step."""
        return {"step": step, "goodput_pct": self.goodput_pct, **asdict(self)}


def split_attempts(events: list[dict[str, Any]]) -> list[Attempt]:
    """Each attempt's times, from its start event to the next one's. Once an attempt is ready, each step, save and
    evaluation event closes an interval that began at the event before it, so together they tile the attempt's
    training. Events before the first start, and the fault harness's, are not timed."""
    attempts: list[Attempt] = []
    for event in events:
        kind, t = event.get("event"), event.get("t", 0.0)
        if kind == "start":
            attempts.append(Attempt(launch=event.get("launch", t), start=t, last=t))
            continue
        if not attempts or kind == "fault":
            continue
        attempt = attempts[-1]
        if kind in ("failure", "end"):
            attempt.end, attempt.failed = t, kind == "failure" or attempt.failed
            continue
        seconds = max(t - attempt.last, 0.0)
        if kind == "ready":
            attempt.ready = t
        elif kind == "step":
            attempt.steps.append((event["step"], seconds))
        elif kind == "save":
            attempt.checkpoint_s += seconds
        elif kind == "eval":
            attempt.evaluation_s += seconds
        attempt.last = max(attempt.last, t)
    return attempts


def measure_goodput(events: list[dict[str, Any]], now: float) -> Goodput:
    """Split the job's wall time into CATEGORIES. The attempt still running (the caller's) ends `now`; an earlier one
    that left no end event (killed before the launcher could say) ends at its last event."""
    attempts = split_attempts(events)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    wall = 0.0
    restarts = 0
    previous: Attempt | None = None
    for index, attempt in enumerate(attempts):
        end = attempt.end or (now if index == len(attempts) - 1 else attempt.last)
        if previous is None or previous.launch != attempt.launch:
            launch_start = min(attempt.launch, attempt.start)
            totals["startup_s"] += attempt.start - launch_start
            wall += attempt.start - launch_start
        else:
            restarts += 1
            gap = attempt.start - (previous.end or previous.last)
            totals["restart_s"] += gap
            wall += gap
        wall += end - attempt.start
        trained = sum(seconds for _, seconds in attempt.steps)
        first_step = attempt.ready or end
        training_end = attempt.last if attempt.ready else first_step
        totals["startup_s"] += first_step - attempt.start
        totals["checkpoint_s"] += attempt.checkpoint_s
        totals["evaluation_s"] += attempt.evaluation_s
        totals["productive_s"] += trained  # less the lost steps, below
        totals["lost_s" if attempt.failed else "startup_s"] += max(end - training_end, 0.0)
        previous = attempt
    last_training: dict[int, int] = {}
    trainings = [training for attempt in attempts for training in attempt.steps]
    for index, (step, _) in enumerate(trainings):
        last_training[step] = index
    lost = [seconds for index, (step, seconds) in enumerate(trainings) if last_training[step] != index]
    totals["productive_s"] -= sum(lost)
    totals["lost_s"] += sum(lost)
    launches = len({attempt.launch for attempt in attempts})
    return Goodput(wall_s=wall, **totals, steps_lost=len(lost), restarts=restarts, launches=launches)


def format_seconds(seconds: float) -> str:
    """'1h02m', '3m05s' or '12.3s'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def summary(record: dict[str, Any]) -> str:
    """The console's line about a goodput record (Goodput.record)."""
    g = record
    restarts = f"; {g['restarts']} restart{'s' if g['restarts'] != 1 else ''}" if g["restarts"] else ""
    return (f"Goodput {g['goodput_pct']:.1f}% of {format_seconds(g['wall_s'])} wall time{restarts}: productive steps "
            f"{format_seconds(g['productive_s'])}, lost {format_seconds(g['lost_s'])} ({g['steps_lost']} steps "
            f"trained again), checkpoints {format_seconds(g['checkpoint_s'])}, evaluation "
            f"{format_seconds(g['evaluation_s'])}, start-up {format_seconds(g['startup_s'])}, restarts "
            f"{format_seconds(g['restart_s'])} (<dump_folder>/{EVENTS_FILE}).")
