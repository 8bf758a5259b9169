"""Float8 benchmarks: per-shape linear speed, end-to-end training speed, and the loss-curve comparison.

    python scripts/bench_float8.py --linears                 # Llama 3 8B linear shapes, fwd+bwd time
    python scripts/bench_float8.py --train -- --training.steps 20   # tokens/s with and without float8
    python scripts/bench_float8.py --loss-curve --steps 200  # debug model, each recipe vs high precision

High precision means bf16 on a GPU and fp32 on a CPU (CPUs have no fast bf16 matmul). Everything after
`--` is a Titan flag on top of configs/debug_model.toml.
"""

import argparse
import time

import torch
from torch import nn

from bench_common import DEBUG_TOML, add_linears_options, final_loss, high_precision, linear_seconds
from titan.metrics.log import init_logger
from titan.quant.float8.linear import RECIPES, Float8Linear
from titan.train.trainer import Trainer
from titan.validate import load_job_config


def bench_linears(tokens: int, repeats: int, compile_modules: bool) -> None:
    device, dtype = high_precision()
    print(f"linear fwd+bwd, {tokens} tokens, {dtype} high precision, device {device}, compile {compile_modules}")
    print(f"{'shape':<8} {'in x out':>13} {'high prec ms':>13} " + " ".join(f"{r + ' ms':>22}" for r in RECIPES)
          + "  speedups")

    def float8_linears(reference: nn.Linear) -> list[nn.Module]:
        return [Float8Linear.from_linear(reference, recipe_name=recipe, emulate=False) for recipe in RECIPES]

    for name, in_features, out_features, seconds in linear_seconds(tokens, repeats, compile_modules, float8_linears):
        speedups = " ".join(f"{seconds[0] / s:.2f}x" for s in seconds[1:])
        print(f"{name:<8} {f'{in_features}x{out_features}':>13} {seconds[0] * 1e3:13.2f} "
              + " ".join(f"{s * 1e3:22.2f}" for s in seconds[1:]) + f"  {speedups}")


def train_tokens_per_second(flags: list[str], steps: int, warmup: int) -> float:
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", "/tmp/titan_bench_float8", *flags]
    trainer = Trainer(load_job_config(argv, world_size=1), world_size=1)
    data = iter(trainer.dataloader)
    for _ in range(warmup):
        trainer.train_step(data)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(data)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t = trainer.cfg.training
    return t.local_batch_size * t.seq_len * steps / (time.perf_counter() - start)


def bench_training(flags: list[str], steps: int, warmup: int) -> None:
    baseline = train_tokens_per_second(flags, steps, warmup)
    print(f"{'run':<32} {'tokens/s':>12} {'vs high precision':>18}")
    print(f"{'high precision':<32} {baseline:12,.0f} {'1.00x':>18}")
    for recipe in RECIPES:
        tps = train_tokens_per_second([*flags, "--model.converters", "float8", "--float8.recipe_name", recipe],
                                      steps, warmup)
        print(f"{'float8 ' + recipe:<32} {tps:12,.0f} {tps / baseline:17.2f}x")


def loss_curve(flags: list[str], steps: int) -> None:
    reference = final_loss(flags, steps, "/tmp/titan_float8_curve/high_precision")
    print(f"debug model, {steps} steps: high precision final loss {reference:.4f}")
    for recipe in RECIPES:
        loss = final_loss([*flags, "--model.converters", "float8", "--float8.recipe_name", recipe], steps,
                          f"/tmp/titan_float8_curve/{recipe}")
        print(f"float8 {recipe:<20} final loss {loss:.4f}  difference {loss - reference:+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linears_options(parser)
    parser.add_argument("--train", action="store_true", help="end-to-end tokens/s with and without float8")
    parser.add_argument("--loss-curve", action="store_true", help="final loss of each recipe vs high precision")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (--train) or training steps (--loss-curve)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("titan_flags", nargs="*", help="Titan flags after --")
    args = parser.parse_args()
    init_logger()
    if args.linears:
        bench_linears(args.tokens, args.repeats, args.compile)
    if args.train:
        bench_training(args.titan_flags, args.steps, args.warmup)
    if args.loss_curve:
        loss_curve(args.titan_flags, args.steps)


if __name__ == "__main__":
    main()
