"""The training loop. __init__ reads as the pipeline; run() is the loop; train_step() is one step."""

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor.parallel import loss_parallel

from titan.checkpoint.dcp import Checkpointer, TrainState
from titan.config.dtypes import to_dtype
from titan.config.job import JobConfig
from titan.config.load import to_toml
from titan.data.loader import build_dataloader, build_validation_batches
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
from titan.parallel.ac import keeps_attention
from titan.parallel.cp import context_parallel_attention, describe_cp_path, shard_sequence
from titan.parallel.dims import (
    build_device,
    build_meshes,
    data_parallel_rank,
    init_distributed,
    resolve_dims,
    set_collective_timeout,
)
from titan.parallel.init import apply_full_init, needs_full_init
from titan.parallel.llama import parallelize_llama
from titan.parallel.pp import build_schedule, log_schedule, merge_stage_models, split_model
from titan.parallel.stages import StagePlan, plan_stages, requested_num_stages
from titan.parallel.tp import build_vocab_sharded_loss
from titan.quant.convert import apply_converters
from titan.quant.float8.fsdp import apply_float8_all_gather, precompute_float8_scales
from titan.train.evaluate import EvalResult, evaluate
from titan.train.lr import build_lr_scheduler
from titan.train.anomalies import Anomaly, AnomalyGuard
from titan.train.nan_guard import stop_hints
from titan.train.optim import build_optimizer
from titan.train.preemption import Stopper


