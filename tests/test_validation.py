"""In-training evaluation: held-out data, logged at the step it belongs to, without touching training."""

import math
import shutil
from pathlib import Path

import pytest

from titan.config.errors import ConfigError
from titan.validate import load_job_config

from harness.debug_training import train
from harness.train_script import losses_by_step, validation_records

# 4 batches of 4 x 64 tokens per evaluation: seconds, and enough held-out tokens to see the loss fall.
VALIDATION = ["--validation.enable", "--validation.steps", "4"]


def test_validation_is_logged_at_its_steps_and_leaves_training_alone(tmp_path: Path) -> None:
    _, plain = train(tmp_path / "plain", "--training.steps", "8")
    trainer, evaluated = train(tmp_path / "evaluated", "--training.steps", "8", "--validation.freq", "3", *VALIDATION)
    assert evaluated == plain  # bit for bit: evaluation touches no state training reads

    records = validation_records(tmp_path / "evaluated")
    assert [r["step"] for r in records] == [3, 6, 8]  # every freq steps, and a final one at the last step
    for record in records:
        assert record["val_perplexity"] == pytest.approx(math.exp(record["val_loss"]))
        assert record["val_tokens"] == 4 * 4 * 64  # --validation.steps batches of the training batch shape
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.3
    # Every evaluation reads the same held-out batches: the same weights give the same loss.
    assert trainer.run_validation().loss == pytest.approx(records[-1]["val_loss"], rel=1e-6)


def test_resume_with_validation_is_exact(tmp_path: Path) -> None:
    checkpointed = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
                    "--validation.freq", "2", *VALIDATION]
    train(tmp_path / "straight", *checkpointed)
    # The same run, killed after its step-3 save: rerunning it resumes there.
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-6")
    (tmp_path / "resumed" / "metrics.jsonl").unlink()
    train(tmp_path / "resumed", *checkpointed)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert losses_by_step(resumed) == {step: loss for step, loss in losses_by_step(straight).items() if step > 3}
    straight_val = {r["step"]: r["val_loss"] for r in validation_records(straight)}
    assert {r["step"]: r["val_loss"] for r in validation_records(resumed)} == {4: straight_val[4], 6: straight_val[6]}
    assert sorted(straight_val) == [2, 4, 6]


def test_validation_seq_len_longer_than_training_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--validation.seq_len"):
        load_job_config(["--training.seq_len", "64", "--validation.enable", "--validation.seq_len", "128"], 1)


def test_validation_under_the_v_schedule_is_a_config_error() -> None:
    flags = ["--validation.enable", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "4"]
    with pytest.raises(ConfigError,
                       match="--validation.enable can't run under --parallelism.pipeline_parallel_schedule"):
        load_job_config(flags, 2)
