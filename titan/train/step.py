"""The training step: forward and backward over a step's micro-batches, the global gradient norm with clipping, and
the optimizer and LR-schedule step, on what the build (titan/train/build.py) made: this rank's model parts, the
loss, the optimizer. The trainer (titan/train/trainer.py) says when it runs; the dry run runs the same step on fake
tensors."""

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from titan.config.dtypes import to_dtype
from titan.config.job import Training
from titan.data.micro_batch import MicroBatch, to_micro_batch
from titan.metrics.throughput import Mark, mark_now, seconds_between
from titan.models.common.family import ModelFamily
from titan.models.common.loss import num_valid_targets
from titan.parallel.cp import shard_batch
from titan.parallel.dims import Meshes, ParallelDims
from titan.parallel.pp import Pipeline
from titan.parallel.reductions import clip_grad_norm_, full_value, loss_sum
from titan.parallel.shards import local_shard
from titan.parallel.tp import loss_parallel_context
from titan.quant.convert import Conversion
from titan.train.expert_balance import NO_EXPERT_METRICS, ExpertBalancer
from titan.train.readback import Readback


@dataclass(frozen=True)
class ModelParts:
    """This rank's model after the build, and the facts about the whole model that metrics and checkpoints need."""

    family: ModelFamily
    args: object
    """The family's shape (its DecoderArgs)."""
    parts: list[nn.Module]
    """The modules this rank runs: its pipeline stages in order, or the whole model as one part."""
    model: nn.Module
    """This rank's whole share by FQN (every part's parameters): what the optimizer, checkpoints and grad norm see."""
    pipeline: Pipeline | None
    """The schedule over the parts, under pipeline parallel."""
    conversion: Conversion
    fqns: frozenset[str]
    """The whole model's state-dict keys (parameters and persistent buffers), on every rank."""
    num_params: int
    """Parameters of the whole model."""
    num_active_params: int
    """Parameters one token uses (fewer than num_params in a mixture of experts): what its FLOPs count."""
    flops_per_token: int


