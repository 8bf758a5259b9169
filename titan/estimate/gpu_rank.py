"""One simulated rank of a dry run, in a process of its own:
    python -m titan.estimate.gpu_rank SHIM REQUEST RESPONSE
SHIM is the compiled titan/estimate/simulated_cuda.cpp (empty to simulate a CPU rank), REQUEST a pickled
simulate.RankRequest, RESPONSE where the pickled DryRunResult, or the exception that ended the simulation, goes.

The shim must be loaded before torch is (its registrations only count if they come before torch's first use of
them), so this module imports nothing of torch's or Titan's until it is loaded. A process of its own also keeps the
fake process group and torch's per-group caches from meeting another simulated rank's."""

import ctypes
import os
import pickle
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    shim, request_path, response_path = argv
    if shim:
        ctypes.CDLL(shim, mode=os.RTLD_GLOBAL)
    from titan.config.errors import ConfigError
    from titan.estimate.simulate import SimulatedRankError, simulate_rank
    from titan.metrics.log import init_logger

    init_logger()
    request = pickle.loads(Path(request_path).read_bytes())
    try:
        outcome: object = simulate_rank(request)
    except ConfigError as error:
        outcome = error
    except Exception:  # any failure is the simulated rank's, reported whole to the process that asked
        outcome = SimulatedRankError(f"The dry run's rank {request.rank} failed:\n{traceback.format_exc()}")
    Path(response_path).write_bytes(pickle.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
