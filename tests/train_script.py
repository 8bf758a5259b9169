"""Run ./run_train.sh as a user does (real torchrun, real processes) and read back what it logged."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=full_env,
                          timeout=600)


def losses_of(folder: Path) -> list[float]:
    """Every logged loss of <folder>/metrics.jsonl, in order (a resumed run appends to it)."""
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(folder: Path) -> dict[int, float]:
    """Loss per step; where a resumed run logged a step again, its last value."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records}
