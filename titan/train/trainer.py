"""The training loop. __init__ reads as the pipeline; run() is the loop; train_step() is one step."""

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan.checkpoint.dcp import Checkpointer, TrainState
from titan.config.dtypes import to_dtype
from titan.config.job import JobConfig
from titan.config.load import to_toml
from titan.data.loader import build_dataloader
from titan.data.tokenizer import build_tokenizer
from titan.metrics.log import current_rank, logger
from titan.metrics.profiling import build_memory_snapshotter, maybe_profile
from titan.metrics.sinks import build_sinks
from titan.metrics.throughput import ThroughputMeter
from titan.models.llama.args import build_model_args, padded_vocab_size
from titan.models.llama.flops import flops_per_token, num_params
from titan.models.llama.init import init_weights
from titan.models.llama.loss import cross_entropy_loss
from titan.models.llama.model import Transformer
from titan.parallel.dims import (
    build_device,
    build_mesh,
    data_parallel_rank,
    init_distributed,
    resolve_dims,
    set_collective_timeout,
)
from titan.parallel.init import apply_full_init, needs_full_init
from titan.parallel.llama import parallelize_llama
from titan.parallel.tp import build_vocab_sharded_loss
from titan.quant.convert import apply_converters
from titan.quant.float8.fsdp import apply_float8_all_gather, precompute_float8_scales
from titan.train.lr import build_lr_scheduler
from titan.train.nan_guard import check_finite, stop_hints
from titan.train.optim import build_optimizer


