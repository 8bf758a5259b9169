"""Steps that go wrong: non-finite losses and loss spikes, what the run does about them (--training.on_nonfinite,
--training.on_spike, --training.max_skipped_steps), and their record in <dump_folder>/anomalies.jsonl.

Every rank judges the same global loss and gradient norm (Trainer.global_mean), so every rank makes the same
decision at the same step without a collective of its own. A spike is a loss above the median of the last
--training.spike_window applied steps' losses by more than --training.spike_threshold median absolute deviations
(MAD, floored at 1% of the median): a robust test, since one earlier spike in the window moves neither statistic.

Each step is judged twice, alike: on the device when its update is queued (skips_update: a 0-dim tensor that gates
the optimizer, so the host never waits for the loss), and on the host once the loss and norm have come back, a step
later (inspect: the record, the log line, a rollback or a stop). The device compares against the spike limit of the
window as the host holds it then, which is the window inspect() judges the step by.
"""

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from titan.config.job import Training
from titan.metrics.log import logger
from titan.train.nan_guard import NonFiniteLossError, nonfinite_reason, stop_error

ANOMALIES_FILE = "anomalies.jsonl"
MAD_FLOOR = 0.01
"""The deviation a spike is measured in is at least this fraction of the median, so a flat loss never flags noise."""


@dataclass(frozen=True)
class Spike:
    """The statistics a loss was judged a spike by: it exceeded `limit` = median + threshold x max(mad, 1% median)."""

    median: float
    mad: float
    threshold: float
    limit: float


class SpikeDetector:
    """The losses of the last `window` applied steps, and whether a new loss is a spike against them."""

    def __init__(self, window: int, threshold: float, losses: list[float]) -> None:
        self.threshold = threshold
        self.losses: deque[float] = deque(losses, maxlen=window)

    def bound(self) -> Spike | None:
        """The statistics of the full window, whose `limit` a loss must exceed to be a spike; None while the window
        is not full yet."""
        if len(self.losses) < self.losses.maxlen:
            return None
        median = statistics.median(self.losses)
        mad = statistics.median(abs(value - median) for value in self.losses)
        limit = median + self.threshold * max(mad, MAD_FLOOR * abs(median))
        return Spike(median, mad, self.threshold, limit)

    def check(self, loss: float) -> Spike | None:
        """The spike `loss` is, or None (also while the window is not full yet)."""
        bound = self.bound()
        return bound if bound is not None and loss > bound.limit else None

    def add(self, loss: float) -> None:
        self.losses.append(loss)

    def describe(self, loss: float, spike: Spike) -> str:
        floored = " (floored at 1% of the median)" if spike.mad < MAD_FLOOR * abs(spike.median) else ""
        return (f"loss {loss:.4f} is a spike: above {spike.limit:.4f}, the median {spike.median:.4f} of the last "
                f"{len(self.losses)} losses plus {spike.threshold:g} x their median absolute deviation "
                f"{spike.mad:.4f}{floored}")


Action = Literal["skip", "rollback", "log", "stop"]


@dataclass
class Anomaly:
    """A step whose loss or gradient norm was not finite, or whose loss spiked, and what the run did about it. The
    trainer fills in the checkpoint of a rollback, or turns it into a skip when there is no checkpoint yet."""

    step: int
    loss: float
    grad_norm: float
    kind: Literal["nonfinite", "spike"]
    action: Action
    what: str
    """The problem in words, as the log line and the stop message give it."""
    data_position: dict[str, Any]
    """Where the step's first batch started (the dataset's position() before the step drew its batches)."""
    spike: Spike | None = None
    checkpoint_step: int | None = None
    batches_skipped: int | None = None
    """Micro-batches per data-parallel rank that a rollback left untrained: those of the steps it undid."""
    skips_used_up: str = ""
    """For a stop past --training.max_skipped_steps: the sentence saying so, for the stop message."""

    @property
    def applied(self) -> bool:
        """Whether the step's update goes ahead (a spike that is only logged)."""
        return self.action == "log"

    def record(self) -> dict[str, Any]:
        """The line of anomalies.jsonl: plain JSON, with a non-finite number written as a string ("nan", "inf")."""
        record: dict[str, Any] = {"step": self.step, "kind": self.kind, "action": self.action,
                                  "loss": json_number(self.loss), "grad_norm": json_number(self.grad_norm),
                                  "data_position": self.data_position}
        if self.spike is not None:
            record.update(median=self.spike.median, mad=self.spike.mad, threshold=self.spike.threshold,
                          limit=self.spike.limit)
        if self.checkpoint_step is not None:
            record.update(checkpoint_step=self.checkpoint_step, batches_skipped=self.batches_skipped)
        return record


def json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def skips_update(loss: Tensor, grad_norm: Tensor, limit: float = math.inf) -> Tensor:
    """Whether a step's update must not apply: its loss or gradient norm is not finite, or its loss is over `limit`
    (compared in float64, as the host compares its float), as a 0-dim bool tensor on their device: no host read."""
    applies = torch.isfinite(loss) & torch.isfinite(grad_norm) & (loss.double() <= limit)
    return ~applies


