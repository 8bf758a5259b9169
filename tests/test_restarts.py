"""In-job restarts (--max-restarts) on real processes: FSDP 2 over gloo under titan.launch (harness/fsdp2_job.py),
faults from the fault harness ([fault]) or the S3 test server. A killed rank, a hang and a refused save are restarted
and the job's losses equal an uninterrupted run's bit for bit; a spent budget ends with code 7; the goodput record
tiles the wall time; a slow rank is named.
That a config mistake, a divergence and a stop signal are not restarted is checked where those exits are tested
(test_launch.py, test_preemption.py), with a restart budget given."""

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan.checkpoint.storage import MARKER
from titan.metrics.goodput import CATEGORIES, measure_goodput, read_events

from harness.fsdp2_job import STEPS, launch_job, launch_two_nodes
from harness.s3_server import S3Server
from harness.train_script import losses_by_step, metric_records


@pytest.fixture
def straight_losses(fsdp2_straight_run: tuple[Path, str]) -> dict[int, float]:
    return losses_by_step(fsdp2_straight_run[0])


def steps_trained(folder: Path) -> list[int]:
    """Every step rank 0 finished, in order, across attempts (the goodput log)."""
    return [event["step"] for event in read_events(folder) if event["event"] == "step"]


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.close()


def test_a_killed_rank_then_a_refused_save_restart_and_the_job_matches_an_uninterrupted_run(
        tmp_path: Path, s3_server: S3Server, straight_losses: dict[int, float]) -> None:
    """Checkpoints on S3 every 5 steps. Rank 1 is SIGKILLed at the end of step 7: the launcher names it and restarts
    every rank from step 5. Then the S3 server refuses step 10's marker, the object that publishes it, once every
    file and the metadata are written: rank 0 stops with code 6 naming the URL and the intact step 5, and the second
    restart ignores the unpublished step 10 and resumes from step 5 again. The job ends with code 0 and the straight
    run's losses. Its goodput record's categories add up to its wall time, which is the launch's as measured here,
    and the steps lost are the steps trained more than once."""
    refused: list[str] = []

    def refuse_step_10_marker_once(method: str, path: str) -> int | None:
        if method == "PUT" and path.endswith(f"/run/step-10/{MARKER}") and not refused:
            refused.append(path)
            return 503
        return None

    s3_server.hook = refuse_step_10_marker_once
    subprocess.run([sys.executable, "-c", "import fsspec; fsspec.filesystem('s3').mkdir('titan-restarts')"],
                   env={**os.environ, **s3_server.env}, check=True)
    url = "s3://titan-restarts/run"
    started = time.time()
    # botocore would retry the 503 on its own; one attempt makes the refusal reach the save.
    result = launch_job(tmp_path, "--checkpoint.folder", url, "--fault.kind", "kill", "--fault.rank", "1",
                        "--fault.step", "7", env={**s3_server.env, "AWS_MAX_ATTEMPTS": "1"})
    wall = time.time() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert ("Restart 1 of 2 (--max-restarts): rank 1 was killed by SIGKILL, after step 7. Every rank restarts and "
            "resumes from the newest complete checkpoint.") in output
    assert refused and f"Saving the checkpoint of step 10 to {url}/step-10 failed" in output
    assert f"It was not published: the newest complete checkpoint, {url}/step-5, is intact" in output
    assert ("Restart 2 of 2 (--max-restarts): rank 0 exited with code 6 (failed to save a checkpoint), after step 10. "
            "Every rank restarts") in output
    assert f"Ignoring incomplete checkpoint {url}/step-10" in output
    assert output.count(f"Loaded {url}/step-5: step 5,") == 2
    listed = subprocess.run([sys.executable, "-c", f"import fsspec; print(fsspec.filesystem('s3').ls({url!r}))"],
                            env={**os.environ, **s3_server.env}, capture_output=True, text=True, check=True).stdout
    assert "step-10" in listed and "step-5" in listed
    assert losses_by_step(tmp_path) == straight_losses
    trained = steps_trained(tmp_path)
    assert trained == [*range(1, 8), *range(6, STEPS + 1), *range(6, STEPS + 1)]

    record = [r for r in metric_records(tmp_path) if "goodput_pct" in r][-1]
    assert record["restarts"] == 2 and record["launches"] == 1
    assert record["steps_lost"] == len(trained) - STEPS == 7
    assert sum(record[key] for key in CATEGORIES) == pytest.approx(record["wall_s"], rel=0.01)
    assert wall - 2.0 < record["wall_s"] <= wall  # all but the launcher's exit after rank 0's record
    assert record["productive_s"] > 0 and record["lost_s"] > 0 and record["restart_s"] > 0
    assert "Goodput " in output and "; 2 restarts:" in output