def set_seed(seed: int, deterministic: bool) -> None:
    """Same seed, same weights and same losses on CPU; deterministic also pins GPU kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


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
        init_distributed(cfg.comm, self.device, world_size)
        self.mesh = build_mesh(self.dims, self.device)
        set_collective_timeout(self.mesh, cfg.comm.init_timeout_seconds)
        self.dump_folder = Path(cfg.job.dump_folder)
        set_seed(cfg.training.seed, cfg.training.deterministic)

        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_args = build_model_args(cfg.model.flavor, self.tokenizer.vocab_size,
                                           cfg.model.vocab_size_multiple_of, cfg.training.seq_len)
        with torch.device("meta"):
            self.model = Transformer(self.model_args)
        self.log_model_size()
        apply_converters(self.model, cfg.model.converters, cfg.float8, cfg.mx, self.dims.tp,
                         cfg.model.print_after_conversion)
        if self.float8_all_gather_enabled:
            apply_float8_all_gather(self.model)
        parallelize_llama(self.model, self.dims, self.mesh, cfg.parallelism, cfg.activation_checkpoint, cfg.training,
                          cfg.compile)
        self.init_model_weights()
        self.model.train()

        self.loss_fn = self.build_loss_fn()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        dp_rank, dp_degree = data_parallel_rank(self.mesh)
        self.dataloader = build_dataloader(self.tokenizer, cfg.training, dp_rank, dp_degree)
        self.grad_accumulation_steps = self.count_accumulation_steps()
        self.checkpointer = Checkpointer(cfg.checkpoint, self.dump_folder, self.model, self.optimizer,
                                         self.lr_scheduler, self.dataloader, self.device, dp_rank, dp_degree)
        resumed = self.checkpointer.load() if not cfg.checkpoint.create_seed_checkpoint else TrainState()

        self.flops_per_token = flops_per_token(self.model_args, num_params(self.model, exclude_embedding=True),
                                               cfg.training.seq_len)
        self.meter = ThroughputMeter(self.flops_per_token, self.device, cfg.training.steps)
        self.sinks = build_sinks(cfg.metrics, self.dump_folder, self.rank)
        self.hints = stop_hints(cfg.model.converters, cfg.training.compile, cfg.training.max_norm)
        self.step = resumed.step
        self.tokens_seen = resumed.tokens_seen
        self.last_finite_loss: float | None = None
        self.current_lr = cfg.optimizer.lr

    def init_model_weights(self) -> None:
        """Materialise the (possibly sharded) model on the device and initialise it from the seed."""
        self.materialize(self.model)
        if needs_full_init(self.model, self.device):
            apply_full_init(self.model, self.build_full_model)

    def materialize(self, model: Transformer) -> None:
        """Allocate a meta-built model on the device and fill it with init_weights."""
        model.to_empty(device=self.device)
        with torch.no_grad():
            init_weights(model, buffer_device=self.device)

    def build_full_model(self) -> Transformer:
        """An unsharded copy initialised exactly as a single process would initialise it."""
        torch.manual_seed(self.cfg.training.seed)
        with torch.device("meta"):
            full = Transformer(self.model_args)
        self.materialize(full)
        return full

    def build_loss_fn(self) -> Callable[..., torch.Tensor]:
        """Cross entropy over the real vocab: on vocab-sharded logits under loss parallel, else on plain ones."""
        if self.loss_parallel_enabled:
            padded_vocab = padded_vocab_size(self.model_args.vocab_size, self.model_args.vocab_size_multiple_of)
            return build_vocab_sharded_loss(self.model_args.vocab_size, padded_vocab, self.mesh["tp"])
        return torch.compile(cross_entropy_loss) if self.cfg.training.compile else cross_entropy_loss

    @property
    def float8_all_gather_enabled(self) -> bool:
        """FSDP all-gathers float8 weights only where there is FSDP and a float8 converter."""
        return ("float8" in self.cfg.model.converters and self.cfg.float8.enable_fsdp_float8_all_gather
                and self.dims.dp_enabled)

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel

    def count_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: global batch / (local batch x data-parallel degree)."""
        t = self.cfg.training
        if t.global_batch_size == -1:
            return 1
        steps = t.global_batch_size // (t.local_batch_size * self.dims.dp_degree)
        logger.info(f"Global batch {t.global_batch_size}: {steps} gradient accumulation steps of "
                    f"{t.local_batch_size} sequences on each of {self.dims.dp_degree} data-parallel ranks")
        return steps

    def log_model_size(self) -> None:
        args = self.model_args
        logger.info(f"Model llama3 {self.cfg.model.flavor}: {num_params(self.model, exclude_embedding=False):,} "
                    f"parameters, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads "
                    f"({args.n_kv_heads} kv), vocab {args.vocab_size} (padded to "
                    f"{self.model.tok_embeddings.num_embeddings})")

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision without FSDP: matmuls in --training.mixed_precision_param (FSDP casts parameters
        itself, following the same field)."""
        dtype = to_dtype(self.cfg.training.mixed_precision_param)
        if dtype == torch.float32 or self.dims.dp_enabled:
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
            # Loss parallel needs its context around the loss and its backward.
            with self.loss_context():
                with self.autocast():
                    logits = self.model(inputs)
                loss = self.loss_fn(logits, labels, self.model_args.vocab_size) / self.grad_accumulation_steps
                loss.backward()
            # Under loss parallel the loss is a replicated DTensor; the sum stays a plain tensor.
            loss_sum += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        grad_norm = self.clip_gradients()
        loss_value, norm_value = self.global_mean(loss_sum).item(), grad_norm.item()
        check_finite(self.step, loss_value, norm_value, self.last_finite_loss, self.model, self.hints)
        self.current_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.float8_all_gather_enabled and self.cfg.float8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(self.model)
        self.lr_scheduler.step()
        self.last_finite_loss = loss_value
        tokens = self.cfg.training.local_batch_size * self.cfg.training.seq_len * self.grad_accumulation_steps
        self.meter.add_step(tokens, data_wait)
        return loss_value, norm_value

    def loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel_enabled else contextlib.nullcontext()

    def global_mean(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The loss over the whole global batch: the mean of the data-parallel ranks' losses (TP ranks of one
        group already agree). Every rank then sees the same value, so all stop together on a non-finite one."""
        if self.mesh is None or not self.dims.dp_enabled:
            return local_loss
        return funcol.all_reduce(local_loss, reduceOp="avg", group=self.mesh["dp"])

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient norm over every shard on every mesh, clipping to --training.max_norm when positive."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(total_norm, DTensor):
            # Per-shard norms come back as a partial DTensor; full_tensor() reduces them to the global norm.
            total_norm = total_norm.full_tensor()
        if self.cfg.training.max_norm > 0:
            # Not foreach: torch 2.11's in-place foreach ops leave Partial DTensors unchanged (in-place ops on Partial
            # DTensors: pytorch/pytorch#163374), and under TP the sequence-parallel norms' gradients are Partial, so
            # they went unclipped. torch 2.13 scales them either way.
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.training.max_norm, total_norm, foreach=False)
        return total_norm

    def should_log(self) -> bool:
        return self.step == 1 or self.step % self.cfg.metrics.log_freq == 0 or self.step == self.cfg.training.steps

    def train_state(self) -> TrainState:
        return TrainState(step=self.step, tokens_seen=self.tokens_seen, dp_degree=self.dims.dp_degree,
                          world_size=self.dims.world_size)

    def run(self) -> None:
        """Train from the resumed step to --training.steps, logging every --metrics.log_freq and saving every
        --checkpoint.interval (and at the last step)."""
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
        global_tokens_per_step = (self.cfg.training.local_batch_size * self.cfg.training.seq_len
                                  * self.grad_accumulation_steps * self.dims.dp_degree)
        with maybe_profile(self.cfg.profiling, self.dump_folder, self.rank) as profiler:
            try:
                while self.step < total:
                    self.step += 1
                    loss, grad_norm = self.train_step(data_iterator)
                    self.tokens_seen += global_tokens_per_step
                    if self.step == 1:
                        set_collective_timeout(self.mesh, self.cfg.comm.train_timeout_seconds)
                    if self.should_log():
                        self.log_metrics(loss, grad_norm, self.step - last_logged)
                        last_logged = self.step
                    if profiler is not None:
                        profiler.step()
                    if snapshotter is not None:
                        snapshotter.step(self.step)
                    self.checkpointer.poll()
                    if self.checkpointer.should_save(self.step, total):
                        self.checkpointer.save(self.train_state(), last_step=total)
            finally:
                self.checkpointer.close()
                for sink in self.sinks:
                    sink.close()
        logger.info(f"Training finished after {self.step} steps.")

    def log_metrics(self, loss: float, grad_norm: float, steps_in_window: int) -> None:
        record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self.current_lr}
        record.update(self.meter.window(self.step, steps_in_window))
        for sink in self.sinks:
            sink.write(record)
