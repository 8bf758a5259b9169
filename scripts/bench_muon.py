"""Muon against AdamW on this machine: what an optimizer step costs, and how the debug model trains with each at a few
learning rates (docs/optimizers.md quotes both).

    python scripts/bench_muon.py --step-cost                 # one optimizer step on the debug model, AdamW and Muon
    python scripts/bench_muon.py --sweep --steps 300         # train the debug model with each at each learning rate

--step-cost times optimizer.step() alone on the Llama debug model's parameters (float32, random gradients): fused
AdamW, and Muon (Newton-Schulz in bfloat16 on every hidden matrix, AdamW on the rest); median of 10 after 3 warm-ups.
--sweep runs train.py on the shipped corpus for --steps steps at each --lrs value with each optimizer (Muon at
match_rms_adamw, so that the same learning rates apply), with a held-out evaluation at the end, and prints the
training loss averaged over the last 20 steps and the held-out loss.
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.job import Optimizer  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS  # noqa: E402
from titan.models.llama.init import init_weights  # noqa: E402
from titan.models.llama.model import Transformer  # noqa: E402
from titan.train.optim import build_optimizer  # noqa: E402

DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")


def step_seconds(cfg: Optimizer) -> float:
    """Median seconds of optimizer.step() on the debug model's parameters with gradients set."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256))
    init_weights(model)
    optimizer = build_optimizer(model, cfg)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    times = []
    for i in range(13):
        start = time.perf_counter()
        optimizer.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_step_cost() -> None:
    print(f"One optimizer step on the Llama debug model's parameters, float32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (median of 10):")
    baseline = None
    for name, cfg in {"AdamW (fused)": Optimizer(), "Muon": Optimizer(name="Muon")}.items():
        seconds = step_seconds(cfg)
        baseline = baseline or seconds
        print(f"  {name:<14} {1e3 * seconds:8.1f} ms  {seconds / baseline:5.2f}x AdamW's")


def train(optimizer: str, lr: float, steps: int, folder: Path) -> tuple[float, float]:
    """(training loss averaged over the last 20 logged steps, held-out loss at the end) of one debug run."""
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--job.config_file", DEBUG_TOML, "--optimizer.name",
                    optimizer, "--optimizer.lr", str(lr), "--training.steps", str(steps), "--metrics.log_freq", "1",
                    "--validation.enable", "--validation.freq", str(steps), "--job.dump_folder", str(folder)],
                   cwd=ROOT, check=True, capture_output=True)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    held_out = [record["val_loss"] for record in records if "val_loss" in record]
    return statistics.mean(losses[-20:]), held_out[-1]


def bench_sweep(steps: int, lrs: list[float]) -> None:
    print(f"The Llama debug model on the shipped corpus, {steps} steps (8 x 256 tokens each), float32; loss over the "
          f"last 20 steps / held-out loss at the end:")
    print(f"  {'lr':>8} {'AdamW':>17} {'Muon':>17}")
    with tempfile.TemporaryDirectory() as scratch:
        for lr in lrs:
            cells = []
            for optimizer in ("AdamW", "Muon"):
                train_loss, held_out = train(optimizer, lr, steps, Path(scratch) / f"{optimizer}-{lr}")
                cells.append(f"{train_loss:7.3f} / {held_out:6.3f}")
            print(f"  {lr:>8g} {cells[0]:>17} {cells[1]:>17}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-cost", action="store_true", help="time one optimizer step")
    parser.add_argument("--sweep", action="store_true", help="train with each optimizer at each --lrs value")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each --sweep run")
    parser.add_argument("--lrs", type=float, nargs="+", default=[8e-4, 1.6e-3, 3.2e-3, 6.4e-3, 1.28e-2])
    cli = parser.parse_args()
    if cli.step_cost or not cli.sweep:
        bench_step_cost()
    if cli.sweep:
        bench_sweep(cli.steps, cli.lrs)


if __name__ == "__main__":
    main()
