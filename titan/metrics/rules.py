"""The metrics' and profiling's config rules (titan/config/rule.py says what a rule is): the packages and the device
that what a run asks to record needs."""

import importlib.util

from titan.config.job import Metrics, Profiling
from titan.config.rule import about_this_machine
from titan.hardware import Accelerator


@about_this_machine
def check_wandb_installed(metrics: Metrics) -> str | None:
    if metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        return ("--metrics.enable_wandb needs the wandb package, an optional extra: pip install -e \".[wandb]\" (or "
                "pip install wandb). Or drop the flag; metrics.jsonl and --metrics.enable_tensorboard need nothing.")
    return None


def check_memory_snapshot(profiling: Profiling, accelerator: Accelerator) -> str | None:
    if profiling.enable_memory_snapshot and not accelerator.is_cuda:
        return ("--profiling.enable_memory_snapshot records CUDA allocator history and needs a GPU; none is "
                "visible. Drop the flag, or use --profiling.enable_profiling for CPU traces.")
    return None
