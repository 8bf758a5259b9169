"""Non-finite and spiking steps (--training.on_nonfinite, --training.on_spike): skipped, rolled back or logged,
recorded in anomalies.jsonl, counted against --training.max_skipped_steps, and resumed exactly.

Non-finite losses are forced by multiplying the loss by NaN at chosen steps (tests/harness/nan_injection.py, here and in
tests/harness/anomaly_probe.py). Spikes come from data: documents of exactly one window of the same sentence, which the
debug model learns within a few steps, and one document of random characters placed in a chosen step's batch."""

import json
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from titan.checkpoint.dcp import TrainState
from titan.config.errors import ConfigError
from titan.data.tokenizer import build_tokenizer
from titan.train.anomalies import SpikeDetector
from titan.train.nan_guard import NonFiniteLossError
from titan.train.trainer import Trainer
from titan.validate import load_job_config

from harness.debug_training import build_trainer, debug_job
from harness.nan_injection import nan_at
from harness.train_script import ROOT, losses_by_step

SEQ_LEN = 32
SENTENCE = "the cat sat on the mat and the dog sat on the log".split()
NOISE = "abcdefghijklmnopqrstuvwxyz0123456789#@%&"


def one_window(pieces: Iterator[str], separator: str) -> str:
    """Join pieces until the document is one window of SEQ_LEN + 1 tokens (BOS and EOS included)."""
    tokenizer = build_tokenizer(str(ROOT / "tokenizers" / "titan_2256.tiktoken"))
    text = ""
    while len(tokenizer.encode(text, bos=True, eos=True)) < SEQ_LEN + 1:
        text += (separator if text else "") + next(pieces)
    assert len(tokenizer.encode(text, bos=True, eos=True)) == SEQ_LEN + 1, "a piece added two tokens: pick others"
    return text


def write_data(path: Path, noise_index: int | None, num_documents: int = 200) -> Path:
    """One document per window, so document `noise_index` is exactly one window of one step's batch."""
    sentence = one_window((SENTENCE[i % len(SENTENCE)] for i in range(1000)), " ")
    rng = random.Random(0)
    noise = one_window((rng.choice(NOISE) for _ in range(1000)), "")
    documents = [noise if i == noise_index else sentence for i in range(num_documents)]
    path.write_text("\n\n".join(documents) + "\n")
    return path


def flags(data: Path, *extra: str) -> list[str]:
    """The flags of these tests' debug job (harness.debug_training.debug_job) on `data`, then `extra`."""
    return ["--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "2", "--optimizer.lr", "2e-3",
            "--lr_scheduler.warmup_steps", "2", "--training.dataset", "text", "--training.dataset_path", str(data),
            "--training.spike_window", "5", "--training.no_shuffle", *extra]  # the noise document's step is known


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def optimizer_steps(trainer: Trainer) -> int:
    return int(trainer.training.optimizer.state[next(trainer.training.model.parameters())]["step"].item())