class AnomalyGuard:
    """Judges each step: on the device before its update (skips_update), and on the host once its loss and norm are
    read (inspect: a normal step, or an Anomaly saying whether the update applied, was skipped, or must be rolled
    back or stop the run). Rank 0 logs and records every anomaly."""

    def __init__(self, training: Training, dump_folder: Path, rank: int, model: nn.Module, hints: list[str],
                 spike_losses: list[float], num_skipped: int) -> None:
        """`hints` are what a stop suggests (nan_guard.stop_hints); `spike_losses` and `num_skipped` are the spike
        window and the steps skipped or rolled back so far, as a resumed checkpoint saved them."""
        self.training = training
        self.path = dump_folder / ANOMALIES_FILE
        self.rank = rank
        self.model = model
        self.hints = hints
        self.num_skipped = num_skipped
        self.detector = SpikeDetector(training.spike_window, training.spike_threshold, spike_losses)

    @property
    def window(self) -> list[float]:
        """The losses of the last applied steps, oldest first: saved with checkpoints."""
        return list(self.detector.losses)

    def restore_window(self, losses: list[float]) -> None:
        """After a rollback: the window of the checkpoint's step (the skip count is kept)."""
        self.detector = SpikeDetector(self.training.spike_window, self.training.spike_threshold, losses)

    def skips_update(self, loss: Tensor, grad_norm: Tensor) -> Tensor:
        """Whether inspect() will find that this step's update must not apply (a non-finite loss or norm, or a
        spike under --training.on_spike skip or rollback), as a 0-dim bool tensor on their device: no host read.
        The loss is compared in float64, as the host compares its float against the limit."""
        bound = self.detector.bound() if self.training.on_spike != "log" else None
        return skips_update(loss, grad_norm, bound.limit if bound is not None else math.inf)

    def inspect(self, step: int, loss: float, grad_norm: float, data_position: dict[str, Any]) -> Anomaly | None:
        """None for a normal step (its loss joins the spike window), else the step's Anomaly, whose `applied` says
        whether its update went ahead and whose action "stop" means the run must end (stop_error)."""
        nonfinite = nonfinite_reason(loss, grad_norm)
        if nonfinite is not None:
            anomaly = Anomaly(step, loss, grad_norm, "nonfinite", "skip", nonfinite, data_position)
            if self.training.on_nonfinite == "stop":
                anomaly.action = "stop"
                return anomaly
            return self.count_skip(anomaly)
        spike = self.detector.check(loss)
        if spike is None:
            self.detector.add(loss)
            return None
        anomaly = Anomaly(step, loss, grad_norm, "spike", self.training.on_spike, self.detector.describe(loss, spike),
                          data_position, spike)
        if anomaly.applied:
            self.detector.add(loss)
            return anomaly
        return self.count_skip(anomaly)

    def count_skip(self, anomaly: Anomaly) -> Anomaly:
        """Allow one more skip or rollback, or stop when --training.max_skipped_steps are used up."""
        allowed = self.training.max_skipped_steps
        if self.num_skipped >= allowed:
            anomaly.action = "stop"
            anomaly.skips_used_up = (f" {self.num_skipped} earlier steps were skipped or rolled back, the most "
                                     f"--training.max_skipped_steps {allowed} allows.")
            return anomaly
        self.num_skipped += 1
        return anomaly

    def stop_error(self, anomaly: Anomaly) -> NonFiniteLossError:
        """Record a stopping anomaly and return the error that ends the run (exit code 3). The model's gradients
        must be the anomaly's step's: the message names the first non-finite one."""
        self.write(anomaly)
        last_finite = self.detector.losses[-1] if self.detector.losses else None
        return stop_error(anomaly.step, anomaly.what, last_finite, self.model, self.hints, anomaly.skips_used_up)

    def record(self, anomaly: Anomaly) -> None:
        """Log the anomaly (a warning, on rank 0) and append it to anomalies.jsonl, once its action is final."""
        if self.rank != 0:
            return
        allowance = f"({self.num_skipped} of {self.training.max_skipped_steps} allowed skips)"
        if anomaly.action == "log":
            logger.warning(f"Loss spike at step {anomaly.step}: {anomaly.what}. The update was applied "
                           f"(--training.on_spike log).")
        elif anomaly.action == "rollback":
            logger.warning(f"Rolled back step {anomaly.step}: {anomaly.what}. Reloaded the checkpoint of step "
                           f"{anomaly.checkpoint_step} and skipped the data of steps {anomaly.checkpoint_step + 1} "
                           f"to {anomaly.step} ({anomaly.batches_skipped} batches per data-parallel rank) "
                           f"{allowance}")
        else:
            no_checkpoint = ("; there is no complete checkpoint to roll back to yet"
                             if anomaly.kind == "spike" and self.training.on_spike == "rollback" else "")
            logger.warning(f"Skipped step {anomaly.step}: {anomaly.what}{no_checkpoint} {allowance}")
        self.write(anomaly)

    def write(self, anomaly: Anomaly) -> None:
        """Append one line to <dump_folder>/anomalies.jsonl (rank 0), flushed at once: anomalies are rare and the
        record must survive a crash right after."""
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps(anomaly.record()) + "\n")
