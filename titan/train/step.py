"""What a training step runs on, built in the pipeline's order, and the step itself.

build_training_step goes from the device mesh to the optimizer: model args, the loss, the model built on meta,
converters, pipeline stages, TP/EP/CP/AC/compile/FSDP (titan/parallel/parallelize.py, with the family's parallel plan),
weights, optimizer and LR schedule.
The trainer (titan/train/trainer.py) builds it and adds data, checkpoints and metrics around it; the dry run
(titan/estimate/simulate.py) builds the same on fake tensors. A stage added here is in both.
"""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.config.activation_checkpoint import keeps_attention
from titan.config.degrees import accumulation_steps
from titan.config.dtypes import to_dtype
from titan.config.errors import ConfigError
from titan.config.job import JobConfig, Training
from titan.metrics.log import logger
from titan.metrics.throughput import Mark, mark_now, seconds_between
from titan.models.common.attention import document_layout, sequence_positions
from titan.models.common.batch import MicroBatch
from titan.models.common.decoder import tie_output
from titan.models.common.family import BuildOptions, ModelFamily
from titan.models.common.flops import num_params
from titan.models.common.loss import mask_cross_document_targets, num_valid_targets
from titan.models.families import FAMILIES
from titan.parallel.cp import shard_batch
from titan.parallel.dims import Meshes, ParallelDims, build_meshes
from titan.parallel.fsdp import apply_to_empty
from titan.parallel.init import apply_full_init, full_copy_fits, needs_full_init
from titan.parallel.parallelize import parallelize_model
from titan.parallel.pp import Pipeline, StageShapes, build_pipeline
from titan.parallel.reductions import clip_grad_norm_, full_value, loss_sum
from titan.parallel.shards import local_shard
from titan.parallel.tp import loss_parallel_context
from titan.quant.convert import Conversion, apply_converters
from titan.train.expert_balance import NO_EXPERT_METRICS, ExpertBalancer, build_expert_balancer
from titan.train.lr import build_lr_scheduler
from titan.train.optim import build_optimizer
from titan.train.readback import Readback