def warnings_of(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_spike_detector_uses_median_and_floored_mad() -> None:
    detector = SpikeDetector(window=5, threshold=3.0, losses=[2.0, 2.2, 1.8, 2.1])
    assert detector.check(100.0) is None  # the window is not full yet
    detector.add(1.9)
    spike = detector.check(2.7)  # median 2.0, MAD 0.1: limit 2.0 + 3 x 0.1
    assert spike is not None and (spike.median, spike.limit) == pytest.approx((2.0, 2.3))
    assert detector.check(2.29) is None
    flat = SpikeDetector(window=3, threshold=3.0, losses=[4.0, 4.0, 4.0])
    spike = flat.check(4.13)  # MAD 0, floored at 1% of the median: limit 4.0 + 3 x 0.04
    assert spike is not None and spike.limit == pytest.approx(4.12) and flat.check(4.11) is None
    # Fields added to TrainState keep their defaults when an older checkpoint's pickle lacks them.
    assert TrainState(**{"step": 3, "tokens_seen": 9, "dp_degree": 1, "world_size": 1}).spike_losses == []


def test_rollback_needs_checkpoints() -> None:
    with pytest.raises(ConfigError, match=r"--training.on_spike rollback .* --checkpoint.enable"):
        load_job_config(["--training.on_spike", "rollback"], world_size=1)


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_nonfinite_steps_are_skipped_until_max_skipped_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             titan_records: list[logging.LogRecord],
                                                             implementation: str) -> None:
    """NaN at steps 3, 5 and 7 with 2 skips allowed: 3 and 5 are skipped (no optimizer or LR step, the data moves
    on), 7 stops with the usual message and the count. Fused Adam skips on the device's flag, foreach Adam on the
    host's read of it."""
    trainer = build_trainer(tmp_path, *flags(write_data(tmp_path / "data.txt", noise_index=None), "--training.steps",
                                             "10", "--training.on_nonfinite", "skip", "--training.max_skipped_steps",
                                             "2", "--optimizer.implementation", implementation))
    nan_at(trainer, {3, 5, 7}, monkeypatch.setattr)
    with pytest.raises(NonFiniteLossError) as stop:
        trainer.run()
    assert stop.value.exit_code == 3
    assert re.match(r"Stopping: loss is nan at step 7; the last finite loss was \d", str(stop.value)), stop.value
    assert "2 earlier steps were skipped or rolled back, the most --training.max_skipped_steps 2 allows" in str(
        stop.value)
    records = read_jsonl(tmp_path / "anomalies.jsonl")
    assert [(r["step"], r["kind"], r["action"], r["loss"]) for r in records] == [
        (3, "nonfinite", "skip", "nan"), (5, "nonfinite", "skip", "nan"), (7, "nonfinite", "stop", "nan")]
    positions = [json.dumps(r["data_position"], sort_keys=True) for r in records]
    assert len(set(positions)) == 3, positions  # each skipped step consumed its batch
    assert warnings_of(titan_records) == ["Skipped step 3: loss is nan (1 of 2 allowed skips)",
                                          "Skipped step 5: loss is nan (2 of 2 allowed skips)"]
    assert optimizer_steps(trainer) == 4 and trainer.training.lr_scheduler.last_epoch == 4  # steps 1, 2, 4, 6
    lrs = {r["step"]: r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert lrs[4] == lrs[3] and lrs[6] == lrs[5] != lrs[4]  # the schedule waits on a skipped step


@pytest.mark.parametrize("policy, action, message", [
    (["--training.on_spike", "log"], "log", "The update was applied (--training.on_spike log)."),
    (["--training.on_spike", "skip"], "skip", "(1 of 10 allowed skips)"),
    (["--training.on_spike", "rollback", "--checkpoint.enable", "--checkpoint.interval", "100"], "skip",
     "; there is no complete checkpoint to roll back to yet (1 of 10 allowed skips)"),
], ids=["log", "skip", "rollback-without-checkpoint"])
def test_spike_is_logged_or_skipped(tmp_path: Path, policy: list[str], action: str, message: str,
                                    titan_records: list[logging.LogRecord]) -> None:
    """The noise document is in step 12's batch; only that step spikes, by the median and MAD of steps 7-11."""
    trainer = build_trainer(tmp_path, *flags(write_data(tmp_path / "data.txt", noise_index=22), "--training.steps",
                                             "14", *policy))
    trainer.run()
    [record] = read_jsonl(tmp_path / "anomalies.jsonl")
    losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert (record["step"], record["kind"], record["action"]) == (12, "spike", action)
    window = [losses[step] for step in range(7, 12)]
    median = sorted(window)[2]
    mad = sorted(abs(loss - median) for loss in window)[2]
    assert (record["median"], record["mad"], record["threshold"]) == pytest.approx((median, mad, 6.0))
    assert record["limit"] == pytest.approx(median + 6.0 * max(mad, 0.01 * median))
    assert record["loss"] == losses[12] > record["limit"]
    [warning] = warnings_of(titan_records)
    assert warning.startswith(f"{'Loss spike at' if action == 'log' else 'Skipped'} step 12: loss {losses[12]:.4f} "
                              f"is a spike: above {record['limit']:.4f}, the median {median:.4f} of the last 5 "
                              f"losses plus 6 x their median absolute deviation") and warning.endswith(message)
    assert optimizer_steps(trainer) == (14 if action == "log" else 13)


def test_spike_rolls_back_to_the_last_checkpoint_and_skips_its_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     titan_records: list[logging.LogRecord]) -> None:
    """Two micro-batches per step, a checkpoint at step 10, the noise in step 12: the run reloads step 10, goes on
    from step 11 with the batches after step 12's, and reads no batch twice. Step 12's loss is read once step 13 is
    queued, so the batches after step 12's are drawn as step 13's and then train step 11."""
    trainer = build_trainer(tmp_path, *flags(write_data(tmp_path / "data.txt", noise_index=44), "--training.steps",
                                             "14", "--training.global_batch_size", "4", "--training.on_spike",
                                             "rollback", "--checkpoint.enable", "--checkpoint.interval", "10"))
    draws: list[tuple[int, str]] = []
    real_next_batch = trainer.next_batch

    def next_batch(data_iterator: Iterator) -> tuple[torch.Tensor, torch.Tensor, float]:
        draws.append((trainer.step, json.dumps(trainer.dataloader.position(), sort_keys=True)))
        return real_next_batch(data_iterator)

    monkeypatch.setattr(trainer, "next_batch", next_batch)
    trainer.run()
    [record] = read_jsonl(tmp_path / "anomalies.jsonl")
    assert (record["step"], record["kind"], record["action"]) == (12, "spike", "rollback")
    assert (record["checkpoint_step"], record["batches_skipped"]) == (10, 4)
    assert [step for step, _ in draws] == [s for s in range(1, 14) for _ in (0, 1)] + [s for s in range(12, 15)
                                                                                      for _ in (0, 1)]
    assert len({position for _, position in draws}) == len(draws)  # no batch trained twice, the spike's included
    metrics = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, 12)) + list(range(11, 15))
    # Step 11 again: the checkpoint's weights, optimizer and schedule on a batch of the same sentence.
    assert metrics[11]["loss"] == metrics[10]["loss"]
    [warning] = warnings_of(titan_records)
    assert warning.startswith("Rolled back step 12: loss ") and warning.endswith(
        "Reloaded the checkpoint of step 10 and skipped the data of steps 11 to 12 (4 batches per data-parallel "
        "rank) (1 of 10 allowed skips)")
    assert trainer.anomalies.num_skipped == 1 and optimizer_steps(trainer) == 14


