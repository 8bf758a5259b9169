"""How fast a job heals, and what faults cost it: real launches of run_train.sh's launcher, faults from [fault].

    python scripts/bench_recovery.py --recovery        # the seconds from a kill to the first new step, by part
    python scripts/bench_recovery.py --random          # time to 300 steps, faults every 60 s on average, vs none

--recovery: the debug model on FSDP 2 ranks, a checkpoint every 10 steps, rank 1 SIGKILLed at the end of step 15;
the parts come from the job's goodput log (titan/metrics/goodput.py): the launcher seeing the failure, stopping the
survivors and starting new ranks, the new process's imports, the build, the checkpoint read (with the data loader),
and the first step. Once eager, once compiled (inductor's caches, kept across restarts, make the restart's compile
cheaper than the first one).
--random: the same job for 300 steps, checkpoints every 10, against the same with a random kill, hang or SIGSTOP of a
random rank every --mean-interval seconds on average (--fault.kind random); hangs are detected by a 10 s watchdog.
Prints time to the last step, goodput, the steps lost and the restarts of each.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.metrics.goodput import read_events  # noqa: E402

JOB = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--parallelism.data_parallel_shard_degree",
       "2", "--checkpoint.enable", "--checkpoint.interval", "10", "--metrics.log_freq", "10"]


def launch(folder: Path, *flags: str, max_restarts: int, env: dict[str, str] | None = None) -> float:
    """Train under titan.launch on 2 ranks; the wall seconds it took."""
    command = [sys.executable, "-m", "titan.launch", "--standalone", "--nnodes=1", "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", str(ROOT / "train.py"), *JOB, "--job.dump_folder", str(folder), *flags]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=full_env)
    if result.returncode != 0:
        raise SystemExit(f"the run in {folder} failed with code {result.returncode}:\n{result.stdout[-3000:]}")
    return time.perf_counter() - start


def recovery_parts(folder: Path) -> dict[str, float]:
    """Seconds of each part from the fault to the first step after it, from the goodput log."""
    events = read_events(folder)
    fault = next(i for i, event in enumerate(events) if event["event"] == "fault")
    after = events[fault:]
    at = {kind: next(event["t"] for event in after if event["event"] == kind)
          for kind in ("fault", "failure", "start", "init", "built", "loaded", "ready", "step")}
    return {"launcher sees the failure": at["failure"] - at["fault"],
            "survivors stopped, ranks started": at["start"] - at["failure"],
            "interpreter and imports": at["init"] - at["start"],
            "build (mesh, model, FSDP, optimizer)": at["built"] - at["init"],
            "data loader and checkpoint read": at["loaded"] - at["built"],
            "metrics and loop set-up": at["ready"] - at["loaded"],
            "first step": at["step"] - at["ready"],
            "total: fault to first new step": at["step"] - at["fault"]}


def first_step_seconds(folder: Path) -> float:
    """The first attempt's first step (with compile: compiling with an empty cache)."""
    events = read_events(folder)
    ready = next(event["t"] for event in events if event["event"] == "ready")
    return next(event["t"] for event in events if event["event"] == "step") - ready


def recovery(work: Path) -> None:
    for name, flags in (("eager", []), ("compiled", ["--compile.enable"])):
        folder = work / f"recovery_{name}"
        # An empty inductor cache of this job's own: the first attempt compiles cold, the restart finds its graphs.
        launch(folder, "--training.steps", "20", "--fault.kind", "kill", "--fault.rank", "1", "--fault.step", "15",
               *flags, max_restarts=1, env={"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor_{name}")})
        print(f"\n{name}: kill of rank 1 at the end of step 15, newest checkpoint step 10")
        for part, seconds in recovery_parts(folder).items():
            print(f"  {part:<40} {seconds:6.2f} s")
        print(f"  (the first attempt's first step: {first_step_seconds(folder):.2f} s)")


def goodput_record(folder: Path) -> dict:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "goodput_pct" in record][-1]


def random_faults(work: Path, steps: int, mean_interval: float, seed: int) -> None:
    shapes = ["--training.steps", str(steps), "--training.seq_len", "256", "--training.local_batch_size", "8",
              "--comm.train_timeout_seconds", "10"]
    runs = {"no faults": [], f"a fault every {mean_interval:.0f} s on average": [
        "--fault.kind", "random", "--fault.mean_interval_seconds", str(mean_interval), "--fault.seed", str(seed)]}
    print(f"\n{steps} steps, seq_len 256 x 8, checkpoint every 10 steps, hang watchdog 10 s")
    for name, flags in runs.items():
        folder = work / name.replace(" ", "_")
        wall = launch(folder, *shapes, *flags, max_restarts=100)
        record = goodput_record(folder)
        faults = [event["kind"] for event in read_events(folder) if event["event"] == "fault"]
        print(f"  {name:<34} {wall:6.1f} s to step {steps}, goodput {record['goodput_pct']:5.1f}%, "
              f"{record['steps_lost']} steps lost, {record['restarts']} restarts (faults: {', '.join(faults) or '-'}); "
              f"productive {record['productive_s']:.0f} s, lost {record['lost_s']:.0f} s, start-up "
              f"{record['startup_s']:.0f} s, restarts {record['restart_s']:.0f} s, checkpoints "
              f"{record['checkpoint_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recovery", action="store_true")
    parser.add_argument("--random", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mean-interval", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        if args.recovery:
            recovery(Path(work))
        if args.random:
            random_faults(Path(work), args.steps, args.mean_interval, args.seed)


if __name__ == "__main__":
    main()
