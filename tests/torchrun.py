"""Launch a test script on several gloo processes with torchrun, as the multi-process tests do."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# gloo on CPU, rarely, aborts a rank from C++ with this message and SIGABRT (exit -6), without a Python error. The
# cause found (interpreter finalization after destroy_process_group) is avoided by titan/exits.py exit_process, which
# every entry point under torchrun ends with; this rerun stays as the net for any other cause. The runs are
# deterministic, so one rerun tells that abort apart from a real failure.
GLOO_ABORT = "terminate called without an active exception"


def run_torchrun(script: str, nprocs: int, *args: str) -> None:
    """Run tests/`script` under torchrun on `nprocs` processes; fail with the tail of its output if it fails.
    A run that only failed by gloo's abort (GLOO_ABORT) runs once more, with a warning."""
    result = launch(script, nprocs, args)
    if result.returncode != 0 and gloo_aborted(result):
        warnings.warn(f"{script}: a rank was aborted by gloo ({GLOO_ABORT!r}); rerunning once")
        result = launch(script, nprocs, args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def launch(script: str, nprocs: int, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
               str(TESTS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "LOG_RANK": "0"})


def gloo_aborted(result: subprocess.CompletedProcess) -> bool:
    """Whether the only failure was gloo's abort: its message, a rank killed by SIGABRT, and no Python error."""
    output = result.stdout + result.stderr
    return (GLOO_ABORT in output and "exitcode  : -6" in output
            and "Traceback" not in output.split(GLOO_ABORT)[0])
