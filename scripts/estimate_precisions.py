"""Dry-run one rank of a job in several precisions on simulated GPUs and print one table: step time, tokens/s per
GPU, MFU and peak memory, with the step's compute split into matmul time (FLOP-bound ops, at the dtype's peak) and
the memory-bound rest. An estimate (a roofline over the dry run's recorded ops), not a measurement; the dry run
records eager torch ops, so the low-precision casts that torch.compile fuses and Titan's Triton kernels replace on a
real GPU count here as separate memory-bound ops.

    python scripts/estimate_precisions.py --job.config_file configs/qwen3_30b_a3b.toml --world_size 64

Each row's converter flags are PRECISIONS below; a row a GPU cannot run (MX on Hopper) says why.
"""

import argparse

from titan.config.errors import ConfigError
from titan.estimate.report import step_estimate
from titan.estimate.roofline import GPUS, op_seconds
from titan.estimate.simulate import run_dry_run
from titan.validate import load_job_config

PRECISIONS = {
    "bf16": [],
    "float8 rowwise": ["--model.converters", "float8", "--float8.recipe_name", "rowwise"],
    "float8 blockwise": ["--model.converters", "float8", "--float8.recipe_name", "blockwise"],
    "mxfp8": ["--model.converters", "mx"],
}


def estimate_row(job: list[str], world_size: int, rank: int, gpu: str, flags: list[str]) -> str:
    cfg = load_job_config([*job, "--estimate.gpu", gpu, *flags, "--job.dry_run"], world_size)
    result = run_dry_run(cfg, world_size, rank=rank)
    estimate = step_estimate(result, cfg.estimate)
    spec = GPUS[gpu]
    matmul_s = sum(op_seconds(op, spec) for op in result.ops if op.flops)
    rest_s = sum(op_seconds(op, spec) for op in result.ops if not op.flops)
    return (f"{estimate.step_s:8.2f} s  {estimate.tokens_per_s:9,.0f}  {estimate.mfu_pct:5.1f}%  "
            f"{result.memory.total / 2**30:7.1f} GiB  {matmul_s:7.2f} s  {rest_s:7.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--gpus", nargs="+", default=["H100", "B200"], choices=sorted(GPUS))
    args, job = parser.parse_known_args()
    print(f"{'gpu':5} {'precision':16} {'step':>10}  {'tok/s/GPU':>9}  {'MFU':>6}  {'memory':>11}  {'matmuls':>9}  "
          f"{'the rest':>9}")
    for gpu in args.gpus:
        for name, flags in PRECISIONS.items():
            try:
                row = estimate_row(job, args.world_size, args.rank, gpu, flags)
            except ConfigError as error:  # the first clause of each problem: what the GPU lacks
                row = "not run: " + "; ".join(problem.split(";")[0] for problem in error.problems)
            print(f"{gpu:5} {name:16} {row}", flush=True)


if __name__ == "__main__":
    main()
