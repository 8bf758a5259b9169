"""Stopping early and hangs, on real processes and the real loop: a stop signal on any rank or --job.time_limit saves
at a step boundary and exits 4, and rerunning resumes bit for bit; a single hung process writes its stacks and exits
5 (two ranks, one hung, and the restart after it: tests/test_restarts.py)."""

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan.checkpoint.storage import LocalSteps
from titan.config.domain import parse_duration
from titan.config.errors import ConfigError
from titan.exits import run_main
from titan.parallel.dims import has_nccl
from titan.train.preemption import REPEAT_AFTER_SECONDS, SignalFlag
from titan.train.trainer import Trainer
from titan.train.watchdog import Watchdog
from titan.validate import load_job_config

from harness.debug_training import build_trainer
from harness.fsdp2_job import CHECKPOINT_INTERVAL, JOB, STEPS, launch_job
from harness.train_script import ROOT, losses_by_step, metric_records

STOP_STEP = 7
"""The step at which the stop tests send SIGTERM: after the checkpoint of step 5, before the run's end."""
# harness/fsdp2_job.py's job, whose two-rank run the two-rank test compares with, on one process here: its flags
# between its job file (the debug model's, which build_trainer gives) and its FSDP degree.
SMALL = JOB[JOB.index("--job.config_file") + 2:JOB.index("--parallelism.data_parallel_shard_degree")]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_INTERVAL)]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]


def loaded_line(folder: Path, step: int) -> str:
    """The start of the line a run logs when it resumes from `folder`'s checkpoint of `step`."""
    return f"Loaded {folder}/checkpoint/step-{step}: step {step},"


def loss_steps_since(folder: Path, num_earlier_records: int) -> list[int]:
    """The steps of the losses in <folder>/metrics.jsonl after its first `num_earlier_records` records: what a rerun
    logged. A rerun appends to the file and losses_by_step keeps each step's last value, so a rerun that trained from
    step 1 again would pass a comparison of losses_by_step alone."""
    return [record["step"] for record in metric_records(folder)[num_earlier_records:] if "loss" in record]


