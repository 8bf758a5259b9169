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


def metric_records(folder: Path) -> list[dict]:
    """Every record of <folder>/metrics.jsonl, in order (a resumed run appends to it)."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses_of(folder: Path) -> list[float]:
    """Every logged training loss, in order."""
    return [record["loss"] for record in metric_records(folder) if "loss" in record]


def losses_by_step(folder: Path) -> dict[int, float]:
    """Training loss per step; where a resumed run logged a step again, its last value."""
    return {record["step"]: record["loss"] for record in metric_records(folder) if "loss" in record}


def validation_records(folder: Path) -> list[dict]:
    """Every evaluation's record (val_loss, val_perplexity, val_tokens), in order."""
    return [record for record in metric_records(folder) if "val_loss" in record]