def set_seed(seed: int, deterministic: bool) -> None:
    """Same seed, same weights and same losses on CPU; deterministic also pins GPU kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


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
        if not self.block_causal:
            positions, document_ids = sequence_positions(inputs), None
        else:
            positions, document_ids = document_layout(document_ends)
            labels = mask_cross_document_targets(labels, document_ends)
        cp_mesh = self.meshes.cp if self.dims.cp_enabled else None
        return MicroBatch(*shard_batch(cp_mesh, inputs, labels, positions, document_ids))

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


@dataclass(frozen=True)
class BuildMode:
    """How build_training_step builds: for training (the defaults), or as the dry run simulates a GPU rank
    (titan/estimate/simulate.py's mode). Each choice a simulation makes is a field here, and reaches the model and
    the optimizer as an argument: neither asks whether its tensors are fake."""

    fake_mode: FakeTensorMode | None = None
    """From the weights on, every tensor is a fake tensor of this mode: shapes, dtypes and devices, no values."""
    compile: bool = True
    """Honour --compile.enable. Off for fake tensors: torch.compile runs real kernels. Checkpointed blocks still keep
    attention as the requested compile setting would."""
    flex_as_causal_sdpa: bool = False
    """Run causal flash SDPA where the job asks for FlexAttention: a BlockMask is built from the batch's values."""
    init_weights: bool = True
    """Fill the weights; off: give them storage only (trunc_normal_ reads data, which fake tensors have none of)."""
    valueless: bool = False
    """Tensors carry no values: mixtures of experts spread their tokens evenly where the host reads counts
    (MoEArgs.valueless), and the bfloat16-state optimizer's update runs eagerly."""


def build_training_step(cfg: JobConfig, dims: ParallelDims, device: torch.device, vocab_size: int,
                        mode: BuildMode = BuildMode()) -> TrainingStep:
    """Everything a training step runs on, from the device mesh to the LR schedule, for a process that has joined
    its process group. `mode`: for training, or the dry run's simulation (BuildMode)."""
    meshes = build_meshes(dims, device)
    set_seed(cfg.training.seed, cfg.training.deterministic and mode.fake_mode is None)
    compile_cfg = cfg.compile if mode.compile else replace(cfg.compile, enable=False)
    attn_backend, block_causal = cfg.model.attn_backend, cfg.model.attn_mask_type == "block_causal"
    if mode.flex_as_causal_sdpa and attn_backend == "flex":
        # A FlexAttention block mask is built from the batch's values, which fake tensors have none of. Causal flash
        # SDPA stands in: the same memory (outputs and log-sum-exps) and the causal half of the attention work, which
        # bounds FlexAttention's block-causal work from above (it skips every masked block). Under context parallel
        # the model's kernel is replaced by the context-parallel attention, block-causal as on the GPU.
        attn_backend, block_causal = "sdpa", block_causal and dims.cp_enabled
        logger.info("Dry run: FlexAttention is simulated by causal flash attention (same memory; its causal half of "
                    "the attention FLOPs bounds block-causal work from above).")
    accumulation_steps = count_accumulation_steps(cfg.training, dims.dp_degree)
    family = FAMILIES[cfg.model.name]
    args = family.build_args(cfg.model.flavor, BuildOptions(
        vocab_size=vocab_size, vocab_size_multiple_of=cfg.model.vocab_size_multiple_of,
        max_seq_len=cfg.training.seq_len, attn_backend=attn_backend, loss_chunk_size=cfg.training.loss_chunk_size,
        moe_aux_loss_weight=cfg.moe.aux_loss_weight / forward_passes_per_step(cfg, accumulation_steps),
        moe_load_balance_coeff=cfg.moe.load_balance_coeff, mtp_loss_weight=cfg.training.mtp_loss_weight,
        valueless=mode.valueless))
    loss_parallel = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    keep_attention = keeps_attention(cfg.activation_checkpoint.save_attention, cfg.compile.enable,
                                     on_gpu=device.type == "cuda")
    parallelize = functools.partial(parallelize_model, plan=family.parallel_plan, dims=dims, meshes=meshes,
                                    par=cfg.parallelism, ac=cfg.activation_checkpoint, train=cfg.training,
                                    compile_cfg=compile_cfg, keep_attention=keep_attention, block_causal=block_causal)
    model_parts = build_model(cfg, dims, meshes, family, args, device, parallelize)
    with mode.fake_mode or contextlib.nullcontext():
        if mode.init_weights:
            init_model_weights(model_parts, device, cfg.training.seed, pipelined=dims.pp_enabled,
                               cpu_offload=cfg.training.enable_cpu_offload)
        else:
            for part in model_parts.parts:
                apply_to_empty(part, device, cfg.training.enable_cpu_offload)
        model_parts.model.train()
        optimizer = build_optimizer(model_parts.model, cfg.optimizer, compile_update=not mode.valueless)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    return TrainingStep(train_cfg=cfg.training, dims=dims, meshes=meshes, device=device, model_parts=model_parts,
                        block_causal=block_causal, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        grad_accumulation_steps=accumulation_steps, loss_parallel=loss_parallel,
                        balancer=build_expert_balancer(model_parts.model, getattr(args, "moe", None),
                                                       cfg.moe.load_balance_coeff,
                                                       meshes.loss if meshes is not None else None, device))


def forward_passes_per_step(cfg: JobConfig, accumulation_steps: int) -> int:
    """Forward passes each layer makes per optimizer step: one per accumulation step, or under pipeline parallel
    one per pipeline micro-batch of each."""
    if cfg.parallelism.pipeline_parallel_degree == 1:
        return accumulation_steps
    return accumulation_steps * cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size


def count_accumulation_steps(training: Training, dp_degree: int) -> int:
    """Micro-batches per optimizer step (titan/config/degrees.py accumulation_steps), said in the log when the
    global batch sets them."""
    steps = accumulation_steps(training, dp_degree)
    if training.global_batch_size != -1:
        logger.info(f"Global batch {training.global_batch_size}: {steps} gradient accumulation steps of "
                    f"{training.local_batch_size} sequences on each of {dp_degree} data-parallel ranks")
    return steps


def build_model(cfg: JobConfig, dims: ParallelDims, meshes: Meshes | None, family: ModelFamily, args: object,
                device: torch.device, parallelize: Callable[[nn.Module], None]) -> ModelParts:
    """The model built on meta, converted, split into this rank's pipeline stages (with the schedule) and
    parallelized; not yet materialised."""
    with torch.device("meta"):
        model = family.model(args)
    total_params = num_params(model, exclude_embedding=False)
    logger.info(family.describe(cfg.model.flavor, args, model))
    fqns = frozenset(model.state_dict())  # parameters and persistent buffers (a router's expert bias)
    flops = family.flops_per_token(args, model, cfg.training.seq_len)
    conversion = apply_converters(model, cfg.model.converters, cfg.float8, cfg.mx, cfg.nvfp4, dims.tp,
                                  fsdp_enabled=dims.dp_enabled, print_after_conversion=cfg.model.print_after_conversion)
    if dims.pp_enabled:
        # The residual stream crosses stages in FSDP's compute dtype; autocast without FSDP keeps it float32.
        residual_dtype = to_dtype(cfg.training.mixed_precision_param) if dims.dp_enabled else torch.float32
        shapes = StageShapes(microbatch_size=cfg.parallelism.pipeline_parallel_microbatch_size,
                             seq_len=cfg.training.seq_len, cp=dims.cp, tp=dims.tp, dim=args.dim,
                             residual_dtype=residual_dtype)
        pipeline = build_pipeline(model, meshes.pp, cfg.parallelism, cfg.training.local_batch_size, device,
                                  parallelize, shapes)
        parts, whole = pipeline.parts, pipeline.model
    else:
        parallelize(model)
        pipeline, parts, whole = None, [model], model
    return ModelParts(family=family, args=args, parts=parts, model=whole, pipeline=pipeline, conversion=conversion,
                      fqns=fqns, num_params=total_params, num_active_params=family.num_active_params(args, model),
                      flops_per_token=flops)


def init_model_weights(model_parts: ModelParts, device: torch.device, seed: int, pipelined: bool,
                       cpu_offload: bool) -> None:
    """Materialise the (possibly sharded or pipelined) model on the device and initialise it from the seed."""
    parts = model_parts.parts
    family = model_parts.family
    if needs_full_init(parts[0], pipelined, cpu_offload):
        if full_copy_fits(model_parts.num_params, device):
            full = build_full_model(family, model_parts.args, device, seed)
            for part in parts:
                apply_to_empty(part, device, cpu_offload)
                tie_output(part)
                apply_full_init(part, full)
            return
        if cpu_offload:
            raise ConfigError(f"--training.enable_cpu_offload initialises the weights from a float32 copy of the "
                              f"whole model on the GPU ({model_parts.num_params * 4 / 2**30:.1f} GiB), so that the "
                              f"shards in host memory get a single process's values, and it does not fit the GPU's "
                              f"free memory. Train this model without offload, on more GPUs "
                              f"(--parallelism.data_parallel_shard_degree).")
        # A model too large for one device: pipeline stages draw from streams of their own (the seed and their first
        # block), so no two stages share random numbers; sharded parameters draw from DTensor's RNG tracker. Either
        # way the weights are the seed's, but not a single process's, and another layout gets others.
        logger.info(f"The whole model ({model_parts.num_params * 4 / 2**30:.1f} GiB in float32) does not fit this "
                    f"device's free memory to initialise a single process's weights from: each "
                    f"{'pipeline stage' if pipelined else 'shard'} initialises from the seed by itself, so the "
                    f"weights depend on the parallel layout.")
    for part in parts:
        if pipelined:
            torch.manual_seed(seed + first_block(part))
        materialize(family, part, device)


def first_block(part: nn.Module) -> int:
    """The id of a pipeline stage's first transformer block (0 for the first stage, or one without blocks)."""
    return min((int(layer_id) for layer_id in part.layers), default=0)


def build_full_model(family: ModelFamily, args: object, device: torch.device, seed: int) -> nn.Module:
    """An unsharded copy initialised exactly as a single process would initialise it."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        full = family.model(args)
    materialize(family, full, device)
    return full


def materialize(family: ModelFamily, model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-built model on the device and fill it with the family's init_weights."""
    model.to_empty(device=device)
    with torch.no_grad():
        family.init_weights(model, device)


