"""The debug model's job file and depth, the one builder of its single-process trainers (build_trainer), and short
training runs of it (for the converter tests)."""

from pathlib import Path

from titan.models.llama.args import LLAMA3_FLAVORS
from titan.train.trainer import Trainer
from titan.validate import load_job_config

from harness.train_script import losses_of

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")
NUM_LAYERS = LLAMA3_FLAVORS["debugmodel"].n_layers
# Small enough for seconds per run: 64-token sequences, 4 per batch, every step logged.
SMALL_BATCH = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]


def debug_job(folder: Path, *flags: str) -> list[str]:
    """The command line of the debug model's job (configs/debug_model.toml) writing to `folder`, at SMALL_BATCH,
    with `flags` on top: a later flag wins, so `flags` may change SMALL_BATCH's."""
    return ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(folder), *SMALL_BATCH, *flags]


def build_trainer(folder: Path, *flags: str) -> Trainer:
    """The trainer of debug_job(folder, *flags) on one process, built and not yet run."""
    return Trainer(load_job_config(debug_job(folder, *flags), world_size=1), world_size=1)


def train(tmp_path: Path, *args: str) -> tuple[Trainer, list[float]]:
    """The debug model trained at seq_len 64, batch 4, lr 2e-3 with 2 warmup steps, plus `args`: the trainer after
    its run, and the loss of every step."""
    trainer = build_trainer(tmp_path, "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2", *args)
    trainer.run()
    return trainer, losses_of(tmp_path)


def train_losses(tmp_path: Path, *args: str) -> list[float]:
    """The loss of every step of `train`."""
    return train(tmp_path, *args)[1]