def act_after_step(trainer: Trainer, step: int, action: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `action()` at the end of `step` (every step for step 0), inside the real loop."""
    train_step = trainer.train_step

    def train_step_then_act(data_iterator) -> tuple:
        result = train_step(data_iterator)
        if step in (0, trainer.step):
            action()
        return result

    monkeypatch.setattr(trainer, "train_step", train_step_then_act)


def launch(nprocs: int, action: str | None, folder: Path, *flags: str) -> subprocess.CompletedProcess:
    """tests/harness/stop_harness.py (train.py doing `action` at one step on one rank, or nothing for None) on
    harness/fsdp2_job.py's job (one rank: without FSDP) under titan.launch, with a restart budget: a stop is not
    restarted."""
    one_rank = ["--parallelism.data_parallel_shard_degree", "1"] if nprocs == 1 else []
    return launch_job(folder, *one_rank, *flags, script=ROOT / "tests" / "harness" / "stop_harness.py",
                      nprocs=nprocs, env={"TITAN_TEST_ACTION": action} if action is not None else {})


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Train in this process on one thread, like the launched ranks: the same losses bit for bit, and no threads
    spinning against other processes for the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of the straight STEPS-step single-process run."""
    folder = tmp_path_factory.mktemp("straight")
    build_trainer(folder, *SMALL).run()
    return losses_by_step(folder)


def test_time_limit_spellings() -> None:
    assert [parse_duration(text) for text in ("3h50m", "90m", "45s", "1h", "1h0m5s")] == [13800, 5400, 45, 3600, 3605]
    for bad in ("3 hours", "1.5h", "50m3h", "90", "0s", ""):
        with pytest.raises(ConfigError, match=f"--job.time_limit '{bad}' is not a duration.*3h50m, 90m, 45s"):
            load_job_config(["--job.time_limit", bad], world_size=1)


def test_sigterm_to_the_launcher_saves_and_the_rerun_resumes_exactly(tmp_path: Path,
                                                                     one_process_losses: dict[int, float],
                                                                     titan_records: list[logging.LogRecord]) -> None:
    """SIGTERM to the launcher (as Slurm or Kubernetes send it) at STOP_STEP: it passes the signal on, the
    rank finishes that step, saves it and exits 4, and so does the launcher. Rerunning resumes with the straight run's
    losses, bit for bit."""
    flags = [*CHECKPOINT, "--checkpoint.async_mode", "async"]  # the stop's save blocks all the same
    result = launch(1, f"{STOP_STEP}:0:launcher", tmp_path, *flags)
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    assert "The launcher received SIGTERM and passed it on to its ranks." in output
    assert f"Rank 0 received SIGTERM: finishing step {STOP_STEP}, then saving a checkpoint and exiting." in output
    assert (f"Stopped at step {STOP_STEP}: rank 0 received SIGTERM. Its checkpoint is "
            f"{tmp_path}/checkpoint/step-{STOP_STEP}; rerun the same command to resume.") in output
    assert "Traceback" not in output
    assert LocalSteps(tmp_path / "checkpoint").complete_steps() == [5, STOP_STEP]
    num_stopped_records = len(metric_records(tmp_path))
    build_trainer(tmp_path, *SMALL, *flags).run()  # the same flags, in this process
    assert loss_steps_since(tmp_path, num_stopped_records) == list(range(STOP_STEP + 1, STEPS + 1))
    assert any(record.getMessage().startswith(loaded_line(tmp_path, STOP_STEP)) for record in titan_records)
    assert losses_by_step(tmp_path) == one_process_losses


def test_sigterm_on_one_of_two_ranks_stops_both_and_the_rerun_resumes_exactly(
        tmp_path: Path, fsdp2_straight_run: tuple[Path, str]) -> None:
    """FSDP=2 (harness/fsdp2_job.py's job): only rank 1 gets SIGTERM, at STOP_STEP. Both ranks stop after that step,
    with its checkpoint, exit code 4 through the launcher, which does not restart them; the same command again
    finishes the run with the straight run's losses, bit for bit."""
    folder = tmp_path / "stopped"
    stopped = launch(2, f"{STOP_STEP}:1:signal", folder, *CHECKPOINT, *FSDP2)
    assert stopped.returncode == 4, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert f"[rank1] WARNING Rank 1 received SIGTERM: finishing step {STOP_STEP}" in stopped.stdout
    for rank in (0, 1):
        assert f"[rank{rank}] ERROR Stopped at step {STOP_STEP}: rank 1 received SIGTERM." in stopped.stdout
    assert "exited with code 4, which ends the job without a restart (--max-restarts 2)" in stopped.stdout
    assert LocalSteps(folder / "checkpoint").complete_steps() == [5, STOP_STEP]
    num_stopped_records = len(metric_records(folder))
    rerun = launch(2, f"{STOP_STEP}:1:signal", folder, *CHECKPOINT, *FSDP2)  # resumes after it, so it sends nothing
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"[rank0] INFO {loaded_line(folder, STOP_STEP)}" in rerun.stdout, rerun.stdout[-3000:]
    assert loss_steps_since(folder, num_stopped_records) == list(range(STOP_STEP + 1, STEPS + 1))
    assert losses_by_step(folder) == losses_by_step(fsdp2_straight_run[0])


def test_time_limit_saves_and_stops_then_the_rerun_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          titan_records: list[logging.LogRecord]) -> None:
    """Steps of at least 0.2s against --job.time_limit 1s: the run stops after some step k, by step 5 at the latest
    (1s has passed then), with exit code 4 and a checkpoint of step k; a rerun without the limit goes on from k,
    with a straight run's losses, bit for bit."""
    flags = ["--training.steps", "6", *CHECKPOINT]
    folder = tmp_path / "run"
    trainer = build_trainer(folder, *SMALL, *flags, "--job.time_limit", "1s")
    act_after_step(trainer, 0, lambda: time.sleep(0.2), monkeypatch)
    assert run_main(trainer.run) == 4
    message = titan_records[-1].getMessage()
    assert "--job.time_limit 1s leaves too little time for another step" in message, message
    stopped = LocalSteps(folder / "checkpoint").complete_steps()[-1]
    assert stopped <= 5 and message.startswith(f"Stopped at step {stopped}:")
    assert f"Its checkpoint is {folder}/checkpoint/step-{stopped}; rerun the same command to resume." in message
    num_stopped_records = len(metric_records(folder))
    build_trainer(folder, *SMALL, *flags).run()
    assert any(record.getMessage().startswith(loaded_line(folder, stopped)) for record in titan_records)
    assert loss_steps_since(folder, num_stopped_records) == list(range(stopped + 1, 7))
    # The STEPS-step straight run warms up over other steps (the warmup is cut to --training.steps): its own reference.
    build_trainer(tmp_path / "straight", *SMALL, "--training.steps", "6").run()
    assert losses_by_step(folder) == losses_by_step(tmp_path / "straight")


