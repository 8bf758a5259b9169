"""Run a check on CPU through TRITON_INTERPRET=1, which triton reads when it decorates kernels, so in a fresh
process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, call: str) -> None:
    """Import `module` (a tests/ module) in a fresh interpreted-Triton process and run `call` there; fail with its
    stderr if it raises."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = f"import {module}; {module}.{call}"
    result = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