def test_a_hung_rank_ends_the_attempt_with_its_stacks_and_the_restart_recovers(tmp_path: Path,
                                                                             straight_losses: dict[int, float]) -> None:
    """Rank 1 hangs after step 7 (the fault harness's sleep in its training thread) while rank 0 goes on into step 8:
    both watchdogs write their stacks and flight-recorder dumps (rank 0 waits in the collective after the last one
    rank 1 ran) and exit 5 without a gloo timeout, and the restart finishes the job with the straight run's losses."""
    result = launch_job(tmp_path, "--fault.kind", "hang", "--fault.rank", "1", "--fault.step", "7",
                        "--comm.train_timeout_seconds", "2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    stacks = {rank: (tmp_path / "hang" / f"rank_{rank}.txt").read_text() for rank in (0, 1)}
    assert "in hang_forever" in stacks[1] and "in hang_forever" not in stacks[0]
    assert "the run made no progress for 2s" in output
    assert "Every rank completed step 7, so all of them are stuck inside step 8" in output
    entries = {rank: pickle.loads((tmp_path / "comm_traces" / f"gloo_rank_{rank}").read_bytes())["entries"]
               for rank in (0, 1)}
    waiting = [entry for entry in entries[0] if entry["process_group"][1] == "default_pg"][-1]
    ran_by_1 = max(entry["collective_seq_id"] for entry in entries[1] if entry["process_group"][1] == "default_pg")
    assert waiting["state"] != "completed" and waiting["collective_seq_id"] == ran_by_1 + 1
    assert f"python -m torch.distributed.flight_recorder.fr_trace {tmp_path / 'comm_traces'}" in output
    assert "exited with code 5 (hung), after step 7. Every rank restarts" in output
    assert "Traceback" not in output
    assert losses_by_step(tmp_path) == straight_losses


def test_a_spent_budget_ends_with_code_7_naming_it_and_the_last_failure(tmp_path: Path) -> None:
    """A fault in every attempt (one process): after its one restart the job ends with code 7, and the message names
    the budget and the last failure. The launcher writes the goodput record the killed attempt could not."""
    result = launch_job(tmp_path, "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "2",
                        "--fault.kind", "kill", "--fault.step", "1", "--fault.every_attempt", nprocs=1,
                        max_restarts=1)
    output = result.stdout + result.stderr
    assert result.returncode == 7, output[-4000:]
    assert ("The job failed again after all 1 of its restarts (--max-restarts 1; MAX_RESTARTS for run_train.sh): "
            "rank 0 was killed by SIGKILL, after step 1.") in output
    record = [r for r in metric_records(tmp_path) if "goodput_pct" in r][-1]
    assert record["restarts"] == 1 and record["steps_lost"] == 1  # step 1 trained again, then lost again


def test_a_slow_rank_is_named_once_with_its_host(fsdp2_straight_run: tuple[Path, str]) -> None:
    output = fsdp2_straight_run[1]
    warnings = [line for line in output.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1, output[-3000:]
    assert f"[rank1] WARNING Rank 1 on host {socket.gethostname()} is a straggler: its optimizer step takes" in \
        warnings[0]
    assert "(--metrics.straggler_threshold 0.7)" in warnings[0] and "Slowest ranks: 1, 0." in warnings[0]


def event_lines(*events: dict) -> list[dict]:
    return [json.loads(json.dumps(event)) for event in events]


def test_goodput_tiles_the_wall_time_across_attempts_and_launches() -> None:
    """Two launches (a rerun after a stop), the first with a failed attempt and a restart. Time between the launches
    is not the job's; each category is where the module's docstring puts it."""
    events = event_lines(
        {"event": "start", "t": 1.0, "launch": 0.0}, {"event": "ready", "t": 3.0},
        {"event": "step", "t": 4.0, "step": 1}, {"event": "step", "t": 4.5, "step": 2},
        {"event": "save", "t": 6.0, "step": 2}, {"event": "step", "t": 7.0, "step": 3},
        {"event": "fault", "t": 7.5, "kind": "kill"}, {"event": "failure", "t": 8.0, "rank": 1, "code": 137},
        {"event": "start", "t": 8.5, "launch": 0.0}, {"event": "ready", "t": 10.0},
        {"event": "step", "t": 11.0, "step": 3}, {"event": "step", "t": 12.0, "step": 4},
        {"event": "eval", "t": 12.5, "step": 4}, {"event": "end", "t": 13.0},
        {"event": "start", "t": 101.0, "launch": 100.0}, {"event": "ready", "t": 102.0},
        {"event": "step", "t": 103.0, "step": 5})
    goodput = measure_goodput(events, now=104.0)
    assert goodput.wall_s == pytest.approx(13.0 + 4.0)
    assert goodput.restart_s == pytest.approx(0.5) and goodput.restarts == 1 and goodput.launches == 2
    assert goodput.lost_s == pytest.approx(1.0 + 1.0)  # step 3's first training, and the failed attempt's tail
    assert goodput.steps_lost == 1
    assert goodput.checkpoint_s == pytest.approx(1.5) and goodput.evaluation_s == pytest.approx(0.5)
    # start-up: each launcher's own start (1 + 1), each attempt's way to its first step (2 + 1.5 + 1), the tails
    # after the last step of the attempts that did not fail (0.5 + 1)
    assert goodput.startup_s == pytest.approx(2.0 + 4.5 + 1.5)
    assert goodput.productive_s == pytest.approx(1.0 + 0.5 + 1.0 + 1.0 + 1.0)
    assert sum(getattr(goodput, key) for key in CATEGORIES) == pytest.approx(goodput.wall_s)


def test_a_killed_rank_on_one_of_two_nodes_restarts_both_and_the_job_matches_an_uninterrupted_run(
        tmp_path: Path, straight_losses: dict[int, float]) -> None:
    """Two nodes of one rank each (two launchers on localhost, a c10d rendezvous), rank 1 SIGKILLed at the end of
    step 7. Its node's agent restarts its ranks and counts the restart; the other node's agent restarts its rank
    through torch's membership-change path, which counts nothing. What keeps the healthy node's rank alive until its
    agent takes that path: its collective fails at once ("Connection reset by peer"), and it then waits up to 10 s
    for a stop notice from the killed rank (titan/exits.py PEER_STOP_WAIT) before exiting, while its agent sees the
    failed node's rejoin within a monitor interval. Every rank must then join under the same attempt (before, each
    node numbered it by its own agent's restart count: attempt 1 and attempt 0 never formed a process group, and
    the job stalled), the fault must not strike again on either node, and both must end with the straight run's
    losses."""
    results = launch_two_nodes(tmp_path, "--fault.kind", "kill", "--fault.rank", "1", "--fault.step", "7")
    output = "".join(result.stdout + result.stderr for result in results)
    assert [result.returncode for result in results] == [0, 0], output[-6000:]
    # One restart, which both nodes name: before, the healthy node's rank rejoined under the old attempt and either
    # stalled the job or crashed into a second restart that only the spare budget of its own agent absorbed.
    assert "Restart 1 of 1 (--max-restarts): rank 1 was killed by SIGKILL, after step 7." in output, output[-6000:]
    assert ("Restarting with the other nodes: rank 1 was killed by SIGKILL, after step 7 on another node."
            in output), output[-6000:]
    assert "(crashed)" not in output and "Restart 2" not in output, output[-6000:]
    assert steps_trained(tmp_path) == [*range(1, 8), *range(6, STEPS + 1)]
    # The node of rank 0, failed or not, records the failure in the goodput log, once.
    failures = [event for event in read_events(tmp_path) if event["event"] == "failure"]
    assert [(event["rank"], event["code"]) for event in failures] == [(1, 137)], failures
    # Both ranks log (LOG_RANK 0,1), each arming the fault on the first attempt only.
    assert output.count("This run will fail on purpose") == 2, output[-6000:]
    assert losses_by_step(tmp_path) == straight_losses
