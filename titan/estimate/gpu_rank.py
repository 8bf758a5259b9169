"""The processes that simulate the ranks of a dry run:
    python -m titan.estimate.gpu_rank SHIM
SHIM is the compiled titan/estimate/simulated_cuda.cpp (empty to simulate a CPU rank). The process loads it, imports
torch and Titan once, and then serves requests: each line on stdin names a pickled (simulate.RankRequest, the asking
process's environment) pair and the file where the pickled DryRunResult, or the exception that ended the simulation,
goes. It forks a child per request, which simulates the rank and exits, and writes the child's exit code as one line
to the file descriptor given by TITAN_DRY_RUN_DONE_FD (titan/estimate/rank_server.py starts and asks it).

The shim must be loaded before torch is (its registrations only count if they come before torch's first use of
them), so this module imports nothing of torch's, and of Titan's only rank_server.py (which imports no torch),
until it is loaded. A child per rank keeps the fake process group and torch's per-group caches from meeting another
simulated rank's, and forking it from a process that has already imported torch saves each rank after the first the
seconds of that import."""

import ctypes
import os
import pickle
import sys
import traceback
from pathlib import Path

from titan.estimate.rank_server import DONE_FD_VARIABLE


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
