"""The training loop. __init__ reads as the pipeline; run() is the loop; train_step() is one step."""

import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from titan.config.dtypes import to_dtype
from titan.config.job import JobConfig, Model
from titan.config.load import to_toml
from titan.data.loader import build_dataloader
from titan.data.tokenizer import build_tokenizer
from titan.metrics.log import current_rank, logger
from titan.metrics.profiling import build_memory_snapshotter, maybe_profile
from titan.metrics.sinks import build_sinks
from titan.metrics.throughput import ThroughputMeter
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs
from titan.models.llama.flops import flops_per_token, num_params
from titan.models.llama.init import init_weights
from titan.models.llama.loss import cross_entropy_loss
from titan.models.llama.model import Transformer
from titan.parallel.compile import apply_compile
from titan.parallel.dist import build_device
from titan.train.lr import build_lr_scheduler
from titan.train.nan_guard import check_finite, stop_hints
from titan.train.optim import build_optimizer


def build_model_args(model: Model, seq_len: int, vocab_size: int) -> ModelArgs:
    """The flavor's shape with the tokenizer's vocab and a rotary table as long as the training sequence."""
    return dataclasses.replace(LLAMA3_FLAVORS[model.flavor], vocab_size=vocab_size,
                               vocab_size_multiple_of=model.vocab_size_multiple_of, max_seq_len=seq_len)


def set_seed(seed: int, deterministic: bool) -> None:
    """Same seed, same weights and same losses on CPU; deterministic also pins GPU kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def write_config(cfg: JobConfig, dump_folder: Path) -> None:
    """Save the resolved config so `--job.config_file <dump_folder>/config.toml` reruns this job."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    text = to_toml(cfg)
    (dump_folder / "config.toml").write_text(text)
    if cfg.job.print_config:
        logger.info(f"Resolved config:\n{text}")


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.rank = current_rank()
        self.device = build_device()
        self.dump_folder = Path(cfg.job.dump_folder)
        if self.rank == 0:
            write_config(cfg, self.dump_folder)
        set_seed(cfg.training.seed, cfg.training.deterministic)

        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_args = build_model_args(cfg.model, cfg.training.seq_len, self.tokenizer.vocab_size)
        with torch.device("meta"):
            self.model = Transformer(self.model_args)
        self.log_model_size()
        if cfg.training.compile:
            apply_compile(self.model)
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            init_weights(self.model, buffer_device=self.device)
        self.model.train()

        self.loss_fn = torch.compile(cross_entropy_loss) if cfg.training.compile else cross_entropy_loss
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(self.tokenizer, cfg.training, dp_rank=0, dp_world_size=1)
        self.grad_accumulation_steps = self.count_accumulation_steps()

        self.flops_per_token = flops_per_token(self.model_args, num_params(self.model, exclude_embedding=True),
                                               cfg.training.seq_len)
        self.meter = ThroughputMeter(self.flops_per_token, self.device, cfg.training.steps)
        self.sinks = build_sinks(cfg.metrics, self.dump_folder, self.rank)
        self.hints = stop_hints(cfg.model.converters, cfg.training.compile, cfg.training.max_norm)
        self.step = 0
        self.last_finite_loss: float | None = None
        self.current_lr = cfg.optimizer.lr

    def count_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: global batch / (local batch x data-parallel degree)."""
        t = self.cfg.training
        if t.global_batch_size == -1:
            return 1
        steps = t.global_batch_size // t.local_batch_size
        logger.info(f"Global batch {t.global_batch_size}: {steps} gradient accumulation steps of {t.local_batch_size}")
        return steps

    def log_model_size(self) -> None:
        args = self.model_args
        logger.info(f"Model llama3 {self.cfg.model.flavor}: {num_params(self.model, exclude_embedding=False):,} "
                    f"parameters, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads "
                    f"({args.n_kv_heads} kv), vocab {args.vocab_size} (padded to "
                    f"{self.model.tok_embeddings.num_embeddings})")

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for a single device: matmuls in --training.mixed_precision_param."""
        dtype = to_dtype(self.cfg.training.mixed_precision_param)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def next_batch(self, data_iterator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(inputs, labels) on the device and the seconds spent waiting for them."""
        start = time.perf_counter()
        inputs, labels = next(data_iterator)
        waited = time.perf_counter() - start
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), waited

    def train_step(self, data_iterator) -> tuple[float, float]:
        """Forward and backward over the accumulation micro-batches, clip, check finite, step.
        Returns (loss, grad_norm) after the optimizer step."""
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        for _ in range(self.grad_accumulation_steps):
            inputs, labels, waited = self.next_batch(data_iterator)
            data_wait += waited
            with self.autocast():
                logits = self.model(inputs)
            loss = self.loss_fn(logits, labels, self.model_args.vocab_size) / self.grad_accumulation_steps
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = self.clip_gradients()
        loss_value, norm_value = loss_sum.item(), grad_norm.item()
        check_finite(self.step, loss_value, norm_value, self.last_finite_loss, self.model, self.hints)
        self.current_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.last_finite_loss = loss_value
        tokens = self.cfg.training.local_batch_size * self.cfg.training.seq_len * self.grad_accumulation_steps
        self.meter.add_step(tokens, data_wait)
        return loss_value, norm_value

    def clip_gradients(self) -> torch.Tensor:
        """Total gradient norm, clipping to --training.max_norm when it is positive."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.training.max_norm
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def should_log(self) -> bool:
        return self.step == 1 or self.step % self.cfg.metrics.log_freq == 0 or self.step == self.cfg.training.steps

    def run(self) -> None:
        """Train for --training.steps steps, logging every --metrics.log_freq."""
        total = self.cfg.training.steps
        logger.info(f"Training {total} steps on {self.device}, {self.cfg.training.local_batch_size} x "
                    f"{self.cfg.training.seq_len} tokens per micro-batch; writing to {self.dump_folder}")
        data_iterator = iter(self.dataloader)
        snapshotter = build_memory_snapshotter(self.cfg.profiling, self.dump_folder, self.rank)
        last_logged = 0
        with maybe_profile(self.cfg.profiling, self.dump_folder, self.rank) as profiler:
            try:
                while self.step < total:
                    self.step += 1
                    loss, grad_norm = self.train_step(data_iterator)
                    if self.should_log():
                        self.log_metrics(loss, grad_norm, self.step - last_logged)
                        last_logged = self.step
                    if profiler is not None:
                        profiler.step()
                    if snapshotter is not None:
                        snapshotter.step(self.step)
            finally:
                for sink in self.sinks:
                    sink.close()
        logger.info(f"Training finished after {self.step} steps.")

    def log_metrics(self, loss: float, grad_norm: float, steps_in_window: int) -> None:
        record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self.current_lr}
        record.update(self.meter.window(self.step, steps_in_window))
        for sink in self.sinks:
            sink.write(record)
