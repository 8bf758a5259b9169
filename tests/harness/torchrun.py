"""Launch a test script on several gloo processes with torchrun, as the multi-process tests do."""

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing

from titan.exits import exit_process

HARNESS = Path(__file__).resolve().parent
"""Where the scripts that run_torchrun and run_cases launch live: beside this module."""

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


def spawn_ranks(fn: Callable[..., None], nprocs: int, *args: object) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs) whose ranks end as every torchrun entry point does
    (titan/exits.py exit_process): a spawned rank that returns normally goes through interpreter finalization, where
    gloo has aborted it with SIGABRT ("terminate called without an active exception") after its work was done."""
    torch.multiprocessing.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs)


def _run_then_exit(rank: int, fn: Callable[..., None], args: tuple) -> NoReturn:
    fn(rank, *args)
    exit_process(0)


def finish_rank() -> NoReturn:
    """End a rank of a script run_torchrun launches, after its work: print the done marker, then exit 0."""
    print(f"{DONE_MARKER} {os.environ['RANK']}", flush=True)
    exit_process(0)


def save_every_rank_and_finish(results: dict, path: str) -> None:
    """End a rank of a script that compares on every rank: gather each rank's `results` (tensors cloned out of any
    collective's wrapper), rank 0 saves the list by rank to `path`, then the process group ends and the rank too."""
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        torch.save(gathered, path)
    dist.destroy_process_group()
    finish_rank()


def run_torchrun(script: str, nprocs: int, *args: str, timeout: float = 600) -> None:
    """Run tests/harness/`script` under torchrun on `nprocs` processes; fail with the tail of its output if it fails.
    A run that only failed by gloo's abort (GLOO_ABORT) after every rank finished its work runs once more, from
    none of the first attempt's files, with a GlooAbortRerun warning."""
    existing = named_paths(args)
    result = launch(script, nprocs, args, timeout)
    if result.returncode != 0 and gloo_aborted(result) and every_rank_done(result, nprocs):
        warnings.warn(GlooAbortRerun(f"{script}: a rank was aborted by gloo ({GLOO_ABORT!r}) after every rank "
                                     f"finished; rerunning once"))
        remove_new_paths(args, existing)
        result = launch(script, nprocs, args, timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def launch(script: str, nprocs: int, args: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
               str(HARNESS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LOG_RANK": "0", "PYTHONFAULTHANDLER": "1"})


SECONDS_PER_CASE = 150
"""run_cases' time limit per case: a few steps of the debug model, compiled or not, on slow shared CI cores."""


class CaseResults:
    """What run_cases got: each finished case's result, and for each case that did not finish, its launch's
    failure."""

    def __init__(self, results: dict[str, dict], failures: dict[str, str]) -> None:
        self.results = results
        self.failures = failures

    def __getitem__(self, name: str) -> dict:
        """The result of case `name`; fails the calling test, with the launch's output, if the case never finished."""
        if name not in self.results:
            raise AssertionError(f"case {name!r} did not finish: its launch failed at it or before it.\n"
                                 f"{self.failures.get(name, 'it was not run')}")
        return self.results[name]

    def update(self, other: "CaseResults") -> None:
        """Add the cases of another launch."""
        self.results.update(other.results)
        self.failures.update(other.failures)


def run_cases(script: str, nprocs: int, folder: Path, cases: dict[str, list[str]]) -> CaseResults:
    """Run the `cases` (name -> the script's flags) of one world size in turn, in one torchrun launch of
    tests/harness/`script`: starting the ranks costs more than most cases (torch's import, gloo's rendezvous). The
    script hands each case to run_each_case, which saves its result to `folder`/<name>.pt. A case that fails stops
    the launch; the cases before it keep their results, so every test still judges its own case."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "cases.json"
    spec.write_text(json.dumps(cases))
    try:
        run_torchrun(script, nprocs, str(folder), str(spec), timeout=SECONDS_PER_CASE * len(cases))
        failure = ""
    except (AssertionError, subprocess.TimeoutExpired) as error:
        failure = str(error)
    results = {name: torch.load(folder / f"{name}.pt") for name in cases if (folder / f"{name}.pt").exists()}
    return CaseResults(results, {name: failure for name in cases if name not in results})


def run_each_case(run_case: Callable[[list[str], int], dict]) -> None:
    """The harness side of run_cases (argv: the folder and the case file): `run_case(flags, world_size)` runs one
    case on this rank and returns rank 0's result, saved as each case finishes. Compiled code is dropped between
    cases: dynamo's recompile limit, counted per code object across cases, would otherwise fall back to eager.
    Before that, the case's trainer, whose modules hold reference cycles through their hooks, is collected: so its
    compiled modules are freed while dynamo's caches still hold their entries, not by a collection during a later
    case, after the reset. A precaution: dynamo has crashed on compiled code used after a reset
    (pytorch/pytorch#155057), and a rank of this harness once died by SIGSEGV, without a Python error, three cases
    after a compiled one."""
    folder, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    world_size = int(os.environ["WORLD_SIZE"])
    # What the imports made lives as long as the process: frozen out of the collector, the collection after each
    # case walks only what the cases made (a full walk of torch's objects takes 0.2 s a case).
    gc.freeze()
    for name, flags in cases.items():
        result = run_case(flags, world_size)
        if int(os.environ["RANK"]) == 0:
            torch.save(result, folder / f"{name}.pt")
        gc.collect()
        torch._dynamo.reset()


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
