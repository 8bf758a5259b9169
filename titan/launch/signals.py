"""The launcher's handling of stop signals: it passes them on to its ranks itself, instead of torchrun."""

import contextlib
import os
import signal
import sys
from argparse import Namespace
from collections.abc import Iterator
from types import FrameType

from titan.exits import STOP_SIGNALS
from titan.launch.procs import child_pids
from titan.metrics.log import logger


def forward_to_ranks(signum: int, frame: FrameType | None) -> None:
    """Pass a stop signal on to every rank: each saves at its next step boundary and exits with code 4."""
    logger.warning(f"The launcher received {signal.Signals(signum).name} and passed it on to its ranks.")
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def forwarding_stop_signals(args: Namespace) -> Iterator[None]:
    """While the ranks run, the launcher passes STOP_SIGNALS on instead of torchrun (on Linux, which lists its
    children in /proc; elsewhere torchrun's own handling stays). Takes them out of torchrun's --signals_to_handle."""
    if not sys.platform.startswith("linux"):
        yield
        return
    names = {sig.name for sig in STOP_SIGNALS}
    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",") if name.strip() not in names)
    previous = {signum: signal.signal(signum, forward_to_ranks) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
