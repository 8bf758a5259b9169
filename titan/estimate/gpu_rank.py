"""The processes that simulate the ranks of a dry run:
    python -m titan.estimate.gpu_rank SHIM
SHIM is the compiled titan/estimate/simulated_cuda.cpp (empty to simulate a CPU rank). The process loads it, imports
torch and Titan once, and then serves requests: each line on stdin names a pickled (simulate.RankRequest, the asking
process's environment) pair and the file where the pickled DryRunResult, or the exception that ended the simulation,
goes. It forks a child per request, which simulates the rank and exits, and writes the child's exit code as one line
to the file descriptor given by TITAN_DRY_RUN_DONE_FD.

The shim must be loaded before torch is (its registrations only count if they come before torch's first use of
them), so this module imports nothing of torch's or Titan's until it is loaded. A child per rank keeps the fake
process group and torch's per-group caches from meeting another simulated rank's, and forking it from a process that
has already imported torch saves each rank after the first the seconds of that import."""

import atexit
import ctypes
import os
import pickle
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

DONE_FD_VARIABLE = "TITAN_DRY_RUN_DONE_FD"


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


def simulate_to_file(request_path: str, response_path: str) -> None:
    """Simulate the rank of one request and write its outcome."""
    from titan.config.errors import ConfigError
    from titan.estimate.simulate import SimulatedRankError, simulate_rank

    request, environment = pickle.loads(Path(request_path).read_bytes())
    # The asking process's environment at the time of the request, not at the server's start.
    os.environ.clear()
    os.environ.update(environment)
    try:
        outcome: object = simulate_rank(request)
    except ConfigError as error:
        outcome = error
    except Exception:  # any failure is the simulated rank's, reported whole to the process that asked
        outcome = SimulatedRankError(f"The dry run's rank {request.rank} failed:\n{traceback.format_exc()}")
    Path(response_path).write_bytes(pickle.dumps(outcome))


def serve(done_fd: int) -> None:
    """Answer requests until stdin closes, one forked child each."""
    for line in sys.stdin:
        request_path, response_path = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            try:
                simulate_to_file(request_path, response_path)
                code = 0
            except BaseException:  # a failure to report at all: say why, since the asking process only sees the code
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        os.write(done_fd, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def main(argv: list[str]) -> int:
    (shim,) = argv
    if shim:
        ctypes.CDLL(shim, mode=os.RTLD_GLOBAL)
    import titan.estimate.simulate  # noqa: F401  (torch and the trainer's stack, once, before any fork)
    from titan.metrics.log import init_logger

    init_logger()
    serve(int(os.environ[DONE_FD_VARIABLE]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
