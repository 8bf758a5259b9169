"""Run ./run_train.sh as a user does (real torchrun, real processes), or train.py's main in this process where one
process is all a test needs, and read back what it logged."""

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from titan.metrics.log import logger

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("titan_train_entry", ROOT / "train.py")
TRAIN = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TRAIN)
"""train.py as a module: its main() is what every rank runs, exit code and all."""


@contextmanager
def titan_log() -> Iterator[list[logging.LogRecord]]:
    """Every record the `titan` logger emits inside, exactly once, whatever handlers or propagation init_logger or
    pytest set up."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.INFO)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def run_train_here(*args: str) -> subprocess.CompletedProcess:
    """A one-process ./run_train.sh, run in this process: train.py's main() on run_train.sh's default config file
    and `args`, without the start-up of the launcher, torchrun and a worker (seconds each), which add nothing to one
    process's run. stdout holds every message the run logged, with the traceback of any record that carries one, as
    a rank prints them."""
    return run_train_argv(["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), *args])


def run_train_argv(argv: list[str]) -> subprocess.CompletedProcess:
    """train.py's main() on `argv` in this process, as run_train_here runs it (no default config file)."""
    with titan_log() as records:
        code = TRAIN.main(argv)
    formatter = logging.Formatter("%(message)s")
    return subprocess.CompletedProcess(argv, code, "\n".join(map(formatter.format, records)), "")


def run_train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=full_env,
                          timeout=600)


def train_to_the_end(folder: Path, *args: str, nprocs: int = 1) -> subprocess.CompletedProcess:
    """A run of `args` in `folder` that must finish: on one process in this process (run_train_here), on more
    through ./run_train.sh (NGPU=nprocs). A failed run fails the test with the end of its output."""
    args = ("--job.dump_folder", str(folder), *args)
    result = run_train_here(*args) if nprocs == 1 else run_train(*args, env={"NGPU": str(nprocs)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


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


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant, as a node failure would: torchrun starts its workers in their own
    sessions, so killing the launcher's process group alone would leave the worker training."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    stack, tree = [pid], []
    while stack:
        tree.append(stack.pop())
        stack.extend(children.get(tree[-1], []))
    for member in reversed(tree):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
