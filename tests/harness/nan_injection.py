"""The loss made NaN at chosen steps, as a diverging run would make it: the one injection that the anomaly, step-loop
and W&B tests and the anomaly probe process share."""

from collections.abc import Callable, Container

import torch

from titan.train.trainer import Trainer


def nan_at(trainer: Trainer, steps: Container[int],
           set_attribute: Callable[[object, str, object], None] = setattr) -> None:
    """Multiply the loss of every model part of this rank (its pipeline stages, or the whole model) by NaN whenever
    the trainer's step is in `steps`; each time the loop reaches such a step, also after a rollback. Tests pass
    monkeypatch.setattr as `set_attribute`, so that the loss is restored after them; a probe process, which ends
    with its run, keeps the default."""
    for part in trainer.training.model_parts.parts:
        real_loss = part.output_loss.logits_loss

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor, real_loss=real_loss) -> torch.Tensor:
            loss = real_loss(logits, labels)
            return loss * float("nan") if trainer.step in steps else loss

        set_attribute(part.output_loss, "logits_loss", loss_fn)