def test_stop_without_checkpoints_says_nothing_was_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         titan_records: list[logging.LogRecord]) -> None:
    """Ctrl-C (SIGINT) without --checkpoint.enable: the same clean stop, exit code 4, and the message says so."""
    # A shell starts background jobs (`bash .ci/run &`) with SIGINT ignored, and Titan leaves ignored signals alone.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer = build_trainer(tmp_path, *SMALL, "--training.steps", "4")
    act_after_step(trainer, 2, lambda: os.kill(os.getpid(), signal.SIGINT), monkeypatch)
    try:
        assert run_main(trainer.run) == 4
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are put back
    finally:
        signal.signal(signal.SIGINT, previous)
    messages = [record.getMessage() for record in titan_records]
    assert any("Rank 0 received SIGINT: finishing step 2, then exiting (checkpoints are off)." in message
               for message in messages)
    assert messages[-1].startswith("Stopped at step 2: rank 0 received SIGINT. No state was saved, since "
                                   "--checkpoint.enable is off")
    assert not (tmp_path / "checkpoint").exists()


def test_the_same_signal_again_exits_at_once() -> None:
    """A repeat within REPEAT_AFTER_SECONDS is the same signal delivered twice and changes nothing; a later one
    restores the previous handler and raises the signal again, which now reaches that handler."""
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    flag = SignalFlag(rank=0, plan=lambda: "finishing step 1, then saving a checkpoint and exiting")
    try:
        flag.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.signum == signal.SIGUSR1 and received == []
        time.sleep(REPEAT_AFTER_SECONDS)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
    finally:
        flag.restore()
        signal.signal(signal.SIGUSR1, previous)


def test_a_single_process_that_hangs_writes_its_stacks_and_exits_5(tmp_path: Path) -> None:
    """One process, no peers to ask: the watchdog still writes the stacks and ends the process with code 5."""
    script = (f"import time; from pathlib import Path; from titan.train.watchdog import Watchdog\n"
              f"watchdog = Watchdog(1, Path({str(tmp_path)!r}), rank=0, world_size=1, traces_folder=None)\n"
              f"watchdog.step_ended(7)\n"
              f"def stuck_after_step_7(): time.sleep(60)\n"
              f"stuck_after_step_7()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 5, result.stdout + result.stderr
    assert "in stuck_after_step_7" in (tmp_path / "hang" / "rank_0.txt").read_text()


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_the_watchdog_dumps_nccls_flight_recorder_beside_gloo(backend: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's flight recorder is dumped whenever the default group runs NCCL, also beside gloo for host tensors
    (--training.enable_cpu_offload's backend string), whose dump comes too. A CPU build has no NCCL dump to call: the
    two dumps stand in for torch's, recording that they were asked."""
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda **kwargs: b"nccl", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda **kwargs: b"gloo")
    watchdog = Watchdog(60, tmp_path, rank=3, world_size=2, traces_folder=tmp_path)
    written = watchdog.write_comm_traces()
    assert [path.name for path in written] == ["rank_3", "gloo_rank_3"]
    assert (tmp_path / "rank_3").read_bytes() == b"nccl"


def test_backend_strings_with_nccl() -> None:
    assert has_nccl("nccl") and has_nccl("cuda:nccl,cpu:gloo") and has_nccl("cpu:gloo,cuda:nccl")
    assert not has_nccl("gloo") and not has_nccl("cpu:gloo")
