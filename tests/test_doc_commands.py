"""Every shell command of README.md and docs/*.md, run as a new user pastes it, in a folder laid out as a fresh
clone (tests/harness/doc_commands.py reads them): training commands shortened to one step of short sequences, the
rest as written.
A command fails the test when it fails, when a flag is rejected, or when it needs a file that a fresh clone lacks
and that no earlier command of its block (or the block it continues) makes. Commands that cannot run here say why
in the doc ([needs a GPU], ...) and are skipped with that reason. Output a doc quotes is checked against what its
command prints now. One-process training runs train.py's main() in this process (the launcher's start-up adds
nothing to one process); multi-process training shares one torchrun launch per world size (run_cases), started
when the first such command's test runs, so before the one-process commands of later blocks; every other command
runs in a shell."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan.config.errors import ConfigError
from titan.config.load import parse_args, to_toml

from harness.doc_commands import (
    DOCS,
    ROOT,
    DocCommand,
    Invocation,
    doc_commands,
    figure_mismatches,
    quoted_outputs,
    shortened,
    shortened_script,
    trainer_invocation,
)
from harness.torchrun import CaseResults, run_cases
from harness.train_script import run_train_argv

COMMANDS = [command for doc in DOCS for command in doc_commands(doc)]
QUOTED = [quoted for doc in DOCS for quoted in quoted_outputs(doc)]
CLONE = ("configs", "docs", "scripts", "titan", "tokenizers", "README.md", "pyproject.toml", "run_train.sh", "train.py")
"""What a fresh clone holds that the commands read (tests/ aside)."""
FIGURE_TOLERANCE = 0.02
"""A quoted figure may be this far (relative) from what the command prints: rounding, not drift."""


class Outputs:
    """What each command printed, the folder each block runs in, and which command ran each job, across the
    module's tests."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.folders: dict[tuple[Path, int], Path] = {}
        self.printed: dict[str, str] = {}
        self.runs_as: dict[DocCommand, DocCommand | None] | None = None
        """Each command's earlier twin (same_job_as), once worked out."""
        self.launched: CaseResults | None = None
        """The multi-process training commands' results, by case name (launch_multi_process)."""

    def folder(self, command: DocCommand) -> Path:
        """The block's folder: a fresh clone's layout of links, or the folder of the block it continues in."""
        key = (command.doc, command.block)
        if key not in self.folders:
            if command.folder_of is not None:
                earlier = next(c for c in COMMANDS if c.doc == command.doc and c.text == command.folder_of)
                self.folders[key] = self.folder(earlier)
            else:
                folder = self.tmp_path_factory.mktemp(f"clone-{command.doc.stem}-{command.block}")
                for name in CLONE:
                    (folder / name).symlink_to(ROOT / name)
                self.folders[key] = folder
        return self.folders[key]

    def same_job_as(self, command: DocCommand) -> DocCommand | None:
        """The command of an earlier block that runs the same job (job_key), whose run `command` reuses; None when
        it runs itself (the first of its job, or a repeat within one block, such as a rerun that resumes). A command
        whose flags do not parse runs itself, and fails its own test."""
        if self.runs_as is None:
            self.runs_as, first = {}, {}
            for other in COMMANDS:
                try:
                    earlier = first.setdefault(job_key(other), other)
                except (ConfigError, SystemExit):
                    earlier = other
                self.runs_as[other] = earlier if (earlier.doc, earlier.block) != (other.doc, other.block) else None
        return self.runs_as[command]

    def launch_multi_process(self) -> CaseResults:
        """Every multi-process training command that runs (not marked, not the same job as an earlier block's), in
        one torchrun launch per world size."""
        if self.launched is None:
            cases: dict[int, dict[str, list[str]]] = {}
            for command in COMMANDS:
                invocation = trainer_invocation(command.text)
                if (command.skip is None and trains(invocation) and invocation.processes > 1
                        and self.same_job_as(command) is None):
                    cases.setdefault(invocation.processes, {})[case_name(command)] = [
                        str(self.folder(command)), *shortened(invocation.argv)]
            self.launched = CaseResults({}, {})
            for processes, named in sorted(cases.items()):
                folder = self.tmp_path_factory.mktemp(f"launch{processes}")
                self.launched.update(run_cases("train_cases_harness.py", processes, folder, named))
        return self.launched


