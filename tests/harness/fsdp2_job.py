"""The two-rank FSDP job that the restart and preemption tests stop, kill, hang and compare with its uninterrupted
run (conftest.py's fsdp2_straight_run): the debug model, 10 steps of 2 x 32 tokens per rank, every step logged, a
checkpoint every 5 steps, launched as run_train.sh launches it (titan.launch), one thread per rank; or as two nodes
of one rank each, two launchers on localhost (launch_two_nodes)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from titan.launch import child_pids

from harness.debug_training import DEBUG_TOML
from harness.train_script import ROOT

STEPS = 10
CHECKPOINT_INTERVAL = 5
JOB = ["--job.config_file", DEBUG_TOML, "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--metrics.log_freq", "1", "--training.steps", str(STEPS), "--parallelism.data_parallel_shard_degree", "2",
       "--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_INTERVAL)]


def launch_job(folder: Path, *flags: str, script: Path = ROOT / "train.py", nprocs: int = 2, max_restarts: int = 2,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """JOB and `flags` (a later flag wins) in `folder` under titan.launch with a restart budget; `script` is train.py
    or a harness that wraps it."""
    command = [sys.executable, "-m", "titan.launch", "--standalone", "--nnodes=1", f"--nproc_per_node={nprocs}",
               f"--max-restarts={max_restarts}", str(script), *JOB, "--job.dump_folder", str(folder), *flags]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_RANK": "0", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=300)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch_two_nodes(folder: Path, *flags: str, max_restarts: int = 1,
                     timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """JOB and `flags` as two nodes of one rank each: two launchers on this machine that meet in a c10d rendezvous
    on localhost (as `python -m titan.launch --nnodes 2 --rdzv_backend c10d --rdzv_endpoint HEAD:PORT` on each node
    of a cluster), sharing `folder` as nodes share a filesystem. Each launcher's result, in start order; a launcher
    still running after `timeout` seconds (a job that never forms its process group again) is killed."""
    command = [sys.executable, "-m", "titan.launch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=localhost:{free_port()}", f"--rdzv_id={uuid.uuid4().hex}",
               f"--max-restarts={max_restarts}", str(ROOT / "train.py"), *JOB, "--job.dump_folder", str(folder), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_RANK": "0,1", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    deadline = time.monotonic() + timeout
    results = []
    for node in nodes:
        try:
            stdout, stderr = node.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Its ranks first: torchrun starts each in a session of its own, and they hold the launcher's output.
            for pid in [*child_pids(node.pid), node.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = node.communicate()
        results.append(subprocess.CompletedProcess(command, node.returncode, stdout, stderr))
    return results
