"""In-training evaluation: held-out data, logged at the step it belongs to, without touching training."""

import math
from pathlib import Path

import pytest

from debug_training import train
from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from train_script import losses_by_step, validation_records

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
    checkpointed = ["--checkpoint.enable", "--checkpoint.interval", "3", "--validation.freq", "2", *VALIDATION]
    train(tmp_path / "straight", "--training.steps", "6", *checkpointed)
    train(tmp_path / "resumed", "--training.steps", "3", *checkpointed)
    train(tmp_path / "resumed", "--training.steps", "6", *checkpointed)

    assert losses_by_step(tmp_path / "resumed") == losses_by_step(tmp_path / "straight")
    straight = {r["step"]: r["val_loss"] for r in validation_records(tmp_path / "straight")}
    resumed = {r["step"]: r["val_loss"] for r in validation_records(tmp_path / "resumed")}
    assert resumed == straight
    assert sorted(resumed) == [2, 3, 4, 6]  # the first run's last step (3) evaluates too


def test_validation_seq_len_longer_than_training_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--validation.seq_len"):
        load_job_config(["--training.seq_len", "64", "--validation.enable", "--validation.seq_len", "128"], 1)
