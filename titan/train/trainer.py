"""The training loop. __init__ reads as the pipeline: the shared build (titan/train/build.py: mesh through
optimizer), then data, checkpoints and metrics; run() is the loop; train_step() queues one step and finishes the
one before it (finish_step: the host's part, a step late, so that the host never waits for the device)."""

import dataclasses
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from titan.checkpoint.dcp import Checkpointer, TrainState
from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.load import to_toml
from titan.config.paths import checkpoint_root
from titan.data.loader import batch_to, build_dataloader, build_validation_batches
from titan.data.micro_batch import Batch, MicroBatch
from titan.data.tokenizer import build_tokenizer
from titan.exits import KnownStop
from titan.metrics.goodput import (
    EventLog,
    attempt_number,
    launch_time,
    measure_goodput,
    process_start_time,
    read_events,
)
from titan.metrics.log import current_rank, logger
from titan.metrics.profiling import build_memory_snapshotter, maybe_profile
from titan.metrics.sinks import build_sinks
from titan.metrics.throughput import ThroughputMeter
from titan.parallel.dims import build_device, data_parallel_rank, init_distributed, resolve_dims, set_collective_timeout
from titan.train.anomalies import Anomaly, AnomalyGuard
from titan.train.build import build_training_step
from titan.train.evaluate import EvalResult, evaluate
from titan.train.faults import FaultInjector
from titan.train.garbage import ScheduledCollector
from titan.train.nan_guard import stop_hints
from titan.train.preemption import Stopper
from titan.train.readback import Readback
from titan.train.stragglers import StragglerWatch


def write_config(cfg: JobConfig, dump_folder: Path) -> None:
    """Save the resolved config so `--job.config_file <dump_folder>/config.toml` reruns this job. Written only once
    the job has started, so an attempt that fails to start (a bad resume, say) never replaces a run's record."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    (dump_folder / "config.toml").write_text(to_toml(cfg))


@dataclass(frozen=True)
class QueuedStep:
    """A step whose forward, backward and clipping are queued on the device."""

    step: int
    micro_batches: list[MicroBatch]
    data_position: dict[str, Any]
    """Where the step's first batch started (the loader's position before the step drew its batches)."""
    data_wait: float
    """Seconds spent waiting for the step's batches."""
    gradients: tuple[torch.Tensor, torch.Tensor]
    """(this rank's scaled loss sum, the global gradient norm), on the device."""


@dataclass(frozen=True)
class PendingStep:
    """A step whose update is queued too, and whose loss, norm and skip flag are on their way to the host."""

    queued: QueuedStep
    lr: float
    """The learning rate of its update."""
    tokens_by_source: dict[str, int] | None
    """Tokens drawn from each source up to this step, taken when it is a step that logs."""
    readback: Readback


@dataclass(frozen=True)
class StepResult:
    """A finished step as the host judged it."""

    step: int
    loss: float
    grad_norm: float
    anomaly: Anomaly | None
    rolled_back: bool


