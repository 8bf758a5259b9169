"""Launch a test script on several gloo processes with torchrun, as the multi-process tests do."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_torchrun(script: str, nprocs: int, *args: str) -> None:
    """Run tests/`script` under torchrun on `nprocs` processes; fail with the tail of its output if it fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
               str(TESTS / script), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "LOG_RANK": "0"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