@dataclass
class TrainingStep:
    """One rank's model, loss and optimizer, and one training step over them: forward and backward over the
    accumulation micro-batches, the global gradient norm with clipping, and the optimizer and LR-schedule step."""

    train_cfg: Training
    dims: ParallelDims
    meshes: Meshes | None
    device: torch.device
    model_parts: ModelParts
    block_causal: bool
    """Attention stays within each document (the loader marks where documents end); off: causal over the sequence."""
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_accumulation_steps: int
    loss_parallel: bool
    """The loss takes vocab-sharded logits (TP without --parallelism.disable_loss_parallel)."""
    balancer: ExpertBalancer | None = None
    """A mixture of experts' token counts and routing biases, read after every optimizer step."""
    loss_scale: Tensor | None = None
    """What the last compute_gradients multiplied each micro-batch's summed loss by."""
    last_mtp_loss: Readback | None = None
    """The last updated step's multi-token prediction loss on its way to the host; None without MTP modules."""
    update_marks: tuple[Mark, Mark] | None = None
    """Marks before and after the last optimizer step on the device (last_update_seconds)."""

    @property
    def model(self) -> nn.Module:
        return self.model_parts.model

    @property
    def global_tokens_per_step(self) -> int:
        t = self.train_cfg
        return t.local_batch_size * t.seq_len * self.grad_accumulation_steps * self.dims.dp_degree

    def compute_gradients(self, micro_batches: list[MicroBatch]) -> tuple[Tensor, Tensor]:
        """Forward and backward over the step's accumulation micro-batches, then clip: (the sum of this rank's scaled
        micro-batch losses, the global gradient norm before clipping), both on the device. Every micro-batch's
        summed loss is divided by the valid targets of the whole step (all accumulation steps and data-parallel
        ranks), counted before the first forward, so each target weighs the same wherever it is."""
        self.optimizer.zero_grad()
        scale = self.num_loss_shares / self.global_valid_targets(micro_batches)
        self.loss_scale = scale
        loss_sum_local = torch.zeros((), device=self.device)
        for micro_batch in micro_batches:
            loss_sum_local += self.run_micro_batch(micro_batch, scale, backward=True)
        pp_mesh = self.meshes.pp if self.dims.pp_enabled else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.train_cfg.max_norm, pp_mesh)
        # Under --training.enable_cpu_offload the gradients, and so their norm, are in host memory.
        return loss_sum_local, grad_norm.to(self.device)

    def micro_batch(self, inputs: Tensor, labels: Tensor, document_ends: Tensor) -> MicroBatch:
        """A (bs, seq) batch of the loader as this rank's model reads it: document layout and masked targets under
        block-causal attention, then this rank's context-parallel shard."""
        whole = to_micro_batch(inputs, labels, document_ends, self.block_causal)
        cp_mesh = self.meshes.cp if self.dims.cp_enabled else None
        return MicroBatch(*shard_batch(cp_mesh, whole.inputs, whole.labels, whole.positions, whole.document_ids))

    def global_valid_targets(self, micro_batches: list[MicroBatch]) -> Tensor:
        """The valid targets of these micro-batches over every rank that holds loss shares (at least 1, so that a
        step without targets has loss 0), as a float tensor on every rank: one small all-reduce, no host read."""
        local = torch.zeros((), device=self.device)  # made on the device: a host number would be a blocking copy
        if self.model_parts.pipeline is None or self.model_parts.pipeline.holds_last_stage:
            for micro_batch in micro_batches:
                local += num_valid_targets(micro_batch.labels)
        return self.global_sum(local).clamp(min=1)

    def run_micro_batch(self, micro_batch: MicroBatch, scale: Tensor, backward: bool) -> Tensor:
        """One micro-batch through the model, or its pipeline under pipeline parallel: forward, and with `backward`
        the backward of the loss sum times `scale`. Returns that loss, detached (the sum over the pipeline's
        micro-batches under pipeline parallel, zero on ranks without the last stage)."""
        with loss_parallel_context(self.loss_parallel):
            if self.model_parts.pipeline is not None:
                run = self.model_parts.pipeline.step if backward else self.model_parts.pipeline.eval
                with self.autocast():
                    return run(micro_batch, scale)
            with self.autocast():
                loss = self.model(micro_batch.inputs, labels=micro_batch.labels, **micro_batch.model_inputs()) * scale
            if backward:
                loss.backward()
        return full_value(loss.detach())

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision without FSDP: matmuls in --training.mixed_precision_param (FSDP casts parameters
        itself, following the same field)."""
        dtype = to_dtype(self.train_cfg.mixed_precision_param)
        if dtype == torch.float32 or self.dims.dp_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def global_mean(self, local_loss: Tensor) -> Tensor:
        """The step's loss, the mean per valid target over the global batch, from this rank's scaled loss
        (compute_gradients: its summed loss times num_loss_shares over the step's valid targets, zero on ranks
        without the last pipeline stage). Every rank then sees the same value, so all stop together on a
        non-finite one."""
        return self.global_sum(local_loss) / self.num_loss_shares

    def global_sum(self, local_loss: Tensor) -> Tensor:
        """`local_loss` added up over the ranks that hold loss shares, on every rank."""
        return loss_sum(local_loss, self.meshes.loss if self.meshes is not None else None)

    @property
    def num_loss_shares(self) -> int:
        """Ranks whose losses make up the global mean, data x context parallel: their gradients are averaged
        (FSDP), so each scales its summed loss by this many over the step's valid targets."""
        return self.dims.dp_degree * self.dims.cp

    @functools.cached_property
    def update_device(self) -> torch.device:
        """Where the optimizer updates the parameters (the host under CPU offload)."""
        param = next(self.model.parameters())
        return local_shard(param).device

    @property
    def skips_on_device(self) -> bool:
        """Whether the optimizer can skip an update on a device-side flag: fused Adam's kernels return early when
        their `found_inf` is set (GradScaler's path), leaving weights, moments and step counts as they were, and
        BF16StateAdam scales its update by it."""
        return bool(self.optimizer.defaults.get("fused")) or getattr(self.optimizer, "skips_on_found_inf", False)

    def apply_update(self, skip: Tensor | None) -> None:
        """The optimizer step of the gradients just computed, unless `skip` (a 0-dim bool on the device; None:
        never) is set, and what converted layers need after it. The LR schedule is the caller's: it steps once the
        host knows the update applied."""
        start = mark_now(self.device)
        if skip is None:
            self.optimizer.step()
        elif self.skips_on_device:
            # the update's device: the host under --training.enable_cpu_offload, which waits for the flag there
            self.optimizer.found_inf = skip.float().to(self.update_device)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # Adam reads the attribute at every step() while it is set
        elif not skip.item():  # foreach and for-loop Adam have no found_inf: the host waits for the flag
            self.optimizer.step()
        self.update_marks = (start, mark_now(self.device))
        self.model_parts.conversion.after_optimizer_step(self.model)
        if self.balancer is not None:
            self.balancer.after_optimizer_step(skip)
        if self.model.mtp is not None:
            self.queue_mtp_loss()

    def queue_mtp_loss(self) -> None:
        """Queue the copy of the step's multi-token prediction loss to the host, the mean per valid target over the
        global batch as the step's loss is, and restart the modules' sum for the next step."""
        mtp = self.model.mtp
        self.last_mtp_loss = Readback(self.global_mean(mtp.loss_sum * self.loss_scale).reshape(1))
        mtp.loss_sum.zero_()

    def update_and_read_back(self, loss: Tensor, grad_norm: Tensor, skip: Tensor) -> Readback:
        """Queue the update (skipped on the device where `skip` is set) and the copy of the step's loss, gradient
        norm and skip flag to the host, which reads them a step later without waiting for the device."""
        self.apply_update(skip)
        return Readback(torch.stack([loss, grad_norm.float(), skip.float()]))

    def last_update_seconds(self) -> float:
        """How long the last optimizer step took on this rank's device (done once its loss has been read: the copy
        is queued behind it). No collective runs in it, so unlike a whole step's time it is this rank's own speed."""
        return seconds_between(*self.update_marks)

    def model_metrics(self) -> dict[str, object]:
        """What the model reports about the last step beyond the loss (a mixture of experts' load, the multi-token
        prediction loss), for the metrics record; None values where the model has neither. Reads the device."""
        metrics = self.balancer.load_metrics() if self.balancer is not None else dict(NO_EXPERT_METRICS)
        metrics["mtp_loss"] = self.last_mtp_loss.values()[0] if self.last_mtp_loss is not None else None
        return metrics

    def evaluation_loss(self, inputs: Tensor, labels: Tensor, document_ends: Tensor) -> tuple[Tensor, Tensor]:
        """One validation batch, forward only: (this rank's summed loss, its valid targets), both zero on ranks
        without the last pipeline stage."""
        micro_batch = self.micro_batch(inputs, labels, document_ends)
        loss_sum = self.run_micro_batch(micro_batch, torch.ones((), device=self.device), backward=False)
        if self.model_parts.pipeline is not None and not self.model_parts.pipeline.holds_last_stage:
            return loss_sum, torch.zeros((), device=self.device)
        return loss_sum, num_valid_targets(micro_batch.labels).float()


