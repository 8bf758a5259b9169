"""The smallest number of GPUs that fits a job, with and without the memory savers, by dry runs (titan.dry_run:
the real build and step of rank 0 on fake tensors, one process per world size):

    python scripts/memory_savers.py                                    # 8B and 70B on H100s, the table in docs/scale.md
    python scripts/memory_savers.py --config configs/llama3_8b.toml --world_sizes 2 4 8 -- --training.seq_len 4096

For each saver (none, --optimizer.state_dtype bfloat16, --training.enable_cpu_offload, both) it prints rank 0's
predicted peak GPU memory and host memory per world size, and the smallest world size whose peak fits the GPU.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAVERS = {
    "none": [],
    "bf16 optimizer state": ["--optimizer.state_dtype", "bfloat16"],
    "CPU offload": ["--training.enable_cpu_offload"],
    "both": ["--optimizer.state_dtype", "bfloat16", "--training.enable_cpu_offload"],
}
# Each job as shipped, but the 70B one with tensor parallel within a node and FSDP across nodes only (no pipeline),
# so that its world size can be any multiple of 8.
JOBS = {
    "configs/llama3_8b.toml": ([], [1, 2, 4, 8]),
    "configs/llama3_70b.toml": (["--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "1"],
                                [8, 16, 32, 64]),
}
TOTAL = re.compile(r"^\s+total\s+([\d.]+)\s+of ([\d.]+) GiB")
HOST = re.compile(r"host memory \(CPU offload\)\s+([\d.]+)")


def dry_run(config: str, world_size: int, flags: list[str]) -> tuple[float, float, float] | str:
    """(GPU peak GiB, host GiB, GPU capacity GiB) of rank 0, or the config error that rules the layout out."""
    command = [sys.executable, "-m", "titan.dry_run", "--world_size", str(world_size), "--rank", "0",
               "--job.config_file", config, *flags]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    output = result.stdout + result.stderr
    totals = [TOTAL.search(line) for line in output.splitlines()]
    total = next((match for match in totals if match), None)
    if total is None:
        return output.strip().splitlines()[-1][:160]
    host = HOST.search(output)
    return float(total.group(1)), float(host.group(1)) if host else 0.0, float(total.group(2))


def table(config: str, world_sizes: list[int], flags: list[str]) -> None:
    print(f"{config} {' '.join(flags)}")
    print(f"  {'saver':<22} " + " ".join(f"{n:>16}" for n in world_sizes) + "  smallest that fits")
    for saver, saver_flags in SAVERS.items():
        cells, smallest = [], None
        for world_size in world_sizes:
            outcome = dry_run(config, world_size, [*flags, *saver_flags])
            if isinstance(outcome, str):
                cells.append(f"{'invalid':>16}")
                print(f"    ({saver}, {world_size} GPUs: {outcome})", file=sys.stderr)
                continue
            gpu, host, capacity = outcome
            cells.append(f"{gpu:>7.1f}" + (f" +{host:>5.0f}h" if host else " " * 7)
                         + (" *" if gpu > capacity else "  "))
            if gpu <= capacity and smallest is None:
                smallest = world_size
        print(f"  {saver:<22} " + " ".join(cells) + f"  {smallest or '> ' + str(world_sizes[-1])}")
    print("  (GiB at rank 0's peak on the GPU, +host GiB per rank in host memory; * does not fit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="one job config instead of the 8B and 70B ones")
    parser.add_argument("--world_sizes", type=int, nargs="+", help="world sizes to try (with --config)")
    args, rest = parser.parse_known_args()
    titan_flags = [flag for flag in rest if flag != "--"]
    if args.config:
        table(args.config, args.world_sizes or [1, 2, 4, 8], titan_flags)
        return
    for config, (flags, world_sizes) in JOBS.items():
        table(config, world_sizes, [*flags, *titan_flags])


if __name__ == "__main__":
    main()
