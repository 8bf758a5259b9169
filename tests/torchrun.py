"""Launch a test script on several gloo processes with torchrun, as the multi-process tests do."""

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from titan.exits import exit_process

TESTS = Path(__file__).resolve().parent

# gloo on CPU, rarely, aborts a rank from C++ with this message and SIGABRT (exit -6), without a Python error. The
# cause found (interpreter finalization after destroy_process_group) is avoided by titan/exits.py exit_process, which
# every entry point under torchrun ends with; this rerun stays as the net for any other cause. The runs are
# deterministic, so one rerun tells that abort apart from a real failure.
GLOO_ABORT = "terminate called without an active exception"
DONE_MARKER = "TITAN_RANK_DONE"
"""The line `DONE_MARKER <rank>` that each rank of a script run_torchrun launches prints once its work is done
(finish_rank): an abort before every rank printed it may have cut the work short, so it is never rerun."""


class GlooAbortRerun(UserWarning):
    """run_torchrun reran a script that only failed by gloo's abort. conftest.py fails the session when a test
    emitted one, so an intermittent crash that the rerun hid still fails CI, with the test named."""


def finish_rank() -> NoReturn:
    """End a rank of a script run_torchrun launches, after its work: print the done marker, then exit 0."""
    print(f"{DONE_MARKER} {os.environ['RANK']}", flush=True)
    exit_process(0)


def run_torchrun(script: str, nprocs: int, *args: str) -> None:
    """Run tests/`script` under torchrun on `nprocs` processes; fail with the tail of its output if it fails.
    A run that only failed by gloo's abort (GLOO_ABORT) after every rank finished its work runs once more, from
    none of the first attempt's files, with a GlooAbortRerun warning."""
    existing = named_paths(args)
    result = launch(script, nprocs, args)
    if result.returncode != 0 and gloo_aborted(result) and every_rank_done(result, nprocs):
        warnings.warn(GlooAbortRerun(f"{script}: a rank was aborted by gloo ({GLOO_ABORT!r}) after every rank "
                                     f"finished; rerunning once"))
        remove_new_paths(args, existing)
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


def every_rank_done(result: subprocess.CompletedProcess, nprocs: int) -> bool:
    """Whether each of the `nprocs` ranks printed its done marker (finish_rank) before the run ended."""
    done = re.findall(rf"^{DONE_MARKER} (\d+)$", result.stdout, flags=re.MULTILINE)
    return {int(rank) for rank in done} == set(range(nprocs))


def named_paths(args: tuple[str, ...]) -> set[Path]:
    """Every existing file or folder that an absolute path among `args` names, with everything under its folders."""
    found = set()
    for path in map(Path, args):
        if path.is_absolute() and path.exists():
            found.add(path)
            if path.is_dir():
                found.update(path.rglob("*"))
    return found


def remove_new_paths(args: tuple[str, ...], existing: set[Path]) -> None:
    """Delete what a failed attempt wrote at the paths in `args` (outputs, dump folders), keeping `existing`."""
    for path in sorted(named_paths(args) - existing):  # a folder sorts before its contents
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