def set_seed(seed: int, deterministic: bool) -> None:
    """Same seed, same weights and same losses on CPU; deterministic also pins GPU kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def as_local(loss: torch.Tensor) -> torch.Tensor:
    """Under loss parallel the loss is a replicated DTensor; sums of losses stay plain tensors."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


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
        self.stopper = Stopper(cfg.job, cfg.comm, cfg.checkpoint, cfg.training.steps, Path(cfg.job.dump_folder),
                               self.device, world_size)
        init_distributed(cfg.comm, self.device, world_size)
        self.meshes = build_meshes(self.dims, self.device)
        set_collective_timeout(self.meshes, cfg.comm.init_timeout_seconds)
        self.dump_folder = Path(cfg.job.dump_folder)
        set_seed(cfg.training.seed, cfg.training.deterministic)

        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_fqns = self.build_model(self.tokenizer.vocab_size)
        self.init_model_weights()
        self.build_optimization()
        dp_rank, dp_degree = data_parallel_rank(self.meshes)
        self.dataloader = build_dataloader(self.tokenizer, cfg.training, dp_rank, dp_degree)
        self.validation_batches = (build_validation_batches(self.tokenizer, cfg.validation, cfg.training, dp_rank,
                                                            dp_degree) if cfg.validation.enable else None)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.dump_folder, self.model, self.optimizer,
                                         self.lr_scheduler, self.dataloader, self.device, dp_degree, self.model_fqns,
                                         self.tokenizer)
        resumed = self.checkpointer.load() if not cfg.checkpoint.create_seed_checkpoint else TrainState()

        self.meter = ThroughputMeter(self.flops_per_token, self.device, cfg.training.steps)
        self.sinks = build_sinks(cfg.metrics, self.dump_folder, self.rank)
        self.anomalies = AnomalyGuard(cfg.training, self.dump_folder, self.rank, self.model,
                                      stop_hints(cfg.model.converters, cfg.training.compile, cfg.training.max_norm),
                                      resumed.spike_losses, resumed.num_skipped)
        self.step = resumed.step
        self.tokens_seen = resumed.tokens_seen
        self.current_lr = cfg.optimizer.lr

    def build_model(self, vocab_size: int) -> set[str]:
        """Build the model on meta, convert it, split it into this rank's pipeline stages and parallelize each
        (self.model_parts, not yet materialised). Returns the full model's parameter FQNs."""
        cfg = self.cfg
        self.model_args = build_model_args(cfg.model.flavor, vocab_size, cfg.model.vocab_size_multiple_of,
                                           cfg.training.seq_len)
        with torch.device("meta"):
            model = Transformer(self.model_args)
        self.total_params = num_params(model, exclude_embedding=False)
        self.log_model_size(model)
        model_fqns = {fqn for fqn, _ in model.named_parameters()}
        self.flops_per_token = flops_per_token(self.model_args, num_params(model, exclude_embedding=True),
                                               cfg.training.seq_len)
        apply_converters(model, cfg.model.converters, cfg.float8, cfg.mx, self.dims.tp,
                         cfg.model.print_after_conversion)
        if self.float8_all_gather_enabled:
            apply_float8_all_gather(model)
        self.stage_plan = self.plan_pipeline() if self.dims.pp_enabled else None
        self.model_parts, self.stage_ids = self.split_pipeline(model)
        for part in self.model_parts:
            parallelize_llama(part, self.dims, self.meshes, cfg.parallelism, cfg.activation_checkpoint, cfg.training,
                              cfg.compile, keep_attention=self.keeps_attention())
        return model_fqns

    def keeps_attention(self) -> bool:
        """Whether checkpointed blocks keep attention outputs on this run's device."""
        return keeps_attention(self.cfg.activation_checkpoint.save_attention, self.cfg.training.compile,
                               on_gpu=self.device.type == "cuda")

    def build_optimization(self) -> None:
        """What a step needs besides the materialised model parts: the rank's whole share of the model, the loss,
        the pipeline schedule, the optimizer and the LR schedule."""
        cfg = self.cfg
        # This rank's whole share of the model by FQN: what the optimizer, checkpoints and grad norm see.
        self.model = merge_stage_models(self.model_parts) if self.dims.pp_enabled else self.model_parts[0]
        self.model.train()
        if self.dims.cp_enabled:
            self.shard_rotary_tables()
        self.grad_accumulation_steps = self.count_accumulation_steps()
        self.loss_fn = self.build_loss_fn()
        self.schedule = self.build_pipeline_schedule() if self.dims.pp_enabled else None
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)

    def plan_pipeline(self) -> StagePlan:
        """The blocks of every pipeline stage, reported once with the schedule."""
        par = self.cfg.parallelism
        num_stages = requested_num_stages(self.model_args.n_layers, self.dims.pp, par.pipeline_parallel_schedule,
                                          par.pipeline_parallel_layers_per_stage, par.pipeline_parallel_split_points)
        plan = plan_stages(self.model_args.n_layers, num_stages, par.pipeline_parallel_split_points, self.dims.pp,
                           par.pipeline_parallel_schedule)
        log_schedule(plan, par.pipeline_parallel_schedule, self.dims.pp, self.num_microbatches,
                     par.pipeline_parallel_microbatch_size)
        return plan

    def split_pipeline(self, model: Transformer) -> tuple[list[torch.nn.Module], tuple[int, ...]]:
        """This rank's pipeline stages and their ids; the whole model as stage 0 without pipeline parallel."""
        if self.stage_plan is None:
            return [model], (0,)
        return split_model(model, self.stage_plan, self.meshes.pp, self.cfg.parallelism.pipeline_parallel_schedule)

    @property
    def num_microbatches(self) -> int:
        """Pipeline micro-batches per local batch."""
        return self.cfg.training.local_batch_size // self.cfg.parallelism.pipeline_parallel_microbatch_size

    def init_model_weights(self) -> None:
        """Materialise the (possibly sharded or pipelined) model on the device and initialise it from the seed."""
        if needs_full_init(self.model_parts[0], self.device, self.dims.pp_enabled):
            full = self.build_full_model()
            for part in self.model_parts:
                part.to_empty(device=self.device)
                apply_full_init(part, full)
        else:
            for part in self.model_parts:
                self.materialize(part)

    def shard_rotary_tables(self) -> None:
        """Keep the rotary rows of this rank's context-parallel chunks, the positions of its tokens (the table has
        --training.seq_len rows)."""
        cp_mesh = self.meshes.cp
        for part in self.model_parts:
            part.rope_cache = shard_sequence(part.rope_cache, 0, cp_mesh.get_local_rank(), cp_mesh.size())
        path = describe_cp_path(self.device.type, self.cfg.parallelism.context_parallel_rotate_method)
        logger.info(f"Context parallel over {self.dims.cp} ranks: each holds 2 of {2 * self.dims.cp} chunks of every "
                    f"sequence. {path}")

    def build_pipeline_schedule(self, example_io: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                                ) -> _PipelineSchedule:
        """The pipelining schedule, whose last stage computes the loss of each micro-batch. The loss is divided by
        the micro-batches and accumulation steps, so gradients add up to those of the step's mean loss.
        example_io: as build_schedule takes it."""
        parts_per_step = self.grad_accumulation_steps * self.num_microbatches

        def microbatch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(logits, labels, self.model_args.vocab_size) / parts_per_step

        return build_schedule(self.model_parts, self.stage_ids, self.stage_plan.num_stages,
                              self.cfg.parallelism.pipeline_parallel_schedule, self.num_microbatches,
                              microbatch_loss, self.meshes.pp, self.device, example_io)

    def materialize(self, model: torch.nn.Module) -> None:
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
            return build_vocab_sharded_loss(self.model_args.vocab_size, padded_vocab, self.meshes.tp)
        if self.cfg.training.compile:
            return torch.compile(cross_entropy_loss)  # keeps no fp32 logits compiled: see --training.loss_chunk_size
        return functools.partial(cross_entropy_loss, chunk_size=self.cfg.training.loss_chunk_size)

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

    def log_model_size(self, model: Transformer) -> None:
        args = self.model_args
        logger.info(f"Model llama3 {self.cfg.model.flavor}: {self.total_params:,} "
                    f"parameters, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads "
                    f"({args.n_kv_heads} kv), vocab {args.vocab_size} (padded to "
                    f"{model.tok_embeddings.num_embeddings})")

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

    def train_step(self, data_iterator) -> tuple[float, float, Anomaly | None]:
        """Forward and backward over the accumulation micro-batches, clip, judge the step (titan/train/anomalies.py)
        and step unless it is skipped. Returns (loss, grad_norm, the step's anomaly or None)."""
        self.optimizer.zero_grad()
        data_position = self.dataloader.dataset.position()
        waits: list[float] = []

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                inputs, labels, waited = self.next_batch(data_iterator)
                waits.append(waited)
                yield inputs, labels

        loss_sum, grad_norm = self.compute_gradients(batches())
        data_wait = sum(waits)
        # One device-to-host read per step for both values: each .item() would stall a GPU's launch queue.
        loss_value, norm_value = torch.stack([self.global_mean(loss_sum), grad_norm.float()]).tolist()
        self.current_lr = self.optimizer.param_groups[0]["lr"]
        anomaly = self.anomalies.inspect(self.step, loss_value, norm_value, data_position)
        if anomaly is None or anomaly.applied:
            self.apply_update()
        else:
            # No optimizer or LR-schedule step; nothing after this step (a save, a probe) sees the dropped gradients.
            self.optimizer.zero_grad()
        self.meter.add_step(self.global_tokens_per_step / self.dims.world_size, data_wait)
        return loss_value, norm_value, anomaly

    def compute_gradients(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """Forward and backward over the step's accumulation micro-batches from `batches`, then clip: (the sum of
        this rank's micro-batch losses, the global gradient norm before clipping)."""
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in itertools.islice(batches, self.grad_accumulation_steps):
            if self.dims.cp_enabled:
                inputs, labels = self.context_parallel_shard(inputs), self.context_parallel_shard(labels)
            with self.step_context():
                if self.schedule is not None:
                    loss_sum += self.pipeline_forward_backward(inputs, labels)
                else:
                    loss_sum += self.forward_backward(inputs, labels)
        return loss_sum, self.clip_gradients()

    def apply_update(self) -> None:
        """The optimizer and LR-schedule step of the gradients just computed."""
        self.optimizer.step()
        if self.float8_all_gather_enabled and self.cfg.float8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(self.model)
        self.lr_scheduler.step()

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
        anomaly.batches_skipped = (anomaly.step - restored.step) * self.grad_accumulation_steps
        self.step, self.tokens_seen = restored.step, restored.tokens_seen
        self.anomalies.restore_window(restored.spike_losses)
        return True

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch through the whole model: its loss (divided by the accumulation steps), detached."""
        with self.autocast():
            logits = self.model(inputs)
        loss = self.loss_fn(logits, labels, self.model_args.vocab_size) / self.grad_accumulation_steps
        loss.backward()
        return as_local(loss.detach())

    def pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One local batch through the pipeline schedule, forward and backward: the sum of its micro-batch losses."""
        return self.run_pipeline(self.schedule.step, inputs, labels)

    def run_pipeline(self, run: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Run the schedule's `step` or `eval` on one local batch. The first stage takes the inputs, the last the
        labels and returns the micro-batch losses; ranks without the last stage contribute zero to the global mean."""
        losses: list[torch.Tensor] = []
        holds_first, holds_last = 0 in self.stage_ids, self.stage_plan.num_stages - 1 in self.stage_ids
        args = (inputs,) if holds_first else ()
        with self.autocast():
            run(*args, target=labels if holds_last else None, losses=losses)
        if not holds_last:
            return torch.zeros((), device=self.device)
        return sum(as_local(loss.detach()) for loss in losses)

    def evaluation_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One validation batch's mean token loss, forward only (zero on ranks without the last pipeline stage)."""
        if self.dims.cp_enabled:
            inputs, labels = self.context_parallel_shard(inputs), self.context_parallel_shard(labels)
        with self.step_context():
            if self.schedule is not None:
                # The schedule divides each micro-batch loss by micro-batches x accumulation steps
                # (build_pipeline_schedule), so the micro-batch losses add up to the batch mean over accumulation.
                return self.run_pipeline(self.schedule.eval, inputs, labels) * self.grad_accumulation_steps
            with self.autocast():
                logits = self.model(inputs)
            return as_local(self.loss_fn(logits, labels, self.model_args.vocab_size))

    def run_validation(self) -> EvalResult:
        """The loss over the validation set, in eval mode, without gradients."""
        for part in self.model_parts:
            part.eval()
        batches = self.validation_batches
        tokens_per_batch = batches.local_batch_size * batches.seq_len * self.dims.dp_degree
        result = evaluate(batches, self.evaluation_loss, self.loss_sum, self.dims.dp_degree * self.dims.cp,
                          tokens_per_batch, self.device, compiled=self.cfg.training.compile)
        for part in self.model_parts:
            part.train()
        return result

    def validate(self) -> None:
        """Evaluate and log val_loss at this step; the time is left out of the throughput window."""
        result = self.run_validation()
        self.meter.exclude(result.seconds)
        for sink in self.sinks:
            sink.write(result.record(self.step))

    def should_validate(self) -> bool:
        v = self.cfg.validation
        return v.enable and (self.step % v.freq == 0 or self.step == self.cfg.training.steps)

    def context_parallel_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's two load-balanced chunks of each sequence of a (bs, seq) batch."""
        return shard_sequence(tensor, 1, self.meshes.cp.get_local_rank(), self.dims.cp)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Loss parallel around the loss and its backward; context-parallel attention around forward and backward."""
        stack = contextlib.ExitStack()
        if self.loss_parallel_enabled:
            stack.enter_context(loss_parallel())
        if self.dims.cp_enabled:
            stack.enter_context(context_parallel_attention(self.meshes.cp,
                                                           self.cfg.parallelism.context_parallel_rotate_method))
        return stack

    @property
    def global_tokens_per_step(self) -> int:
        t = self.cfg.training
        return t.local_batch_size * t.seq_len * self.grad_accumulation_steps * self.dims.dp_degree

    def global_mean(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The loss over the whole global batch: the mean over data-parallel and context-parallel ranks of their
        losses, which only the last pipeline stage has (the others add zero; TP ranks of one group agree). Every
        rank then sees the same value, so all stop together on a non-finite one."""
        return self.loss_sum(local_loss) / (self.dims.dp_degree * self.dims.cp)

    def loss_sum(self, local_loss: torch.Tensor) -> torch.Tensor:
        """`local_loss` added up over the pipeline, data-parallel and context-parallel ranks, on every rank."""
        if self.meshes is None or self.meshes.loss.size() == 1:
            return local_loss
        return funcol.all_reduce(local_loss, reduceOp="sum", group=self.meshes.loss)

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient norm over every shard on every mesh and every pipeline stage, clipping to
        --training.max_norm when positive."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(total_norm, DTensor):
            # Per-shard norms come back as a partial DTensor; full_tensor() reduces them to the global norm.
            total_norm = total_norm.full_tensor()
        if self.dims.pp_enabled:
            # Each stage holds different parameters: the squared norms add up across the pipeline.
            total_norm = funcol.all_reduce(total_norm**2, reduceOp="sum", group=self.meshes.pp) ** 0.5
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
                          world_size=self.dims.world_size, spike_losses=self.anomalies.window,
                          num_skipped=self.anomalies.num_skipped)

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
                self.stopper.watching(self.meshes):
            try:
                while self.step < total:
                    self.step += 1
                    self.stopper.start_step(self.step)
                    loss, grad_norm, anomaly = self.train_step(data_iterator)
                    self.tokens_seen += self.global_tokens_per_step
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
                self.checkpointer.close()
                for sink in self.sinks:
                    sink.close()
        logger.info(f"Training finished after {self.step} steps.")

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

    def log_metrics(self, loss: float, grad_norm: float, steps_in_window: int) -> None:
        record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self.current_lr}
        record.update(self.meter.window(self.step, steps_in_window))
        record.update(self.stopper.step_times)
        tokens_by_source = self.dataloader.dataset.tokens_per_source()
        record["tokens_by_source"] = tokens_by_source if len(tokens_by_source) > 1 else None
        for sink in self.sinks:
            sink.write(record)
