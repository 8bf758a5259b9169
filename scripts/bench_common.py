"""Helpers shared by the benchmark scripts: Llama shapes, fwd+bwd timing, and short training runs."""

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.check import load_job_config  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS, ffn_hidden_dim  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

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
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def time_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward + backward."""
    grad = torch.randn(x.shape[0], module.out_features, device=x.device, dtype=x.dtype)
    return median_seconds(lambda: module(x.detach().requires_grad_()).backward(grad), repeats, x.device)


def final_loss(flags: list[str], steps: int, folder: str) -> float:
    """Train the debug model for `steps` steps with `flags` and return the last logged loss."""
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", folder, "--training.steps", str(steps),
            "--metrics.log_freq", str(steps), *flags]
    Trainer(load_job_config(argv, world_size=1), world_size=1).run()
    last = (Path(folder) / "metrics.jsonl").read_text().splitlines()[-1]
    return json.loads(last)["loss"]
