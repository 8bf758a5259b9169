"""Helpers shared by the benchmark scripts: Llama shapes, fwd+bwd timing (of single linears against their
low-precision versions, too), peak tensor memory, and short training runs."""

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.models.llama.args import LLAMA3_FLAVORS, ffn_hidden_dim  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402
from titan.validate import load_job_config  # noqa: E402

DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")


def llama_8b_linear_shapes() -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one Llama 3 8B block's linears."""
    args = LLAMA3_FLAVORS["8B"]
    head_dim = args.dim // args.n_heads
    hidden = ffn_hidden_dim(args)
    return [("wq/wo", args.dim, args.dim), ("wk/wv", args.dim, args.n_kv_heads * head_dim),
            ("w1/w3", args.dim, hidden), ("w2", hidden, args.dim)]


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() over `repeats` calls, after two warm-up calls."""
    return interleaved_median_seconds({"fn": fn}, repeats, device)["fn"]


def interleaved_median_seconds(fns: dict[str, Callable[[], object]], repeats: int,
                               device: torch.device) -> dict[str, float]:
    """Median wall time of each fn over `repeats` rounds, after two warm-up rounds. Each round calls every fn once,
    so load from other processes on a shared machine slows them alike instead of whichever ran at the time."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 2):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(seconds[2:])[len(seconds[2:]) // 2] for name, seconds in times.items()}


def time_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward + backward."""
    grad = torch.randn(x.shape[0], module.out_features, device=x.device, dtype=x.dtype)
    return median_seconds(lambda: module(x.detach().requires_grad_()).backward(grad), repeats, x.device)


def high_precision() -> tuple[torch.device, torch.dtype]:
    """The device to benchmark on and its high-precision dtype: bf16 on a GPU, fp32 on a CPU (CPUs have no fast bf16
    matmul)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def add_linears_options(parser: argparse.ArgumentParser) -> None:
    """--linears and the options it takes besides --repeats, for a script that times linear_seconds."""
    parser.add_argument("--linears", action="store_true", help="per-shape linear fwd+bwd time")
    parser.add_argument("--tokens", type=int, default=8192 if torch.cuda.is_available() else 256,
                        help="rows of x for --linears")
    parser.add_argument("--compile", action="store_true", help="torch.compile the modules in --linears")


def linear_seconds(tokens: int, repeats: int, compile_modules: bool,
                   convert: Callable[[nn.Linear], list[nn.Module]]) -> Iterator[tuple[str, int, int, list[float]]]:
    """For each linear of a Llama 3 8B block: its name, in and out features, and the median fwd+bwd seconds on `tokens`
    rows of a high-precision nn.Linear and then of each low-precision module that `convert` makes from it."""
    device, dtype = high_precision()
    for name, in_features, out_features in llama_8b_linear_shapes():
        x = torch.randn(tokens, in_features, device=device, dtype=dtype)
        reference = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        modules = [reference, *convert(reference)]
        if compile_modules:
            modules = [torch.compile(m) for m in modules]
        yield name, in_features, out_features, [time_fwd_bwd(m, x, repeats) for m in modules]


def peak_tensor_bytes(fn: Callable[[], object], *external: torch.nn.Module | torch.optim.Optimizer) -> int:
    """Peak bytes of the tensors alive during fn(), on the device where they peak highest. Counts the storages that
    fn's ops return, seen by torch's dispatcher (so on CPU too, and without allocator caching): a tensor made
    before fn counts once an op returns it or a view of it (a slice, an in-place op), and from the start if it
    belongs to one of the `external` modules or optimizers (their parameters, buffers, gradients and states). A
    torch.compile'd fn runs eagerly under the tracker's dispatch mode, so this is the eager code's peak, not the
    compiled code's."""
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        fn()
    return max(device_peak["Total"] for device_peak in tracker.get_tracker_snapshot("peak").values())


def final_loss(flags: list[str], steps: int, folder: str) -> float:
    """Train the debug model for `steps` steps with `flags` and return the last logged loss."""
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", folder, "--training.steps", str(steps),
            "--metrics.log_freq", str(steps), *flags]
    Trainer(load_job_config(argv, world_size=1), world_size=1).run()
    records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "loss" in record][-1]["loss"]
