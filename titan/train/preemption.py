"""Stopping early at a step boundary, on every rank alike: a preemption signal or --job.time_limit.

A scheduler warns a job before it kills it: Slurm sends SIGTERM at the time limit and on scancel (SIGUSR1 first
with `--signal=USR1@120`), Kubernetes sends SIGTERM to a pod it evicts, and a user presses Ctrl-C (SIGINT). On any
rank these only set a flag, and the rank finishes its step. At each step boundary every rank then agrees in one
all-reduce (MAX over the world) of [signal, time limit, this rank's step time, minus this rank's step time]: if one
rank got a signal, or would run out of --job.time_limit before another step and its save, every rank waits for a
background save, saves the current step synchronously (unless it was just saved) and exits with code 4. The
all-reduce runs on a gloo group of host memory (titan/parallel/dims.py build_host_group), never on NCCL: reading a
result from the GPU's stream would make the host wait for every kernel queued before it.
Rerunning the same command resumes. The same all-reduce gives the fastest and slowest rank's step time for the
metrics (stragglers), and the hang watchdog (titan/train/watchdog.py) follows the boundaries.

Under titan.launch (run_train.sh) the launcher passes these signals on to every rank and waits for them with no
deadline of its own, so the scheduler's grace period (Slurm KillWait, Kubernetes terminationGracePeriodSeconds,
30 s by default) is what bounds the rest of the step and the save.
"""

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from titan.checkpoint.dcp import Checkpointer, TrainState
from titan.config.domain import parse_duration
from titan.config.job import Checkpoint, Comm, Job
from titan.exits import EXIT_STOPPED_EARLY, STOP_SIGNALS, KnownStop, stop_signal_received
from titan.metrics.log import current_rank, logger
from titan.metrics.sinks import format_duration
from titan.parallel.dims import Meshes, build_host_group, set_collective_timeout
from titan.train.watchdog import COLLECTIVE_TIMEOUT_MARGIN, Watchdog

REPEAT_AFTER_SECONDS = 1.0
"""The same signal again at least this long after the first exits at once. Sooner, it is the same signal delivered
twice: Slurm signals every process of a job step, and the launcher passes on what it receives too."""


class StoppedEarly(KnownStop):
    """Every rank stopped at the same step boundary, after saving it: exit code 4; rerunning resumes."""

    exit_code = EXIT_STOPPED_EARLY
    every_rank_stops = True


