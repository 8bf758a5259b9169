"""Learning-rate schedule: linear warmup, an optional stable phase, then decay to a floor (WSD)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from titan.config.job import LRScheduler
from titan.metrics.log import logger


def lr_factor(step_index: int, warmup_steps: int, stable_steps: int, decay_steps: int,
              decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step_index`.

    Warmup starts above zero ((i + 1) / (warmup + 1)) so the first step already moves the weights;
    the decay's last step lands exactly on the floor.
    """
    if step_index < warmup_steps:
        return (step_index + 1) / (warmup_steps + 1)
    if step_index < warmup_steps + stable_steps or decay_steps == 0:
        return 1.0
    progress = min((step_index - warmup_steps - stable_steps + 1) / decay_steps, 1.0)
    if decay_type == "linear":
        curve = 1.0 - progress
    elif decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def build_lr_scheduler(optimizer: Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step over `total_steps` steps."""
    warmup_steps = min(cfg.warmup_steps, total_steps)
    if warmup_steps < cfg.warmup_steps:
        logger.info(f"--lr_scheduler.warmup_steps {cfg.warmup_steps} exceeds --training.steps {total_steps}; "
                    f"warming up over all {warmup_steps} steps.")
    after_warmup = total_steps - warmup_steps
    # decay_ratio is a fraction of all steps (as in torchtitan); the decay can't start before warmup ends.
    decay_steps = after_warmup if cfg.decay_ratio is None else min(round(cfg.decay_ratio * total_steps), after_warmup)
    stable_steps = after_warmup - decay_steps

    def factor(step_index: int) -> float:
        return lr_factor(step_index, warmup_steps, stable_steps, decay_steps, cfg.decay_type, cfg.min_lr_factor)

    return LambdaLR(optimizer, factor)
