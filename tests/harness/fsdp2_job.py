"""The two-rank FSDP job that the restart and preemption tests stop, kill, hang and compare with its uninterrupted
run (conftest.py's fsdp2_straight_run): the debug model, 10 steps of 2 x 32 tokens per rank, every step logged, a
checkpoint every 5 steps, launched as run_train.sh launches it (titan.launch), one thread per rank."""

import os
import subprocess
import sys
from pathlib import Path

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