def launch(folder: Path, data: Path, nprocs: int, nan_steps: str, *extra: str) -> subprocess.CompletedProcess:
    """tests/harness/anomaly_probe.py under titan.launch, as run_train.sh runs train.py."""
    command = [sys.executable, "-m", "titan.launch", "--standalone", "--nnodes=1", f"--nproc_per_node={nprocs}",
               str(ROOT / "tests" / "harness" / "anomaly_probe.py"), *debug_job(folder, *flags(data, *extra))]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "NAN_STEPS": nan_steps, "LOG_RANK": "0"})


def test_fsdp2_skips_rolls_back_stops_and_resumes_exactly(tmp_path: Path) -> None:
    """FSDP=2, NaN at steps 3, 8 and 18, the noise in rank 0's batch of step 13, checkpoints every 5 steps and 3
    skips allowed: 3 and 8 are skipped, 13 rolls back to step 10, 18 stops both ranks with exit code 3. A copy
    of the run's folder as it was at step 10 reruns to the same losses and records: the checkpoint kept the
    spike window and the skip count."""
    data = write_data(tmp_path / "data.txt", noise_index=48)  # rank 0's 25th document: the first of its step 13
    policy = ["--training.steps", "20", "--parallelism.data_parallel_shard_degree", "2", "--training.on_nonfinite",
              "skip", "--training.on_spike", "rollback", "--training.max_skipped_steps", "3", "--checkpoint.enable",
              "--checkpoint.interval", "5"]
    straight = tmp_path / "straight"
    result = launch(straight, data, 2, "3,8,18", *policy)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-4000:]
    stops = dict(re.findall(r"\[rank(\d)\] ERROR (Stopping: .*)", output))
    assert stops.keys() == {"0", "1"}, output[-4000:]
    for message in stops.values():
        assert message.startswith("Stopping: loss is nan at step 18;")
        assert "3 earlier steps were skipped or rolled back, the most --training.max_skipped_steps 3 allows" in message
    records = read_jsonl(straight / "anomalies.jsonl")
    assert [(r["step"], r["kind"], r["action"]) for r in records] == [
        (3, "nonfinite", "skip"), (8, "nonfinite", "skip"), (13, "spike", "rollback"), (18, "nonfinite", "stop")]
    assert (records[2]["checkpoint_step"], records[2]["batches_skipped"]) == (10, 3)
    assert "Traceback" not in output

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-15")
    for name, keep in (("metrics.jsonl", 10), ("anomalies.jsonl", 2)):
        lines = (resumed / name).read_text().splitlines()[:keep]
        (resumed / name).write_text("\n".join(lines) + "\n")
    again = launch(resumed, data, 2, "3,8,18", *policy)
    assert again.returncode == 3, (again.stdout + again.stderr)[-4000:]
    assert "checkpoint/step-10: step 10" in again.stdout
    assert read_jsonl(resumed / "anomalies.jsonl") == records
    want, got = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(got) == sorted(want) == list(range(1, 18))
    assert all(got[step] == want[step] for step in range(11, 18) if math.isfinite(want[step]))
