"""Stop at a non-finite loss or gradient norm, before the optimizer step can spread it (titan/train/anomalies.py
decides when: at the first one, or past --training.max_skipped_steps)."""

import math

from torch import nn

from titan.exits import EXIT_DIVERGED, KnownStop


class NonFiniteLossError(KnownStop):
    """The run stopped because the loss or gradient norm stopped being finite, or a spike came after
    --training.max_skipped_steps skips; exits with code 3. Every rank sees the same global loss and norm, so every
    rank raises it at the same step."""

    exit_code = EXIT_DIVERGED
    every_rank_stops = True


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """FQN of the first parameter whose gradient holds a nan or inf (None if all are finite)."""
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and not grad.isfinite().all():
            return name
    return None


def stop_hints(converters: list[str], compile_enabled: bool, max_norm: float) -> list[str]:
    """What to try, most likely fix first, given the features this run uses."""
    hints = ["lower --optimizer.lr or raise --lr_scheduler.warmup_steps"]
    if max_norm <= 0:
        hints.append("clip gradients with --training.max_norm 1.0")
    hints.append("check the data around this step for broken documents")
    if converters:
        hints.append(f"run once without --model.converters {','.join(converters)} to see whether low precision "
                     f"causes it")
        if compile_enabled:
            hints.append("with low precision and --compile.enable, RMSNorm's precision casts can differ from eager: "
                         "try --compile.emulate_precision_casts (or TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1)")
    return hints


def nonfinite_reason(loss: float, grad_norm: float) -> str | None:
    """What is not finite, as messages say it ("loss is nan"); None when the loss and the norm both are."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm is {grad_norm} (loss {loss:.4f})"
    return None


def stop_error(step: int, what: str, last_finite_loss: float | None, model: nn.Module, hints: list[str],
               skipped: str = "") -> NonFiniteLossError:
    """The stop naming the step, what went wrong, the last finite loss, the first non-finite gradient, `skipped`
    (a sentence on the steps skipped before, if any) and what to try."""
    previous = f"{last_finite_loss:.4f}" if last_finite_loss is not None else "none (this is the first step)"
    bad_grad = first_nonfinite_grad(model)
    where = f" The first non-finite gradient is in {bad_grad}." if bad_grad else ""
    return NonFiniteLossError(
        f"Stopping: {what} at step {step}; the last finite loss was {previous}.{where}{skipped} "
        f"No optimizer step or checkpoint was taken with this state. Try: {'; '.join(hints)}."
    )

