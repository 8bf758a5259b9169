"""Mixture of experts on this machine: the experts' grouped matmuls against one matmul per expert, and a training
step of the Qwen3 debug MoE model on one process, expert parallel 2, FSDP 2 and pipeline parallel 2.

    python scripts/bench_moe.py                 # both parts
    python scripts/bench_moe.py --layer         # the experts only
    python scripts/bench_moe.py --steps         # the training steps only
    python scripts/bench_moe.py --precisions    # the experts in bf16, float8 rowwise and MXFP8 (native on a GPU)

--layer times forward + backward of GroupedExperts over routed tokens (an even routing of tokens x top_k copies),
torch._grouped_mm against the per-expert loop (the path for devices without grouped matmuls), median of 10 after 3
warm-ups. --steps runs train.py (fp32, seq_len 256, 4 sequences per step on the whole world, 12 steps) and reports
the median of steps 3-12 of the slowest rank's step time (metrics.jsonl), so that setup and the first steps'
allocations stay out. --precisions times forward + backward of the experts of 30B-A3B's shape (16 experts per rank,
as under EP 8) in bf16 and with the converters' grouped matmuls: native where torch has their kernels (float8 on
Hopper, MX on data-center Blackwell: titan/quant/rules.py), emulated elsewhere (CPU figures show emulation's
cost, not low precision's gain).
"""

import argparse
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

from titan.models.common import moe as moe_module  # noqa: E402
from titan.models.common.moe import (  # noqa: E402
    READ_COUNTS,
    ExpertMatmuls,
    GroupedExperts,
    HighPrecisionMatmuls,
    swiglu_expert,
)
from titan.quant.float8.grouped import Float8ExpertMatmuls  # noqa: E402
from titan.quant.mx.grouped import MXExpertMatmuls  # noqa: E402
from titan.quant.rules import FLOAT8_GROUPED_MAJORS, MX_GROUPED_MAJORS  # noqa: E402

# (tokens, dim, experts, top_k, expert hidden): the debug MoE flavor's layer at 4 x 256 tokens, and one of
# 30B-A3B's shape with fewer experts and tokens, so that it fits a CPU's time.
LAYER_SHAPES = {"debugmodel_moe": (1024, 256, 8, 2, 256), "30B-A3B-like": (512, 2048, 16, 8, 768)}
STEP_LAYOUTS = {
    "1 process": (1, ["--training.local_batch_size", "4"]),
    "EP 2 (x FSDP 2 dense)": (2, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]),
    "FSDP 2": (2, ["--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "PP 2 (1F1B, 4 micro-batches)": (2, ["--training.local_batch_size", "4",
                                         "--parallelism.pipeline_parallel_degree", "2"]),
}


