"""Shared fixtures, and the session's exit status when run_torchrun had to rerun a launch."""

import logging
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from titan.checkpoint.hf_io import save_hf
from titan.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer, build_tokenizer

from harness.debug_training import train_losses
from harness.fsdp2_job import launch_job
from harness.hf_models import DEBUG, SMALL_SHARD_BYTES, TOKENIZER
from harness.models import build_model
from harness.torchrun import GlooAbortRerun
from harness.train_script import run_train, titan_log


def pytest_configure(config: pytest.Config) -> None:
    """Token stores made on first use go to a folder of this session (which every launched rank inherits), not to
    the user's ~/.cache."""
    if "TITAN_CACHE_DIR" not in os.environ:
        os.environ["TITAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="titan_test_cache_")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("TITAN_CACHE_DIR"), ignore_errors=True))


RERUN_TESTS: list[str] = []
"""The tests in which run_torchrun reran a launch that gloo aborted (a GlooAbortRerun warning)."""


@pytest.fixture
def titan_records() -> Iterator[list[logging.LogRecord]]:
    """Every record the `titan` logger emits during the test, exactly once (harness.train_script.titan_log)."""
    with titan_log() as records:
        yield records


@pytest.fixture(scope="session")
def fsdp2_straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted run of harness.fsdp2_job's JOB, which the restart and stop tests match bit for bit: (its
    folder, its output). Its rank 1 is also a straggler from step 3 on (--fault.kind slow: sleeps in its optimizer
    steps, which change no value), for test_restarts.py's straggler test."""
    folder = tmp_path_factory.mktemp("fsdp2_straight")
    result = launch_job(folder, "--fault.kind", "slow", "--fault.rank", "1", "--fault.step", "2",
                        "--fault.slow_seconds", "0.05", "--metrics.straggler_window", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result.stdout + result.stderr


@pytest.fixture(scope="session")
def fp32_debug_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the debug model's 15 fp32 steps (harness.debug_training.train), the run that the float8 and MX
    training tests compare with (test_float8.py, test_mx.py)."""
    return train_losses(tmp_path_factory.mktemp("fp32"), "--training.steps", "15")


@pytest.fixture(scope="session")
def run_train_help() -> subprocess.CompletedProcess:
    """`./run_train.sh --help`, run once for the tests of its text (test_launch.py, test_bad_inputs.py)."""
    return run_train("--help")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The shipped tokenizer (titan.data.tokenizer.SHIPPED_TOKENIZER), for the data and token-store tests."""
    return build_tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def debug_model() -> nn.Module:
    """The Llama debug model at the shipped tokenizer's vocabulary (harness.hf_models.DEBUG), seed 0, for the Hugging
    Face tests (test_hf.py, test_hf_llama.py)."""
    return build_model(DEBUG)


@pytest.fixture(scope="module")
def hf_folder(debug_model: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug model as a float32 Hugging Face folder in 6 shards. Read-only: tests that damage it copy it."""
    folder = tmp_path_factory.mktemp("hf")
    save_hf(debug_model.state_dict(), folder, DEBUG, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    return folder


def pytest_warning_recorded(warning_message: warnings.WarningMessage, when: str, nodeid: str,
                            location: tuple[str, int, str] | None) -> None:
    if issubclass(warning_message.category, GlooAbortRerun):
        RERUN_TESTS.append(nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A rerun launch may have hidden an intermittent crash, so a session with one fails even when every test
    passed; each test still reports its own result."""
    if RERUN_TESTS and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if RERUN_TESTS:
        terminalreporter.section("gloo abort reruns", red=True)
        for nodeid in RERUN_TESTS:
            terminalreporter.write_line(f"{nodeid}: run_torchrun reran a launch that gloo aborted; the session fails "
                                        f"so that an intermittent crash cannot pass unseen "
                                        f"(see tests/harness/torchrun.py).")