class SignalFlag:
    """Handlers for STOP_SIGNALS that only note the first signal; the same one again, later, exits at once."""

    def __init__(self, rank: int, plan: Callable[[], str]) -> None:
        """`plan` says what the rank does next ("finishing step 13, then saving a checkpoint and exiting")."""
        self.rank = rank
        self.plan = plan
        self.signum: int | None = None
        self.received_at = 0.0
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle every STOP_SIGNAL that this process does not ignore (a background job of a shell ignores SIGINT)."""
        self.signum = None
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) != signal.SIG_IGN:
                self.previous[signum] = signal.signal(signum, self.handle)

    def restore(self) -> None:
        """Put back the handlers that were there before install()."""
        for signum, handler in self.previous.items():
            # None: a handler installed outside Python, which Python cannot reinstall; the default is the closest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self.previous = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()
            stop_signal_received.set()
            logger.warning(f"Rank {self.rank} received {name}: {self.plan()}. A second {name} exits at once, "
                           f"without saving.")
        elif signum == self.signum and time.monotonic() - self.received_at >= REPEAT_AFTER_SECONDS:
            logger.warning(f"Rank {self.rank} received {name} again: exiting now, without saving.")
            self.restore()
            signal.raise_signal(signum)


class Stopper:
    """The step boundary of the training loop: whether every rank stops there, the spread of their step times,
    and the hang watchdog's deadlines. The trainer calls start_step and end_step around each step, then stop."""

    def __init__(self, job: Job, comm: Comm, checkpoint: Checkpoint, total_steps: int, dump_folder: Path,
                 world_size: int) -> None:
        self.started = time.monotonic()  # --job.time_limit counts from here, the trainer's construction
        self.time_limit_text = job.time_limit
        self.time_limit = parse_duration(job.time_limit) if job.time_limit is not None else None
        self.checkpoint = checkpoint
        self.total_steps = total_steps
        self.world_size, self.rank = world_size, current_rank()
        self.signals = SignalFlag(self.rank, self.plan)
        traces_folder = dump_folder / comm.save_traces_folder if comm.trace_buf_size > 0 else None
        self.watchdog = Watchdog(comm.train_timeout_seconds, dump_folder, self.rank, world_size, traces_folder)
        self.meshes: Meshes | None = None
        self.host_group: dist.ProcessGroup | None = None
        self.step_in_progress: int | None = None
        self.step_started = self.step_ended = self.started
        self.saving = False
        self.step_time_range = (0.0, 0.0)  # (fastest, slowest) rank's time of the last step
        self.slowest_step = 0.0
        self.last_save_seconds: float | None = None

    @contextlib.contextmanager
    def watching(self, meshes: Meshes | None) -> Iterator[None]:
        """Around the training loop: the signal handlers, and the watchdog from the first step boundary on."""
        self.meshes = meshes
        self.host_group = build_host_group()
        self.signals.install()
        try:
            yield
        finally:
            self.watchdog.close()
            self.signals.restore()

    def plan(self) -> str:
        """What this rank does after a stop signal."""
        if self.step_in_progress == self.total_steps:
            return f"finishing the last step, {self.total_steps}; the run then ends as usual"
        then = "saving a checkpoint and exiting" if self.checkpoint.enable else "exiting (checkpoints are off)"
        return f"finishing step {self.step_in_progress or 'in progress'}, then {then}"

    def start_step(self, step: int) -> None:
        """Before each step: time the save that ran since the last boundary (if one was due); move the watchdog on."""
        now = time.monotonic()
        if self.saving:
            self.last_save_seconds = now - self.step_ended
        self.step_started, self.step_in_progress = now, step
        self.watchdog.step_started(step)

    def end_step(self, step: int, saving: bool) -> str | None:
        """The boundary after `step`; `saving`: a checkpoint of it is written next. Every rank agrees, in one
        all-reduce, on whether to stop and on the fastest and slowest step time. Returns why the run stops here, or
        None; the last step never stops early, since the run ends there anyway."""
        now = time.monotonic()
        step_seconds = now - self.step_started
        self.watchdog.record_progress(step)
        last = step >= self.total_steps
        next_step, save = self.estimates(step_seconds)
        out_of_time = not last and self.out_of_time(now - self.started, next_step, save, saving)
        signal_code, time_flag, slowest, minus_fastest = self.agree(
            [self.signal_code(), float(out_of_time), step_seconds, -step_seconds])
        self.step_time_range = (-minus_fastest, slowest)
        self.slowest_step = max(self.slowest_step, slowest)
        if not self.watchdog.started:
            # From here on a collective waits a little longer than the watchdog, which then reports the hang.
            set_collective_timeout(self.meshes, self.watchdog.limit_seconds + COLLECTIVE_TIMEOUT_MARGIN)
        self.watchdog.step_ended(step)
        self.step_ended, self.saving = time.monotonic(), saving
        if last:
            return None
        if signal_code:
            signum, rank = divmod(int(signal_code) - 1, self.world_size)
            return f"rank {rank} received {signal.Signals(signum).name}"
        if time_flag:
            saves = f" and a checkpoint save about {save:.1f}s" if self.checkpoint.enable else ""
            return (f"--job.time_limit {self.time_limit_text} leaves too little time for another step "
                    f"({format_duration(now - self.started)} used; a step takes about {next_step:.1f}s{saves})")
        return None

    def signal_code(self) -> float:
        """0, or which signal reached which rank, as one number that a MAX over ranks keeps whole."""
        if self.signals.signum is None:
            return 0.0
        return float(self.signals.signum * self.world_size + self.rank + 1)

    def agree(self, values: list[float]) -> list[float]:
        """The elementwise maximum of `values` over every rank: one all-reduce of host memory on the host group."""
        if self.host_group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return tensor.tolist()

    def estimates(self, step_seconds: float) -> tuple[float, float]:
        """(next step, save) in seconds: the slower of this step here and the slowest rank's previous step; the
        last save's duration, or before any save the slowest step so far."""
        next_step = max(step_seconds, self.step_time_range[1])
        if not self.checkpoint.enable:
            return next_step, 0.0
        save = self.last_save_seconds if self.last_save_seconds is not None else max(self.slowest_step, step_seconds)
        return next_step, save

    def out_of_time(self, elapsed: float, next_step: float, save: float, saving: bool) -> bool:
        """Whether going on could cross the time limit: that takes this step's save (when due), the next step, and
        the save that a stop after it would need."""
        return self.time_limit is not None and elapsed + (save if saving else 0.0) + next_step + save > self.time_limit

    def stop(self, reason: str, checkpointer: Checkpointer, train_state: TrainState) -> NoReturn:
        """Save the current step unless its checkpoint was just written, then raise StoppedEarly (exit code 4)."""
        step = train_state.step
        if not self.checkpoint.enable:
            raise StoppedEarly(f"Stopped at step {step}: {reason}. No state was saved, since --checkpoint.enable is "
                               f"off: rerunning the same command starts again from step 0. Add --checkpoint.enable "
                               f"(with --checkpoint.interval) to save during the run and when it stops early, so a "
                               f"rerun resumes.")
        checkpointer.wait()  # a background save, of this step or an earlier one
        if not self.saving:
            checkpointer.save(train_state, last_step=self.total_steps, blocking=True)
        load_step = self.checkpoint.load_step
        resume = (f"rerun the same command without --checkpoint.load_step {load_step} to resume" if load_step >= 0
                  else "rerun the same command to resume")
        raise StoppedEarly(f"Stopped at step {step}: {reason}. Its checkpoint is "
                           f"{checkpointer.location(step)}; {resume}.")