def time_experts(tokens: int, dim: int, experts: int, top_k: int, hidden: int, grouped: bool) -> float:
    """Median seconds of one forward + backward of the experts over tokens x top_k evenly routed copies."""
    torch.manual_seed(0)
    layer = GroupedExperts(experts, dim, hidden)
    for weight in (layer.w1, layer.w2, layer.w3):
        torch.nn.init.normal_(weight, std=0.02)
    x = torch.randn(tokens * top_k, dim, requires_grad=True)
    counts = torch.full((experts,), tokens * top_k // experts)
    upstream = torch.randn(tokens * top_k, dim)
    supported = moe_module.grouped_mm_supported
    moe_module.grouped_mm_supported = supported if grouped else (lambda x, token_counts: False)
    try:
        times = []
        for i in range(13):
            start = time.perf_counter()
            (layer(x, counts) * upstream).sum().backward()
            if i >= 3:
                times.append(time.perf_counter() - start)
    finally:
        moe_module.grouped_mm_supported = supported
    return statistics.median(times)


def bench_layer() -> None:
    print(f"Experts forward + backward on {torch.get_num_threads()} CPU threads, torch {torch.__version__} (median "
          f"of 10):")
    print(f"{'shape':<16} {'tokens x top_k':>14} {'grouped (ms)':>13} {'loop (ms)':>10} {'loop / grouped':>15}")
    for name, (tokens, dim, experts, top_k, hidden) in LAYER_SHAPES.items():
        grouped = time_experts(tokens, dim, experts, top_k, hidden, grouped=True)
        loop = time_experts(tokens, dim, experts, top_k, hidden, grouped=False)
        print(f"{name:<16} {tokens * top_k:>14} {1e3 * grouped:>13.1f} {1e3 * loop:>10.1f} {loop / grouped:>15.2f}")


def time_matmuls(matmuls: ExpertMatmuls, tokens: int, dim: int, experts: int, top_k: int, hidden: int,
                 device: torch.device) -> float:
    """Median seconds of one forward + backward of the SwiGLU experts with `matmuls` over tokens x top_k evenly
    routed copies, bf16."""
    torch.manual_seed(0)
    weights = [(torch.randn(experts, *shape, device=device) * 0.02).bfloat16().requires_grad_()
               for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    x = torch.randn(tokens * top_k, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.full((experts,), tokens * top_k // experts, device=device)
    upstream = torch.randn_like(x)
    times = []
    for i in range(13):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        params = dict(zip(GroupedExperts.weight_names, weights))
        (matmuls(x, counts, params, swiglu_expert, READ_COUNTS) * upstream).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_precisions() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    capability = torch.cuda.get_device_capability() if cuda else (0, 0)
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} CPU threads"
    tokens, dim, experts, top_k, hidden = (8192, 2048, 16, 8, 768) if cuda else (512, 2048, 16, 8, 768)
    print(f"Experts of 30B-A3B's shape ({experts} experts, dim {dim}, hidden {hidden}) over {tokens} x {top_k} "
          f"routed tokens, forward + backward, bf16, on {where}, torch {torch.__version__} (median of 10):")
    all_matmuls = {"bf16": HighPrecisionMatmuls(),
                   "float8 rowwise": Float8ExpertMatmuls("rowwise",
                                                         emulate=capability[0] not in FLOAT8_GROUPED_MAJORS),
                   "mxfp8": MXExpertMatmuls(emulate=capability[0] not in MX_GROUPED_MAJORS)}
    baseline = None
    for name, matmuls in all_matmuls.items():
        seconds = time_matmuls(matmuls, tokens, dim, experts, top_k, hidden, device)
        baseline = baseline or seconds
        emulated = " (emulated)" if getattr(matmuls, "emulate", False) else ""
        print(f"  {name + emulated:<26} {1e3 * seconds:9.2f} ms  {baseline / seconds:5.2f}x bf16's speed")


def step_time(nprocs: int, flags: list[str], folder: Path) -> float:
    """Median of steps 3-12 of the slowest rank's step time, from the run's metrics.jsonl."""
    command = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.steps", "12",
               "--training.seq_len", "256", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
               "--job.dump_folder", str(folder), *flags]
    launcher = ([sys.executable, str(ROOT / "train.py")] if nprocs == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
                 str(ROOT / "train.py")])
    subprocess.run([*launcher, *command], check=True, capture_output=True, cwd=ROOT)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_max_s"] for r in records if "loss" in r and r["step"] >= 3)


def bench_steps() -> None:
    print("Qwen3 debugmodel_moe training step, 4 x 256 tokens per step in all (median of steps 3-12, slowest rank):")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nprocs, flags) in STEP_LAYOUTS.items():
            seconds = step_time(nprocs, flags, Path(tmp) / name.split()[0])
            print(f"  {name:<30} {nprocs} process(es): {seconds:.3f} s per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", action="store_true", help="only the experts' matmuls")
    parser.add_argument("--steps", action="store_true", help="only the training steps")
    parser.add_argument("--precisions", action="store_true", help="only the experts in bf16, float8 and MXFP8")
    cli = parser.parse_args()
    if cli.precisions:
        bench_precisions()
        return
    if cli.layer or not cli.steps:
        bench_layer()
    if cli.steps or not cli.layer:
        bench_steps()


if __name__ == "__main__":
    main()