def case_name(command: DocCommand) -> str:
    return f"{command.doc.stem}_{command.line}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    return Outputs(tmp_path_factory)


def run_in_shell(text: str, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable}
    return subprocess.run(["bash", "-c", text], cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def job_key(command: DocCommand) -> str:
    """What the command runs: for a training command, its processes, environment and resolved config once
    shortened (so that two spellings of one job are one job); else its text."""
    invocation = trainer_invocation(command.text)
    if not trains(invocation):
        return command.text
    config = to_toml(parse_args(shortened(invocation.argv)))
    return f"{invocation.processes} {sorted(invocation.env.items())} {config}"


def trains(invocation: Invocation | None) -> bool:
    return invocation is not None and not {"--job.dry_run", "--job.print_config", "--help"} & set(invocation.argv)


def run_command(command: DocCommand, outputs: Outputs, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """(exit code, output) of the command, shortened where it trains or benchmarks."""
    invocation = trainer_invocation(command.text)
    folder = outputs.folder(command)
    if not trains(invocation):
        result = run_in_shell(shortened_script(command.text), folder)
        return result.returncode, result.stdout + result.stderr
    argv = shortened(invocation.argv)
    if invocation.processes > 1:
        assert not invocation.env, f"{command.name}: the shared launch passes no environment ({invocation.env})"
        launched = outputs.launch_multi_process()
        if case_name(command) in launched.results:
            return 0, ""
        return 1, launched.failures.get(case_name(command), "not launched")
    monkeypatch.chdir(folder)
    for name, value in invocation.env.items():
        monkeypatch.setenv(name, value)
    result = run_train_argv(argv)
    return result.returncode, result.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=[command.name for command in COMMANDS])
def test_documented_command_runs(command: DocCommand, outputs: Outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    if command.skip is not None:
        pytest.skip(f"{command.text}: {command.skip}")
    job_key(command)  # parses the flags: a rejected one fails here
    earlier = outputs.same_job_as(command)
    if earlier is not None:
        # The same job as in another block: it ran there, and this block goes on in that block's folder.
        outputs.printed[command.text] = outputs.printed[earlier.text]
        outputs.folders.setdefault((command.doc, command.block), outputs.folder(earlier))
        return
    code, printed = run_command(command, outputs, monkeypatch)
    assert code == 0, f"{command.name}: `{command.text}` exited with {code}:\n{printed[-4000:]}"
    outputs.printed[command.text] = printed


@pytest.mark.parametrize("quoted", QUOTED, ids=[f"{q.doc.relative_to(ROOT)}:{q.line}" for q in QUOTED])
def test_quoted_output_matches_the_command(quoted: object, outputs: Outputs) -> None:
    """Runs after every command (pytest keeps the order of definition): the figures of a quoted block are the ones
    its command prints now, within FIGURE_TOLERANCE."""
    if quoted.command not in outputs.printed:
        assert any(c.text == quoted.command for c in COMMANDS), (
            f"{quoted.doc}:{quoted.line} quotes the output of `{quoted.command}`, which is no command of the docs")
        pytest.skip(f"`{quoted.command}` did not run in this session")
    problems = figure_mismatches(quoted.lines, outputs.printed[quoted.command], FIGURE_TOLERANCE)
    assert not problems, f"{quoted.doc}:{quoted.line}:\n" + "\n".join(problems)


def test_every_mark_names_a_reason_and_every_command_is_read() -> None:
    """The reader finds the commands the docs show: each bash block yields at least one, and no command is left
    as an unrunnable placeholder (`...`) without a mark."""
    assert len(COMMANDS) > 40
    for command in COMMANDS:
        assert command.skip is not None or "..." not in command.text, f"{command.name}: a placeholder in {command}"
