"""The debug model's job file and depth, and short single-process training runs of it (for the converter tests)."""

from pathlib import Path

from titan.config.check import load_job_config
from titan.models.llama.args import LLAMA3_FLAVORS
from titan.train.trainer import Trainer

from harness.train_script import losses_of

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")
NUM_LAYERS = LLAMA3_FLAVORS["debugmodel"].n_layers


def train(tmp_path: Path, *args: str) -> tuple[Trainer, list[float]]:
    """The debug model trained at seq_len 64, batch 4, lr 2e-3 with 2 warmup steps, plus `args`: the trainer after
    its run, and the loss of every step."""
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--optimizer.lr", "2e-3",
            "--lr_scheduler.warmup_steps", "2", *args]
    trainer = Trainer(load_job_config(argv, world_size=1), world_size=1)
    trainer.run()
    return trainer, losses_of(tmp_path)


def train_losses(tmp_path: Path, *args: str) -> list[float]:
    """The loss of every step of `train`."""
    return train(tmp_path, *args)[1]
