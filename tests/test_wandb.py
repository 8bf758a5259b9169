"""Weights & Biases (--metrics.enable_wandb), offline: the run's history holds what metrics.jsonl holds, at the same
steps, plus evaluations and anomalies; its config is the job's; a resumed job continues the same run without
logging a step twice. The run files are read back as W&B wrote them (tests/harness/wandb_files.py)."""

import json
import math
import shutil
from pathlib import Path

import pytest

from titan.config.errors import ConfigError
from titan.validate import load_job_config

from harness.debug_training import build_trainer
from harness.nan_injection import nan_at
from harness.wandb_files import run_history


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing leaves the machine: W&B writes its run files under the dump folder only."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "titan-tests")


# What the W&B run gets beyond the training records: evaluations every 3 steps, anomalies to skip, checkpoints.
WANDB_JOB = ["--metrics.enable_wandb", "--validation.enable", "--validation.freq", "3", "--validation.steps", "1",
             "--training.on_nonfinite", "skip", "--checkpoint.enable", "--checkpoint.interval", "4"]


def wandb_runs(folder: Path) -> list[tuple[str, dict, list[dict]]]:
    """Every offline run W&B wrote under `folder`, oldest first."""
    return [run_history(path) for path in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))]


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_wandb_run_matches_the_metrics_and_a_resume_continues_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """6 steps, NaN at step 2 (skipped), evaluations at 3 and 6, checkpoints at 4 and 6. Then the job is resumed
    from step 4 (as if it had stopped before saving step 6) for 8 steps: the same run id, steps 7 and 8 added,
    steps 5 and 6 (trained again) not logged twice."""
    trainer = build_trainer(tmp_path, *WANDB_JOB, "--training.steps", "6")
    nan_at(trainer, {2}, monkeypatch.setattr)
    trainer.run()
    [(run_id, config, rows)] = wandb_runs(tmp_path)
    assert run_id == trainer.run_id and config["training"]["steps"] == 6 and config["metrics"]["enable_wandb"]
    by_step = {row["_step"]: row for row in rows}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    for record in records(tmp_path):
        row = by_step[record["step"]]
        if "goodput_pct" in record:
            assert row["goodput/goodput_pct"] == record["goodput_pct"] and row["goodput/wall_s"] == record["wall_s"]
        elif "val_loss" in record:
            assert row["val/loss"] == record["val_loss"] and row["val/tokens"] == record["val_tokens"]
        else:
            assert same(row["train/loss"], record["loss"]) and row["train/lr"] == record["lr"]
            assert row["train/tps"] == record["tps"] and row["train/gc_pause_s"] == record["gc_pause_s"]
    assert set(by_step[3]) >= {"train/loss", "val/loss"} and "val/loss" not in by_step[4]
    assert (by_step[2]["anomaly/kind"], by_step[2]["anomaly/action"]) == ("nonfinite", "skip")
    assert (tmp_path / "wandb" / f"last_step_{run_id}").read_text() == "6"

    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    resumed = build_trainer(tmp_path, *WANDB_JOB, "--training.steps", "8")
    assert resumed.step == 4 and resumed.run_id == run_id
    resumed.run()
    first, second = wandb_runs(tmp_path)
    assert second[0] == run_id and second[1]["training"]["steps"] == 8
    assert [row["_step"] for row in second[2]] == [7, 8]
    latest = {record["step"]: record for record in records(tmp_path) if "loss" in record}
    assert [row["train/loss"] for row in second[2]] == [latest[7]["loss"], latest[8]["loss"]]


def test_wandb_without_the_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"--metrics.enable_wandb needs the wandb package.*\.\[wandb\]"):
        load_job_config(["--metrics.enable_wandb"], world_size=1)
