"""The training loop. __init__ reads as the pipeline: the shared build (titan/train/step.py: mesh through
optimizer), then data, checkpoints and metrics; run() is the loop; train_step() is one step."""

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titan.checkpoint.dcp import Checkpointer, TrainState
from titan.config.job import JobConfig
from titan.config.load import to_toml
from titan.data.loader import build_dataloader, build_validation_batches
from titan.data.tokenizer import build_tokenizer
from titan.metrics.log import current_rank, logger
from titan.metrics.profiling import build_memory_snapshotter, maybe_profile
from titan.metrics.sinks import build_sinks
from titan.metrics.throughput import ThroughputMeter
from titan.parallel.dims import build_device, data_parallel_rank, init_distributed, resolve_dims, set_collective_timeout
from titan.train.anomalies import Anomaly, AnomalyGuard
from titan.train.evaluate import EvalResult, evaluate
from titan.train.nan_guard import stop_hints
from titan.train.preemption import Stopper
from titan.train.step import build_training_step


def write_config(cfg: JobConfig, dump_folder: Path) -> None:
    """Save the resolved config so `--job.config_file <dump_folder>/config.toml` reruns this job. Written only once
    the job has started, so an attempt that fails to start (a bad resume, say) never replaces a run's record."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    text = to_toml(cfg)
    (dump_folder / "config.toml").write_text(text)
    if cfg.job.print_config:
        logger.info(f"Resolved config:\n{text}")


class Trainer:
    def __init__(self, cfg: JobConfig, world_size: int) -> None:
        self.cfg = cfg
        self.rank = current_rank()
        self.device = build_device()
        self.dims = resolve_dims(cfg.parallelism, world_size)
        self.dump_folder = Path(cfg.job.dump_folder)
        self.stopper = Stopper(cfg.job, cfg.comm, cfg.checkpoint, cfg.training.steps, self.dump_folder,
                               self.device, world_size)
        init_distributed(cfg.comm, self.device, world_size)
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.training = build_training_step(cfg, self.dims, self.device, self.tokenizer.vocab_size,
                                            self.tokenizer.bos_id)
        set_collective_timeout(self.training.meshes, cfg.comm.init_timeout_seconds)

        dp_rank, dp_degree = data_parallel_rank(self.training.meshes)
        self.dataloader = build_dataloader(self.tokenizer, cfg.training, dp_rank, dp_degree,
                                           pin_memory=self.device.type == "cuda")
        self.validation_batches = (build_validation_batches(self.tokenizer, cfg.validation, cfg.training, dp_rank,
                                                            dp_degree) if cfg.validation.enable else None)
        model_parts = self.training.model_parts
        self.checkpointer = Checkpointer(cfg.checkpoint, self.dump_folder, model_parts.model,
                                         self.training.optimizer, self.training.lr_scheduler, self.dataloader,
                                         self.device, dp_degree, model_parts.fqns, self.tokenizer)
        resumed = self.checkpointer.load() if not cfg.checkpoint.create_seed_checkpoint else TrainState()

        self.meter = ThroughputMeter(model_parts.flops_per_token, self.device, cfg.training.steps)
        self.sinks = build_sinks(cfg.metrics, self.dump_folder, self.rank)
        self.anomalies = AnomalyGuard(cfg.training, self.dump_folder, self.rank, model_parts.model,
                                      stop_hints(cfg.model.converters, cfg.training.compile, cfg.training.max_norm),
                                      resumed.spike_losses, resumed.num_skipped)
        self.step = resumed.step
        self.tokens_seen = resumed.tokens_seen
        self.current_lr = cfg.optimizer.lr

    def run(self) -> None:
        """Train from the resumed step to --training.steps, logging every --metrics.log_freq and saving every
        --checkpoint.interval (and at the last step). A signal or --job.time_limit stops every rank at a step
        boundary (after saving: exit code 4), and a hang ends the run with code 5 (titan/train/preemption.py)."""
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
        last_logged = self.step
        with maybe_profile(self.cfg.profiling, self.dump_folder, self.rank) as profiler, \
                self.stopper.watching(self.training.meshes):
            try:
                while self.step < total:
                    self.step += 1
                    self.stopper.start_step(self.step)
                    loss, grad_norm, anomaly = self.train_step(data_iterator)
                    self.tokens_seen += self.training.global_tokens_per_step
                    rolled_back = anomaly is not None and self.handle_anomaly(anomaly)
                    saving = not rolled_back and self.checkpointer.should_save(self.step, total)
                    stop = self.stopper.end_step(self.step, saving=saving)
                    if rolled_back:
                        last_logged = self.step  # the steps after the checkpoint's run again
                    else:
                        if self.should_log():
                            self.log_metrics(loss, grad_norm, self.step - last_logged)
                            last_logged = self.step
                        self.after_step(profiler, snapshotter)
                    if stop is not None:
                        self.stopper.stop(stop, self.checkpointer, self.train_state())
            finally:
                self.dataloader.close()
                self.checkpointer.close()
                for sink in self.sinks:
                    sink.close()
        logger.info(f"Training finished after {self.step} steps.")

    def train_step(self, data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[float, float, Anomaly | None]:
        """Forward and backward over the accumulation micro-batches, clip, judge the step (titan/train/anomalies.py)
        and step unless it is skipped. Returns (loss, grad_norm, the step's anomaly or None)."""
        training = self.training
        training.optimizer.zero_grad()
        data_position = self.dataloader.position()
        waits: list[float] = []

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                inputs, labels, waited = self.next_batch(data_iterator)
                waits.append(waited)
                yield inputs, labels

        loss_sum, grad_norm = training.compute_gradients(batches())
        data_wait = sum(waits)
        # One device-to-host read per step for both values: each .item() would stall a GPU's launch queue.
        loss_value, norm_value = torch.stack([training.global_mean(loss_sum), grad_norm.float()]).tolist()
        self.current_lr = training.optimizer.param_groups[0]["lr"]
        anomaly = self.anomalies.inspect(self.step, loss_value, norm_value, data_position)
        if anomaly is None or anomaly.applied:
            training.apply_update()
        else:
            # No optimizer or LR-schedule step; nothing after this step (a save, a probe) sees the dropped gradients.
            training.optimizer.zero_grad()
        self.meter.add_step(training.global_tokens_per_step / self.dims.world_size, data_wait)
        return loss_value, norm_value, anomaly

    def next_batch(self, data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(inputs, labels) on the device and the seconds spent waiting for them."""
        start = time.perf_counter()
        inputs, labels = next(data_iterator)
        waited = time.perf_counter() - start
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), waited

    def handle_anomaly(self, anomaly: Anomaly) -> bool:
        """Carry out a flagged step's --training.on_spike rollback (a skip when there is no checkpoint yet), then
        log and record the step. Returns whether training went back to a checkpoint's step."""
        rolled_back = anomaly.action == "rollback" and self.roll_back(anomaly)
        self.anomalies.record(anomaly)
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

    def should_log(self) -> bool:
        return self.step == 1 or self.step % self.cfg.metrics.log_freq == 0 or self.step == self.cfg.training.steps

    def log_metrics(self, loss: float, grad_norm: float, steps_in_window: int) -> None:
        record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self.current_lr}
        record.update(self.meter.window(self.step, steps_in_window))
        record.update(self.stopper.step_times)
        tokens_by_source = self.dataloader.tokens_per_source()
        record["tokens_by_source"] = tokens_by_source if len(tokens_by_source) > 1 else None
        for sink in self.sinks:
            sink.write(record)

    def after_step(self, profiler: Any, snapshotter: Any) -> None:
        """Evaluate, profile and save as this step calls for."""
        if self.should_validate():
            self.validate()
        if profiler is not None:
            profiler.step()
        if snapshotter is not None:
            snapshotter.step(self.step)
        self.checkpointer.poll()
        total = self.cfg.training.steps
        if self.checkpointer.should_save(self.step, total):
            self.checkpointer.save(self.train_state(), last_step=total)

    def should_validate(self) -> bool:
        v = self.cfg.validation
        return v.enable and (self.step % v.freq == 0 or self.step == self.cfg.training.steps)

    def validate(self) -> None:
        """Evaluate and log val_loss at this step; the time is left out of the throughput window."""
        result = self.run_validation()
        self.meter.exclude(result.seconds)
        for sink in self.sinks:
            sink.write(result.record(self.step))

    def run_validation(self) -> EvalResult:
        """The loss over the validation set, in eval mode, without gradients."""
        training = self.training
        for part in training.model_parts.parts:
            part.eval()
        batches = self.validation_batches
        tokens_per_batch = batches.local_batch_size * batches.seq_len * self.dims.dp_degree
        result = evaluate(batches, training.evaluation_loss, training.global_sum, tokens_per_batch, self.device,
                          compiled=self.cfg.training.compile)
        for part in training.model_parts.parts:
            part.train()
        return result

    def train_state(self) -> TrainState:
        return TrainState(step=self.step, tokens_seen=self.tokens_seen, dp_degree=self.dims.dp_degree,
                          world_size=self.dims.world_size, spike_losses=self.anomalies.window,
                          num_skipped=self.anomalies.num_skipped)
