"""The training loop on the real debug model, shipped corpus and tokenizer, on CPU."""

import json
import math
from pathlib import Path

import pytest
import torch

from titan.config.check import load_job_config
from titan.train.nan_guard import NonFiniteLossError, check_finite, stop_hints
from titan.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")
# Small enough for seconds per run: 64-token sequences, 4 per batch.
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]


def build_trainer(tmp_path: Path, *args: str) -> Trainer:
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), *SMALL, *args]
    return Trainer(load_job_config(argv, world_size=1), world_size=1)


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_on_shipped_corpus(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "40", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps",
                  "5").run()
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


def test_metrics_records_and_written_config(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2").run()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4]
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mem_gib", "data_wait_pct", "eta_s"} <= set(record)
        assert "mfu_pct" not in record  # no known peak FLOP/s on a CPU
        assert record["tps"] > 0 and math.isfinite(record["loss"])
    again = load_job_config(["--job.config_file", str(tmp_path / "config.toml")], world_size=1)
    assert again.training.steps == 4 and again.training.seq_len == 64 and again.job.dump_folder == str(tmp_path)


def test_same_seed_same_losses(tmp_path: Path) -> None:
    build_trainer(tmp_path / "a", "--training.steps", "3").run()
    build_trainer(tmp_path / "b", "--training.steps", "3").run()
    assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    """Two micro-batches of 2 read the same 4 sequences as one batch of 4: same losses and weights."""
    big = build_trainer(tmp_path / "big", "--training.steps", "3")
    big.run()
    accumulated = build_trainer(tmp_path / "acc", "--training.steps", "3", "--training.local_batch_size", "2",
                                "--training.global_batch_size", "4")
    accumulated.run()
    assert accumulated.grad_accumulation_steps == 2
    big_losses = [r["loss"] for r in read_metrics(tmp_path / "big")]
    acc_losses = [r["loss"] for r in read_metrics(tmp_path / "acc")]
    torch.testing.assert_close(acc_losses, big_losses, rtol=1e-5, atol=1e-5)
    for p_big, p_acc in zip(big.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(p_acc, p_big, rtol=1e-4, atol=1e-5)


def test_lr_follows_warmup_and_decay(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "6", "--lr_scheduler.warmup_steps", "2",
                  "--lr_scheduler.min_lr_factor", "0.1", "--optimizer.lr", "1e-3").run()
    lrs = [r["lr"] for r in read_metrics(tmp_path)]
    expected = [1e-3 / 3, 2e-3 / 3, 1e-3 * (0.1 + 0.9 * 0.75), 1e-3 * (0.1 + 0.9 * 0.5),
                1e-3 * (0.1 + 0.9 * 0.25), 1e-3 * 0.1]
    torch.testing.assert_close(lrs, expected)


@pytest.fixture
def nan_at_step_3(monkeypatch: pytest.MonkeyPatch):
    """Make the loss non-finite from the third step on, the way a diverging run would."""

    def install(trainer: Trainer) -> None:
        real_loss = trainer.loss_fn

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
            loss = real_loss(logits, labels, vocab_size)
            return loss * float("nan") if trainer.step >= 3 else loss

        monkeypatch.setattr(trainer, "loss_fn", loss_fn)

    return install


def test_nan_loss_stops_at_that_step(tmp_path: Path, nan_at_step_3) -> None:
    trainer = build_trainer(tmp_path, "--training.steps", "10")
    nan_at_step_3(trainer)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    last_finite = read_metrics(tmp_path)[-1]["loss"]
    assert "loss is nan at step 3" in message and f"{last_finite:.4f}" in message
    assert "--optimizer.lr" in message and "first non-finite gradient is in" in message
    assert trainer.step == 3
    assert trainer.optimizer.state[next(trainer.model.parameters())]["step"].item() == 2  # no step on the nan


def test_nonfinite_grad_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].weight.grad[0, 0] = float("inf")
    with pytest.raises(NonFiniteLossError, match=r"gradient norm is inf .* step 7.*in 1\.weight"):
        check_finite(7, 2.5, float("inf"), 2.4, model, stop_hints([], False, 1.0))


def test_hint_names_precision_casts_with_converters_and_compile() -> None:
    assert any("TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1" in h for h in stop_hints(["float8"], True, 1.0))
    assert not any("TORCHINDUCTOR" in h for h in stop_hints([], True, 1.0))
    assert any("--training.max_norm 1.0" in h for h in stop_hints([], False, 0.0))


def test_tensorboard_and_profiler_write_files(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "4", "--metrics.enable_tensorboard", "--profiling.enable_profiling",
                  "--profiling.profile_freq", "2").run()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "profile_traces").glob("iteration_*/rank0_trace.json"))


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "2", "--training.mixed_precision_param", "bfloat16").run()
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path))


def test_compile_matches_eager(tmp_path: Path) -> None:
    build_trainer(tmp_path / "eager", "--training.steps", "3").run()
    build_trainer(tmp_path / "compiled", "--training.steps", "3", "--training.compile").run()
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager")]
    compiled = [r["loss"] for r in read_metrics(tmp_path / "compiled")]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
