"""The processes that simulate a dry run's ranks (titan/estimate/gpu_rank.py), seen from the process that asks them:
one serving process per shim, started on first use and stopped when this process exits. It imports nothing of
torch's, so that gpu_rank.py can import it before loading its shim."""

import atexit
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

DONE_FD_VARIABLE = "TITAN_DRY_RUN_DONE_FD"
"""The environment variable naming the file descriptor a serving process writes each child's exit code to."""


@dataclass
class RankServer:
    """A serving process, seen from the process that asks it."""

    process: subprocess.Popen
    done: TextIO
    """The read end of the pipe it writes each child's exit code to."""
    owner: int
    """The pid of the process that started it, the one that stops it (not a fork of that process)."""


SERVERS: dict[str, RankServer] = {}
"""The serving process of each shim, started on first use and stopped when this process exits."""


def rank_server(shim: str) -> RankServer:
    """The process serving `shim`'s ranks, started if there is none or it has ended. It sees no real GPU."""
    server = SERVERS.get(shim)
    if server is None or server.process.poll() is not None:
        if server is not None:  # ended on its own: its pipe's read end would otherwise stay open
            server.done.close()
        read_fd, write_fd = os.pipe()
        process = subprocess.Popen([sys.executable, "-m", "titan.estimate.gpu_rank", shim], stdin=subprocess.PIPE,
                                   text=True, pass_fds=(write_fd,),
                                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "", DONE_FD_VARIABLE: str(write_fd)})
        os.close(write_fd)
        server = SERVERS[shim] = RankServer(process, os.fdopen(read_fd), os.getpid())
    return server


def simulate_in_child(shim: str, request: object, folder: Path) -> tuple[object | None, int | None]:
    """Have `shim`'s server simulate `request` (a simulate.RankRequest) in a child, with this process's environment:
    the outcome (a DryRunResult or the exception that ended it; None if the child reported nothing) and the child's
    exit code (None if the server itself ended)."""
    request_path, response_path = folder / "request.pkl", folder / "response.pkl"
    request_path.write_bytes(pickle.dumps((request, dict(os.environ))))
    server = rank_server(shim)
    server.process.stdin.write(f"{request_path}\t{response_path}\n")
    server.process.stdin.flush()
    line = server.done.readline()
    outcome = pickle.loads(response_path.read_bytes()) if response_path.is_file() else None
    return outcome, int(line) if line else None


@atexit.register
def stop_rank_servers() -> None:
    """End every serving process: a closed stdin ends its loop."""
    for server in SERVERS.values():
        if server.owner == os.getpid():
            server.process.stdin.close()
            server.process.wait()
            server.done.close()
    SERVERS.clear()