class Trainer:
    def __init__(self, cfg: JobConfig, world_size: int) -> None:
        self.cfg = cfg
        self.rank = current_rank()
        self.device = build_device()
        self.dims = resolve_dims(cfg.parallelism, world_size, cfg.training.enable_cpu_offload)
        self.dump_folder = Path(cfg.job.dump_folder)
        # The goodput log (rank 0's): this process's start, and each stage of its way to the first step.
        self.events = EventLog(self.dump_folder, enabled=self.rank == 0)
        self.events.write("start", t=process_start_time(), launch=launch_time(), attempt=attempt_number())
        self.events.write("init")
        self.stopper = Stopper(cfg.job, cfg.comm, cfg.checkpoint, cfg.training.steps, self.dump_folder, world_size)
        init_distributed(cfg.comm, self.device, self.dims, self.dump_folder,
                         cpu_collectives=cfg.training.enable_cpu_offload)
        logger.info(f"Job: {cfg.job.description} (--job.description)")
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.training = build_training_step(cfg, self.dims, self.device, self.tokenizer.vocab_size)
        set_collective_timeout(self.training.meshes, cfg.comm.init_timeout_seconds)
        self.events.write("built")

        dp_rank, dp_degree = data_parallel_rank(self.training.meshes)
        self.dataloader = build_dataloader(self.tokenizer, cfg.training, dp_rank, dp_degree, chat=cfg.chat,
                                           pin_memory=self.device.type == "cuda")
        self.validation_batches = (build_validation_batches(self.tokenizer, cfg.validation, cfg.training, dp_rank,
                                                            dp_degree, cfg.chat) if cfg.validation.enable else None)
        model_parts = self.training.model_parts
        self.checkpointer = Checkpointer(cfg.checkpoint, self.dump_folder, model_parts.model,
                                         self.training.optimizer, self.training.lr_scheduler, self.dataloader,
                                         self.device, dp_degree, model_parts.fqns, self.tokenizer)
        resumed = self.checkpointer.load() if not cfg.checkpoint.create_seed_checkpoint else TrainState()
        self.events.write("loaded", step=resumed.step)
        checkpoint_folder = Path(checkpoint_root(cfg.checkpoint.folder, self.dump_folder))
        self.faults = FaultInjector(cfg.fault, self.rank, world_size, checkpoint_folder, self.dump_folder,
                                    self.training.optimizer)

        self.meter = ThroughputMeter(model_parts.flops_per_token, self.device, cfg.training.steps)
        # A run that starts over gets a new id; a resumed one keeps its checkpoint's (rank 0's, which is saved).
        self.run_id = resumed.run_id or uuid.uuid4().hex[:12]
        self.sinks = build_sinks(cfg.metrics, self.dump_folder, self.rank, dataclasses.asdict(cfg), self.run_id)
        self.anomalies = AnomalyGuard(cfg.training, self.dump_folder, self.rank, model_parts.model,
                                      stop_hints(cfg.model.converters, cfg.compile.enable, cfg.training.max_norm),
                                      resumed.spike_losses, resumed.num_skipped)
        self.collector = ScheduledCollector(cfg.training.gc_freq)
        self.stragglers = StragglerWatch(cfg.metrics.straggler_threshold, cfg.metrics.straggler_window, self.rank,
                                         world_size)
        self.step = resumed.step
        self.tokens_seen = resumed.tokens_seen
        self.current_lr = cfg.optimizer.lr
        self.pending: PendingStep | None = None
        self.first_step = self.step + 1
        """This run's first step, always logged (after a resume as well)."""

    def run(self) -> None:
        """Train from the resumed step to --training.steps, logging every --metrics.log_freq and saving every
        --checkpoint.interval (and at the last step). A signal or --job.time_limit stops every rank at a step
        boundary (after saving: exit code 4), and a hang ends the run with code 5 (titan/train/preemption.py).

        Steps overlap by one on the host: step N is queued before step N-1's loss is read, and a step whose state
        is needed whole (a save, an evaluation, the last step, a stop) is finished before that happens."""
        if self.rank == 0:
            write_config(self.cfg, self.dump_folder)
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            return
        total = self.cfg.training.steps
        logger.info(f"Training {total} steps on {self.device}, {self.cfg.training.local_batch_size} x "
                    f"{self.cfg.training.seq_len} tokens per micro-batch; writing to {self.dump_folder}")
        data_iterator = iter(self.dataloader)
        snapshotter = build_memory_snapshotter(self.cfg.profiling, self.dump_folder, self.rank)
        with maybe_profile(self.cfg.profiling, self.dump_folder, self.rank) as profiler, \
                self.stopper.watching(self.training.meshes), self.collector:
            ended = False
            try:
                self.events.write("ready")
                self.meter.start()
                while self.step < total:
                    self.step += 1
                    self.stopper.start_step(self.step)
                    self.train_step(data_iterator)
                    saving = self.checkpointer.should_save(self.step, total)
                    rolled_back = (saving or self.should_validate()) and self.finish_rolled_back()
                    saving = saving and not rolled_back
                    stop = self.stopper.end_step(self.step, saving=saving)
                    if stop is not None:
                        rolled_back = self.finish_rolled_back() or rolled_back
                    self.events.write("step", step=self.step)
                    if not rolled_back:
                        self.after_step(profiler, snapshotter)
                    self.faults.step_ended(self.step)
                    if stop is not None:
                        self.stopper.stop(stop, self.checkpointer, self.train_state())
                self.finish_step()
                ended = True
            except (KnownStop, ConfigError):
                ended = True  # a stop that explains itself; any other error is the launcher's to record
                raise
            finally:
                if ended:
                    self.record_goodput()
                self.events.close()
                self.dataloader.close()
                self.checkpointer.close()
                for sink in self.sinks:
                    sink.close()
        logger.info(f"Training finished after {self.step} steps.")

    def train_step(self, data_iterator: Iterator[Batch]) -> StepResult | None:
        """Queue step self.step: forward and backward over its accumulation micro-batches and clipping, then, once
        the previous step is finished, its update, which the device skips when the step's own judgement says so
        (AnomalyGuard.skips_update). Finishing the previous step while this one runs is what keeps the host off the
        device's critical path: its loss and norm were copied back asynchronously, and reading them now waits for
        nothing still queued. Returns the previous step's result, or None when there was none pending.

        If the previous step rolls training back, the batches drawn for this step train the checkpoint's next
        step instead: the data after the spike, as if the rollback had come before they were drawn."""
        queued = self.queue_gradients(data_iterator)
        result = self.finish_step()
        if result is not None and result.rolled_back:
            self.step += 1
            self.stopper.start_step(self.step)
            queued = replace(queued, step=self.step, gradients=self.training.compute_gradients(queued.micro_batches))
        self.queue_update(queued)
        return result

    def queue_gradients(self, data_iterator: Iterator[Batch]) -> QueuedStep:
        """Draw this step's micro-batches and queue their forward and backward passes and the clipping."""
        data_position = self.dataloader.position()
        start = time.perf_counter()
        micro_batches = [self.training.micro_batch(*self.next_batch(data_iterator))
                         for _ in range(self.training.grad_accumulation_steps)]
        data_wait = time.perf_counter() - start
        gradients = self.training.compute_gradients(micro_batches)
        return QueuedStep(self.step, micro_batches, data_position, data_wait, gradients)

    def queue_update(self, queued: QueuedStep) -> None:
        """Queue the step's update, skipped on the device if the step is judged to need it, and the copy of its
        loss, gradient norm and skip flag to the host; the step is pending until finish_step reads them."""
        training = self.training
        loss_sum, grad_norm = queued.gradients
        loss = training.global_mean(loss_sum).float()
        skip = self.anomalies.skips_update(loss, grad_norm)
        readback = training.update_and_read_back(loss, grad_norm, skip)
        group = training.optimizer.param_groups[0]
        self.current_lr = group["lr"] / group["lr_multiplier"]  # the schedule's rate, which groups scale
        self.tokens_seen += training.global_tokens_per_step
        self.meter.step_queued(queued.step, training.global_tokens_per_step / self.dims.world_size, queued.data_wait)
        tokens_by_source = self.dataloader.tokens_per_source() if self.should_log(queued.step) else None
        self.pending = PendingStep(queued, self.current_lr, tokens_by_source, readback)

    def finish_step(self) -> StepResult | None:
        """Read the pending step's loss and norm and do what the host does about them: judge the step (log,
        record, roll back or stop), advance the LR schedule if its update applied, and log its metrics. None when
        no step is pending."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        queued = pending.queued
        loss, grad_norm, skipped = pending.readback.values()
        anomaly = self.anomalies.inspect(queued.step, loss, grad_norm, queued.data_position)
        applied = anomaly is None or anomaly.applied
        assert applied != bool(skipped), f"step {queued.step}: the device and the host judged its update differently"
        if applied:
            self.training.lr_scheduler.step()
        rolled_back = False
        if anomaly is not None:
            if anomaly.action == "stop":
                self.stop_diverged(queued, anomaly)
            rolled_back = self.handle_anomaly(anomaly)
        if rolled_back:
            self.meter.start()  # the steps after the checkpoint's run again; the reload is not a step's time
        elif self.should_log(queued.step):
            self.log_metrics(pending, loss, grad_norm)
        return StepResult(queued.step, loss, grad_norm, anomaly, rolled_back)

    def finish_rolled_back(self) -> bool:
        """Finish the pending step, if any: whether it rolled training back."""
        result = self.finish_step()
        return result is not None and result.rolled_back

    def stop_diverged(self, queued: QueuedStep, anomaly: Anomaly) -> NoReturn:
        """End the run at the queued step (exit code 3). Its update never applied, so the weights are still the
        ones its gradients came from: computing them again, in place of the next step's, lets the message name
        the first non-finite one."""
        self.step = queued.step
        if anomaly.kind == "nonfinite":
            self.training.compute_gradients(queued.micro_batches)
        error = self.anomalies.stop_error(anomaly)
        self.write_record(anomaly.record())
        raise error

    def next_batch(self, data_iterator: Iterator[Batch]) -> Batch:
        """The loader's next batch on the device, copied without waiting where the loader pins memory."""
        return batch_to(next(data_iterator), self.device)

    def handle_anomaly(self, anomaly: Anomaly) -> bool:
        """Carry out a flagged step's --training.on_spike rollback (a skip when there is no checkpoint yet), then
        log and record the step. Returns whether training went back to a checkpoint's step."""
        rolled_back = anomaly.action == "rollback" and self.roll_back(anomaly)
        self.anomalies.record(anomaly)
        self.write_record(anomaly.record())
        return rolled_back

    def roll_back(self, anomaly: Anomaly) -> bool:
        """Reload the last complete checkpoint, keeping the data iterator where it is: the batches of the steps
        undone (the spike's included) are skipped, and training goes on from the checkpoint's step with the data
        after the spike (OPT, PaLM). The skip count and the anomaly record are kept; the spike window is the
        checkpoint's. Without a checkpoint the step is skipped instead."""
        restored = self.checkpointer.restore_latest(before_step=anomaly.step)
        if restored is None:
            anomaly.action = "skip"
            return False
        anomaly.checkpoint_step = restored.step
        anomaly.batches_skipped = (anomaly.step - restored.step) * self.training.grad_accumulation_steps
        self.step, self.tokens_seen = restored.step, restored.tokens_seen
        self.anomalies.restore_window(restored.spike_losses)
        return True

    def should_log(self, step: int) -> bool:
        """Every --metrics.log_freq steps, and this run's first and last step."""
        return step == self.first_step or step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps

    def log_metrics(self, pending: PendingStep, loss: float, grad_norm: float) -> None:
        step = pending.queued.step
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": pending.lr}
        rates = self.meter.window(step)
        step_s = rates.pop("step_s")
        record.update(rates)
        # Every rank logs the same steps: one all-reduce tells the fastest and the slowest rank's time, and every
        # rank's optimizer-step time (stragglers).
        update_slots = self.stragglers.slots(self.training.last_update_seconds())
        slowest, minus_fastest, *update_medians = self.stopper.agree([step_s, -step_s, *update_slots])
        self.stragglers.judge(update_medians)
        record.update(step_time_min_s=-minus_fastest, step_time_max_s=slowest)
        record["gc_pause_s"] = self.collector.take_pause_seconds()
        tokens_by_source = pending.tokens_by_source
        record["tokens_by_source"] = tokens_by_source if tokens_by_source and len(tokens_by_source) > 1 else None
        record.update(self.training.model_metrics())
        self.write_record(record)

    def write_record(self, record: dict[str, Any]) -> None:
        """Hand a metrics, evaluation or anomaly record to every sink."""
        for sink in self.sinks:
            sink.write(record)

    def record_goodput(self) -> None:
        """Mark this attempt's end in the goodput log and hand the job's goodput so far, every attempt's, to the
        sinks (rank 0, which keeps the log)."""
        self.events.write("end")
        if self.rank == 0:
            goodput = measure_goodput(read_events(self.dump_folder), now=time.time())
            self.write_record(goodput.record(self.step))

    def after_step(self, profiler: Any, snapshotter: Any) -> None:
        """Evaluate, profile, collect garbage and save as this step calls for; evaluations and saves are events of the
        goodput log."""
        if self.should_validate():
            self.validate()
            self.events.write("eval", step=self.step)
        if profiler is not None:
            profiler.step()
        if snapshotter is not None:
            snapshotter.step(self.step)
        self.collector.step(self.step)
        self.checkpointer.poll()
        total = self.cfg.training.steps
        if self.checkpointer.should_save(self.step, total):
            start = time.perf_counter()
            self.checkpointer.save(self.train_state(), last_step=total)
            self.meter.exclude(time.perf_counter() - start)
            self.events.write("save", step=self.step)

    def should_validate(self) -> bool:
        v = self.cfg.validation
        return v.enable and (self.step % v.freq == 0 or self.step == self.cfg.training.steps)

    def validate(self) -> None:
        """Evaluate and log val_loss at this step; the time is left out of the training steps' times."""
        result = self.run_validation()
        self.meter.exclude(result.seconds)
        self.write_record(result.record(self.step))

    def run_validation(self) -> EvalResult:
        """The loss over the validation set, in eval mode, without gradients."""
        training = self.training
        for part in training.model_parts.parts:
            part.eval()
        batches = self.validation_batches
        tokens_per_batch = batches.local_batch_size * batches.seq_len * self.dims.dp_degree
        result = evaluate(batches, training.evaluation_loss, training.global_sum, tokens_per_batch, self.device,
                          compiled=self.cfg.compile.enable)
        for part in training.model_parts.parts:
            part.train()
        return result

    def train_state(self) -> TrainState:
        return TrainState(step=self.step, tokens_seen=self.tokens_seen, dp_degree=self.dims.dp_degree,
                          world_size=self.dims.world_size, spike_losses=self.anomalies.window,
                          num_skipped=self.anomalies.num_skipped, run_id=self.run_id)
