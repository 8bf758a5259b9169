"""How a Titan process ends: the one handler that train.py, the launcher and the scripts run their work under.

Exit codes: 0 finished; 2 a user mistake (ConfigError: config, paths, data, checkpoints); 3 the run diverged
(NonFiniteLossError); 4 stopped early by a signal or --job.time_limit, after saving (titan/train/preemption.py);
5 hung (titan/train/watchdog.py); 6 a checkpoint save failed (titan/checkpoint/dcp.py); 7 the launcher's restart
budget (--max-restarts) ran out (titan/launch/restarts.py). Known stops print their message and no traceback. A
rank that stops tells its peers through the process group's store first: a peer whose next collective then fails
(gloo: "Connection closed by peer") prints one line naming that rank and exits with the same code, instead of a
traceback that buries the stopped rank's message.
"""

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from titan.config.errors import EXIT_USER_MISTAKE, ConfigError
from titan.metrics.log import logger

EXIT_DIVERGED = 3
EXIT_STOPPED_EARLY = 4
"""A preemption signal or --job.time_limit stopped the run at a step boundary; rerunning the command resumes."""
EXIT_HUNG = 5
"""A step outlasted --comm.train_timeout_seconds; each rank's stack is in <dump_folder>/hang/."""
EXIT_SAVE_FAILED = 6
"""Writing a checkpoint failed after the run had started (a storage outage); nothing was published, and a rerun or an
in-job restart resumes from the newest complete checkpoint."""
EXIT_RESTARTS_SPENT = 7
"""The launcher restarted the job --max-restarts times and it failed once more (titan/launch/restarts.py)."""
KNOWN_EXIT_CODES = (EXIT_USER_MISTAKE, EXIT_DIVERGED, EXIT_STOPPED_EARLY, EXIT_HUNG, EXIT_SAVE_FAILED)
"""Exit codes whose rank printed why it stopped (README "Troubleshooting")."""
NOT_RETRIED = {EXIT_USER_MISTAKE: "a config or data mistake would fail again",
               EXIT_DIVERGED: "a diverged run would diverge again",
               EXIT_STOPPED_EARLY: "the job was asked to stop (a signal or --job.time_limit)"}
"""Failures an in-job restart would only repeat (a mistake, a divergence) or that asked the job to end (a stop
signal, --job.time_limit), each with why: the launcher ends the job with their code instead of restarting it."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""What a scheduler sends before it kills a job (Slurm: SIGTERM, or SIGUSR1 with --signal; Kubernetes: SIGTERM), and
Ctrl-C. A rank that gets one finishes its step, saves and exits with code 4; the launcher passes them on to its
ranks."""
STOP_KEY = "titan/first_stop"
"""Store key holding "<rank> <exit code>" of the first rank that stopped with a known error."""
PEER_STOP_WAIT = timedelta(seconds=10)
"""How long a rank whose collective failed waits for a peer's stop notice before treating the failure as its own."""
stop_signal_received = threading.Event()
"""Set by the training loop's signal handler (titan/train/preemption.py). torchrun's agent sends SIGTERM to the other
ranks once one fails: a rank whose collective then fails is being torn down, and waiting PEER_STOP_WAIT for a notice
that a killed peer never wrote would only delay the restart."""


class KnownStop(Exception):
    """A runtime ending that explains itself: the message is printed without a traceback and the process exits with
    `exit_code`. `every_rank_stops`: every rank raises it at the same point (so ranks may meet once more)."""

    exit_code: int
    every_rank_stops = False


def run_main(body: Callable[[], int | None], on_exit: Callable[[bool], None] | None = None) -> int:
    """Run `body` and return the process exit code. `on_exit(ranks_agree)` runs last in every case; ranks_agree
    says every rank reached the same point (a finished run, or a stop every rank raises), so they may still meet."""
    ranks_agree = False
    stop_signal_received.clear()  # a signal of an earlier body (tests run several in one process) is not this one's
    try:
        code = body() or 0
        ranks_agree = True
        return code
    except (KnownStop, ConfigError) as stop:
        logger.error(str(stop))
        announce_stop(stop.exit_code)
        ranks_agree = stop.every_rank_stops
        return stop.exit_code
    except RuntimeError as error:  # gloo and NCCL report a vanished peer as RuntimeError (or its DistError subclasses)
        peer = peer_stop(timedelta(0) if stop_signal_received.is_set() else PEER_STOP_WAIT)
        if peer is None and stop_signal_received.is_set():
            logger.error(f"This rank's collective failed after it was asked to stop: another rank failed first (the "
                         f"launcher's message names it). ({str(error).splitlines()[0][:200]})")
            return 1
        if peer is None:
            raise
        rank, code = peer
        logger.error(f"Stopping because rank {rank} stopped first with exit code {code}; its message says why. "
                     f"(This rank's collective failed then: {str(error).splitlines()[0][:200]})")
        return code
    finally:
        if on_exit is not None:
            on_exit(ranks_agree)


def announce_stop(exit_code: int) -> None:
    """Record this rank's stop in the store, unless another rank's came first."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        # The store is the process group's rendezvous store; torch exposes it only through this private getter.
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(STOP_KEY, "", f"{dist.get_rank()} {exit_code}")


def peer_stop(wait: timedelta) -> tuple[int, int] | None:
    """(rank, exit code) of a peer that announced its stop, waiting up to `wait` for it; None if none did."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    try:
        if wait > timedelta(0):
            store.wait([STOP_KEY], wait)
        elif not store.check([STOP_KEY]):
            return None
        rank, code = store.get(STOP_KEY).decode().split()
    except (RuntimeError, ValueError):  # no notice in time: the failure is this rank's own
        return None
    return int(rank), int(code)


def exit_process(code: int) -> NoReturn:
    """End the process with `code` as interpreter shutdown would (join the non-daemon threads, run the atexit
    handlers, flush the output), then leave with os._exit, skipping interpreter finalization. A process that used a
    gloo process group can abort there with SIGABRT ('terminate called without an active exception'), after
    destroy_process_group and every atexit handler have run: objects torch still references (device meshes,
    DTensor's caches) keep gloo's C++ state alive until finalization tears it down. Seen in CI, and in 2 of 80
    four-rank runs of scripts/bench_hf.py here, always after the rank's work and its atexit handlers were done;
    in none of 60 runs since."""
    # The first two steps of CPython's own shutdown, in its order: threading's exit hooks (they tell thread pools to
    # stop) and the join of every non-daemon thread, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
