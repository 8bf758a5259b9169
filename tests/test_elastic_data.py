"""Elastic data resume with real processes: the sample order does not depend on the data-parallel degree, so FSDP=2
trains on the samples of one process with twice the batch, and a checkpoint taken on one degree continues the same
samples on another (here with a two-source mixture, whose per-source positions come back too)."""

import re
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from harness.train_script import losses_by_step, metric_records, train_to_the_end

STEPS = 6
# fp32, short sequences, a log record every step, checkpoints at steps 3 and 6
BASE = ["--training.seq_len", "32", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.enable", "--checkpoint.interval", "3"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
ONE_PROCESS = ["--training.local_batch_size", "4"]
ONE_PROCESS_ACCUMULATING = ["--training.local_batch_size", "2", "--training.global_batch_size", "4"]


def resume_from_step_3(straight: Path, resumed: Path, nprocs: int, *flags: str) -> dict[int, float]:
    """Resume a copy of `straight`'s step-3 checkpoint with `flags`; the losses of the steps it trains."""
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    output = train_to_the_end(resumed, *BASE, *flags, nprocs=nprocs).stdout
    restored = re.search(r"checkpoint/step-3: step 3, (.*) restored", output)
    assert restored and "dataloader" in restored.group(1).split(", "), output
    assert "data order restarts" not in output
    return losses_by_step(resumed)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The shipped corpus and a small jsonl file that loops every few steps, weighted 1:1."""
    path = tmp_path_factory.mktemp("data") / "code.jsonl"
    path.write_text("".join(f'{{"text": "def f{i}(x):\\n    return x * {i} + {i * i}"}}\n' for i in range(8)))
    return ["--training.mixture", "shipped=1", f"jsonl:{path}=1"]


def test_fsdp2_trains_on_one_process_samples_and_resumes_across_degrees(tmp_path: Path, mixture: list[str]) -> None:
    """FSDP=2 with batch 2 and one process with batch 4 log the same losses (to reduction-order rounding); the
    FSDP=2 checkpoint of step 3 resumes on one process accumulating 2 x 2 (the same global batch) and the one-process
    checkpoint resumes on FSDP=2, each continuing the other's losses. The world size differs, so the RNG is not
    restored: the model has no dropout and the losses do not depend on it."""
    fsdp2, one = tmp_path / "fsdp2", tmp_path / "one"
    train_to_the_end(fsdp2, *BASE, *FSDP2, *mixture, nprocs=2)
    train_to_the_end(one, *BASE, *ONE_PROCESS, *mixture)
    fsdp2_losses, one_losses = losses_by_step(fsdp2), losses_by_step(one)
    assert sorted(fsdp2_losses) == list(range(1, STEPS + 1))
    assert [one_losses[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [fsdp2_losses[s] for s in range(1, STEPS + 1)], abs=1e-4)
    # The data position is global: DCP wrote one copy of it, not one per rank.
    metadata = dcp.FileSystemReader(str(fsdp2 / "checkpoint" / "step-3")).read_metadata().state_dict_metadata
    assert [key for key in metadata if key.startswith("dataloader")] == ["dataloader.stream"]

    on_one = resume_from_step_3(fsdp2, tmp_path / "fsdp2_to_one", 1, *ONE_PROCESS_ACCUMULATING, *mixture)
    assert [on_one[s] for s in range(4, STEPS + 1)] == pytest.approx(
        [fsdp2_losses[s] for s in range(4, STEPS + 1)], abs=1e-5)
    # Tokens per source count the whole global batch (6 steps x 4 sequences x 32 tokens) and resume with the data.
    drawn = [r for r in metric_records(fsdp2) if "loss" in r][-1]["tokens_by_source"]
    assert sum(drawn.values()) == STEPS * 4 * 32 and len(drawn) == 2 and min(drawn.values()) > 0
    assert [r for r in metric_records(tmp_path / "fsdp2_to_one") if "loss" in r][-1]["tokens_by_source"] == drawn
    on_two = resume_from_step_3(one, tmp_path / "one_to_fsdp2", 2, *FSDP2, *mixture)
    assert [on_two[s] for s in range(4, STEPS + 1)] == pytest.approx(
        [one_losses[s] for s in range(4, STEPS + 1)], abs=1e-5)
