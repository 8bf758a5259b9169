"""The build: what a training step runs on, in the pipeline's order, from the device mesh to the LR schedule.

Model args from the flavor and the job; the model built on meta (its FQNs, parameter and FLOP counts taken there);
converters (titan/quant/convert.py); pipeline stages (titan/parallel/pp.py); TP/EP/CP/AC/compile/FSDP
(titan/parallel/parallelize.py, with the family's parallel plan); the weights materialised and initialised
(titan/parallel/init.py); the optimizer and the LR schedule. The trainer (titan/train/trainer.py) builds it and adds
data, checkpoints and metrics around it; the dry run (titan/estimate/simulate.py) builds the same on fake tensors, so
a stage added here is in both. The step that runs on it is titan/train/step.py.
"""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.config.dtypes import to_dtype
from titan.config.job import JobConfig, Model, Training
from titan.metrics.log import logger
from titan.models.common.family import BuildOptions, ModelFamily
from titan.models.common.flops import num_params
from titan.models.common.moe import TokenCounts, set_token_counts
from titan.models.families import FAMILIES
from titan.parallel.ac import keeps_attention
from titan.parallel.degrees import accumulation_steps
from titan.parallel.dims import Meshes, ParallelDims, build_meshes
from titan.parallel.init import allocate_weights, init_weights
from titan.parallel.parallelize import parallelize_model
from titan.parallel.pp import StageShapes, build_pipeline
from titan.quant.convert import apply_converters
from titan.train.expert_balance import build_expert_balancer
from titan.train.lr import build_lr_scheduler
from titan.train.optim import build_optimizer
from titan.train.step import ModelParts, TrainingStep


def set_seed(seed: int, deterministic: bool) -> None:
    """Same seed, same weights and same losses on CPU; deterministic also pins GPU kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


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
    """Tensors carry no values: mixtures of experts take their token counts as an even spread where the host reads
    them (TokenCounts.even, injected into the experts), and the bfloat16-state optimizer's update runs eagerly."""


def build_training_step(cfg: JobConfig, dims: ParallelDims, device: torch.device, vocab_size: int,
                        mode: BuildMode = BuildMode()) -> TrainingStep:
    """Everything a training step runs on, from the device mesh to the LR schedule, for a process that has joined
    its process group. `mode`: for training, or the dry run's simulation (BuildMode)."""
    meshes = build_meshes(dims, device)
    set_seed(cfg.training.seed, cfg.training.deterministic and mode.fake_mode is None)
    compile_cfg = cfg.compile if mode.compile else replace(cfg.compile, enable=False)
    attn_backend, block_causal = attention_kernel(cfg.model, dims, mode)
    accumulation_steps = count_accumulation_steps(cfg.training, dims.dp_degree)
    family = FAMILIES[cfg.model.name]
    args = family.build_args(cfg.model.flavor, build_options(cfg, vocab_size, attn_backend, accumulation_steps))
    loss_parallel = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    keep_attention = keeps_attention(cfg.activation_checkpoint.save_attention, cfg.compile.enable,
                                     on_gpu=device.type == "cuda")
    parallelize = functools.partial(parallelize_model, plan=family.parallel_plan, dims=dims, meshes=meshes,
                                    par=cfg.parallelism, ac=cfg.activation_checkpoint, train=cfg.training,
                                    compile_cfg=compile_cfg, keep_attention=keep_attention, block_causal=block_causal)
    model_parts = build_model(cfg, dims, meshes, family, args, device, parallelize)
    if mode.valueless:
        for part in model_parts.parts:
            set_token_counts(part, TokenCounts(even=True))
    with mode.fake_mode or contextlib.nullcontext():
        if mode.init_weights:
            init_weights(model_parts.parts, family, args, model_parts.num_params, device, cfg.training.seed,
                         pipelined=dims.pp_enabled, cpu_offload=cfg.training.enable_cpu_offload)
        else:
            allocate_weights(model_parts.parts, device, cfg.training.enable_cpu_offload)
        model_parts.model.train()
        optimizer = build_optimizer(model_parts.model, cfg.optimizer, meshes.shard_group if meshes else None,
                                    compile_update=not mode.valueless)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    return TrainingStep(train_cfg=cfg.training, dims=dims, meshes=meshes, device=device, model_parts=model_parts,
                        block_causal=block_causal, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        grad_accumulation_steps=accumulation_steps, loss_parallel=loss_parallel,
                        balancer=build_expert_balancer(model_parts.model, getattr(args, "moe", None),
                                                       cfg.moe.load_balance_coeff,
                                                       meshes.loss if meshes is not None else None, device))


def attention_kernel(model_cfg: Model, dims: ParallelDims, mode: BuildMode) -> tuple[str, bool]:
    """(the attention backend, whether attention is block-causal) the model is built with: the job's, except where
    the dry run cannot run FlexAttention."""
    attn_backend, block_causal = model_cfg.attn_backend, model_cfg.attn_mask_type == "block_causal"
    if mode.flex_as_causal_sdpa and attn_backend == "flex":
        # A FlexAttention block mask is built from the batch's values, which fake tensors have none of. Causal flash
        # attention stands in (CausalFlashStandIn): the same memory (outputs and log-sum-exps) and the causal half of
        # the attention work, which bounds FlexAttention's block-causal and windowed work from above (it skips every
        # masked block). Under context parallel the model's kernel is replaced by the context-parallel attention,
        # block-causal as on the GPU.
        attn_backend, block_causal = "causal_flash", block_causal and dims.cp_enabled
        logger.info("Dry run: FlexAttention is simulated by causal flash attention (same memory; its causal half of "
                    "the attention FLOPs bounds block-causal and sliding-window work from above).")
    return attn_backend, block_causal


def build_options(cfg: JobConfig, vocab_size: int, attn_backend: str, accumulation_steps: int) -> BuildOptions:
    """What the job sets on top of the flavor's shape (BuildOptions)."""
    return BuildOptions(
        vocab_size=vocab_size, vocab_size_multiple_of=cfg.model.vocab_size_multiple_of,
        max_seq_len=cfg.training.seq_len, attn_backend=attn_backend, loss_chunk_size=cfg.training.loss_chunk_size,
        moe_aux_loss_weight=cfg.moe.aux_loss_weight / forward_passes_per_step(cfg, accumulation_steps),
        moe_load_balance_coeff=cfg.moe.load_balance_coeff, mtp_loss_weight=cfg.training.mtp_loss_weight)


def forward_passes_per_step(cfg: JobConfig, accumulation_steps: int) -> int:
    """Forward passes each layer makes per optimizer step: one per accumulation step, or under pipeline parallel
    one per pipeline micro-batch of each."""
    if cfg.parallelism.pipeline_parallel_degree == 1:
        return accumulation_steps
    return accumulation_steps * cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size


def count_accumulation_steps(training: Training, dp_degree: int) -> int:
    """Micro-batches per optimizer step (titan/parallel/degrees.py accumulation_steps), said in the log when the
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
