"""The parallel layout's config rules (titan/config/rule.py says what a rule is): degrees that multiply to the world
size, pipeline stages and micro-batches the schedule can run, sequence and model shapes that context, tensor and
expert parallel split evenly, and the combinations of them (and of activation checkpointing) that torch does not run.
They check a layout with the arithmetic that builds it (titan/parallel/degrees.py, stages.py, ac.py)."""

import math

import torch

from titan.config.job import ActivationCheckpoint, Compile, Model, MoE, Parallelism, Training
from titan.config.rule import flavor_args, flavors_with, has_experts, largest_divisor_at_most, needs_in_range
from titan.hardware import Accelerator
from titan.models.families import FAMILIES
from titan.parallel.ac import keeps_attention, records_ops
from titan.parallel.degrees import resolved_shard_degree
from titan.parallel.stages import (
    LOOPED_SCHEDULES,
    ROUND_SCHEDULES,
    V_SCHEDULES,
    default_stages_per_rank,
    requested_num_stages,
    split_point_layers,
)


@needs_in_range("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree")
def check_degree_product(parallelism: Parallelism, world_size: int) -> str | None:
    par = parallelism
    shard = par.data_parallel_shard_degree
    product = (par.pipeline_parallel_degree * par.data_parallel_replicate_degree * par.context_parallel_degree
               * par.tensor_parallel_degree * resolved_shard_degree(par, world_size))
    if product == world_size:
        return None
    return (f"--parallelism.pipeline_parallel_degree {par.pipeline_parallel_degree} x "
            f"--parallelism.data_parallel_replicate_degree {par.data_parallel_replicate_degree} x "
            f"--parallelism.data_parallel_shard_degree {shard} x --parallelism.context_parallel_degree "
            f"{par.context_parallel_degree} x --parallelism.tensor_parallel_degree {par.tensor_parallel_degree} "
            f"must multiply to the world size {world_size} (NGPU x nodes). Change the degrees, or leave "
            f"data_parallel_shard_degree at -1 to use the rest.")


def check_pipeline_split_points(model: Model, parallelism: Parallelism) -> str | None:
    points = parallelism.pipeline_parallel_split_points
    if not points or flavor_args(model) is None:
        return None
    num_layers = flavor_args(model).n_layers
    try:
        layers = split_point_layers(points)
    except ValueError as bad:
        return (f"--parallelism.pipeline_parallel_split_points has {str(bad)!r}: each point names the first block "
                f"of a stage as \"layers.<k>\", e.g. \"layers.{num_layers // 2}\".")
    if layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] >= num_layers:
        return (f"--parallelism.pipeline_parallel_split_points {' '.join(points)} must be increasing block indices "
                f"between layers.1 and layers.{num_layers - 1} (--model.flavor {model.flavor} has {num_layers} "
                f"blocks), so every stage holds at least one block.")
    return None


@needs_in_range("parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_layers_per_stage")
def check_pipeline_stages(model: Model, parallelism: Parallelism) -> list[str]:
    par = parallelism
    pp, schedule = par.pipeline_parallel_degree, par.pipeline_parallel_schedule
    if flavor_args(model) is None:
        return []
    num_layers = flavor_args(model).n_layers
    if pp == 1:
        given = [f"--parallelism.{name}" for name in ("pipeline_parallel_layers_per_stage",
                                                       "pipeline_parallel_split_points") if getattr(par, name)]
        return [f"{' and '.join(given)} only apply with --parallelism.pipeline_parallel_degree above 1. Drop "
                f"{'them' if len(given) > 1 else 'it'} or set the degree."] if given else []
    stages = requested_num_stages(num_layers, pp, schedule, par.pipeline_parallel_layers_per_stage,
                                  par.pipeline_parallel_split_points)
    per_rank_needed = ("exactly 2" if schedule in V_SCHEDULES else "2 or more" if schedule in LOOPED_SCHEDULES
                       else "exactly 1")
    per_rank = stages // pp
    fits = stages % pp == 0 and (per_rank == 2 if schedule in V_SCHEDULES else per_rank >= 2
                                 if schedule in LOOPED_SCHEDULES else per_rank == 1)
    problems = []
    layers_per_stage = par.pipeline_parallel_layers_per_stage
    if layers_per_stage is not None and not par.pipeline_parallel_split_points and num_layers % layers_per_stage:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0
                    and (num_layers // d) % pp == 0 and num_layers // d >= pp * default_stages_per_rank(schedule)]
        hint = f" Try {divisors[-1]}." if divisors else ""
        problems.append(f"--parallelism.pipeline_parallel_layers_per_stage {layers_per_stage} must divide the "
                        f"{num_layers} blocks of --model.flavor {model.flavor}.{hint}")
    elif not fits:
        how = (f"{len(par.pipeline_parallel_split_points)} --parallelism.pipeline_parallel_split_points give"
               if par.pipeline_parallel_split_points else
               f"--parallelism.pipeline_parallel_layers_per_stage {layers_per_stage} gives" if layers_per_stage
               else "the default gives")
        problems.append(f"--parallelism.pipeline_parallel_schedule {schedule} runs {per_rank_needed} stage(s) on "
                        f"each of --parallelism.pipeline_parallel_degree {pp} ranks, but {how} {stages} stages. "
                        f"Use {pp * default_stages_per_rank(schedule)} stages (e.g. leave the split unset).")
    if stages > num_layers:
        problems.append(f"--parallelism.pipeline_parallel_degree {pp} with --parallelism.pipeline_parallel_schedule "
                        f"{schedule} needs {stages} stages of at least one block, but --model.flavor "
                        f"{model.flavor} has {num_layers}. Use fewer stages or a deeper flavor.")
    return problems


@needs_in_range("parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_microbatch_size",
                "training.local_batch_size")
def check_pipeline_microbatches(parallelism: Parallelism, training: Training) -> str | None:
    par, local_batch = parallelism, training.local_batch_size
    pp, size = par.pipeline_parallel_degree, par.pipeline_parallel_microbatch_size
    schedule = par.pipeline_parallel_schedule
    if pp == 1:
        return None
    if local_batch % size:
        return (f"--training.local_batch_size {local_batch} must be a multiple of "
                f"--parallelism.pipeline_parallel_microbatch_size {size} (the pipeline splits each batch into "
                f"micro-batches). Try --parallelism.pipeline_parallel_microbatch_size "
                f"{largest_divisor_at_most(size, local_batch)}.")
    microbatches = local_batch // size
    rounds = max(1, microbatches // pp)
    if microbatches >= pp and (schedule not in ROUND_SCHEDULES or microbatches % rounds == 0):
        return None
    valid = max(pp, microbatches // pp * pp) * size
    multiple = f", and a multiple of {pp}" if schedule in ROUND_SCHEDULES else ""
    return (f"--parallelism.pipeline_parallel_schedule {schedule} on --parallelism.pipeline_parallel_degree {pp} "
            f"needs at least {pp} micro-batches{multiple}, but --training.local_batch_size {local_batch} / "
            f"--parallelism.pipeline_parallel_microbatch_size {size} gives {microbatches}. Try "
            f"--training.local_batch_size {valid}.")


def check_pipeline_schedule_support(parallelism: Parallelism, accelerator: Accelerator) -> str | None:
    par = parallelism
    if (par.pipeline_parallel_degree > 1 and par.pipeline_parallel_schedule in V_SCHEDULES
            and not accelerator.is_cuda and torch_version() < (2, 13)):
        return (f"--parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule} fails in torch "
                f"{torch.__version__}'s stage setup over gloo (CPU): its first send goes to an unconnected peer "
                f"(seen on torch 2.11). Use torch 2.13 or newer, or another schedule such as InterleavedZeroBubble.")
    return None


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def context_parallel_length_problem(flag: str, seq_len: int, cp: int, tp: int) -> str | None:
    """The problem with a sequence of `seq_len` tokens (the value of `flag`) under context parallel `cp` and tensor
    parallel `tp`, or None: context parallel splits it into 2 x cp load-balanced chunks, and sequence parallel each
    rank's share by tp."""
    if seq_len % (2 * cp) == 0 and (seq_len // cp) % tp == 0:
        return None
    step = 2 * cp * tp // math.gcd(2, tp)  # the smallest length both splits divide
    with_tp = f" (and its 1/{cp} share by --parallelism.tensor_parallel_degree {tp})" if tp > 1 else ""
    return (f"{flag} {seq_len} must be divisible by 2 x --parallelism.context_parallel_degree {cp}{with_tp}: "
            f"context parallel splits each sequence into {2 * cp} load-balanced chunks. Try "
            f"{max(step, seq_len // step * step)}.")


@needs_in_range("parallelism.context_parallel_degree", "parallelism.tensor_parallel_degree")
def check_context_parallel(parallelism: Parallelism, training: Training) -> str | None:
    cp, tp = parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
    if cp == 1:
        return None
    return context_parallel_length_problem("--training.seq_len", training.seq_len, cp, tp)


def check_tensor_parallel_shapes(model: Model, parallelism: Parallelism, training: Training,
                                 world_size: int) -> list[str]:
    tp = parallelism.tensor_parallel_degree
    if tp <= 1 or flavor_args(model) is None:
        return []
    sizes = FAMILIES[model.name].tensor_parallel_sizes(flavor_args(model))
    problems = [f"--parallelism.tensor_parallel_degree {tp} must divide the {what} of --model.flavor "
                f"{model.flavor} ({size}). Try {largest_divisor_at_most(tp, size, world_size)}."
                for what, size in sizes if size % tp]
    if model.vocab_size_multiple_of % tp:
        problems.append(f"--model.vocab_size_multiple_of {model.vocab_size_multiple_of} must be a multiple of "
                        f"--parallelism.tensor_parallel_degree {tp}, so the padded vocab splits evenly. Try "
                        f"{model.vocab_size_multiple_of * tp}.")
    if training.seq_len % tp:
        problems.append(f"--training.seq_len {training.seq_len} must be divisible by "
                        f"--parallelism.tensor_parallel_degree {tp} (sequence parallel splits it). Try "
                        f"{training.seq_len // tp * tp}.")
    return problems


@needs_in_range("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree")
def check_mixture_of_experts(model: Model, moe: MoE, parallelism: Parallelism, world_size: int) -> list[str]:
    args, par = flavor_args(model), parallelism
    if args is None:
        return []
    experts, ep = getattr(args, "moe", None), par.expert_parallel_degree
    if experts is None:
        problems = []
        if ep > 1:
            problems.append(f"--parallelism.expert_parallel_degree {ep} needs a mixture-of-experts flavor, and "
                            f"--model.name {model.name} --model.flavor {model.flavor} has no experts. Use 1, or "
                            f"{flavors_with(has_experts)}.")
        if moe.aux_loss_weight > 0:
            problems.append(f"--moe.aux_loss_weight {moe.aux_loss_weight} only applies to mixture-of-experts "
                            f"flavors, and --model.flavor {model.flavor} has no experts. Set it to 0.")
        return problems
    problems = []
    if par.tensor_parallel_degree > 1:
        problems.append(f"--parallelism.tensor_parallel_degree {par.tensor_parallel_degree} does not combine with "
                        f"the mixture-of-experts flavor {model.flavor} yet: Titan's tensor-parallel plan covers "
                        f"attention and dense feed-forwards only. Split the experts with "
                        f"--parallelism.expert_parallel_degree (and FSDP) instead, or use a dense flavor.")
    shard = resolved_shard_degree(par, world_size)
    borrowed = shard * par.context_parallel_degree
    if borrowed % ep:
        problems.append(f"--parallelism.expert_parallel_degree {ep} must divide --parallelism."
                        f"data_parallel_shard_degree {shard} x --parallelism.context_parallel_degree "
                        f"{par.context_parallel_degree} = {borrowed}: expert parallel borrows its ranks from them. "
                        f"Try {largest_divisor_at_most(ep, borrowed, experts.num_experts)}.")
    if experts.num_experts % ep:
        problems.append(f"--parallelism.expert_parallel_degree {ep} must divide the {experts.num_experts} experts of "
                        f"--model.flavor {model.flavor}, so every rank holds as many. Try "
                        f"{largest_divisor_at_most(ep, borrowed, experts.num_experts)}.")
    return problems


def check_tied_embeddings(model: Model, parallelism: Parallelism) -> str | None:
    args, pp = flavor_args(model), parallelism.pipeline_parallel_degree
    if args is None or pp == 1 or not getattr(args, "tie_embeddings", False):
        return None
    return (f"--model.flavor {model.flavor} ties its output layer to the token embedding, which "
            f"--parallelism.pipeline_parallel_degree {pp} would put on different stages. Use "
            f"--parallelism.pipeline_parallel_degree 1 (FSDP and TP keep the tie), or an untied flavor (8B and up).")


def check_async_tp(parallelism: Parallelism, compile: Compile, accelerator: Accelerator) -> str | None:
    par = parallelism
    if not par.enable_async_tensor_parallel:
        return None
    if (par.tensor_parallel_degree <= 1 or not compile.enable or compile.backend != "inductor"
            or not accelerator.is_cuda):
        return ("--parallelism.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree above 1, "
                "--compile.enable with --compile.backend inductor, and CUDA GPUs (it is an inductor pass over NCCL "
                "symmetric memory). Drop the flag, or add the missing ones.")
    return None


def check_selective_ac_option(activation_checkpoint: ActivationCheckpoint) -> str | None:
    option = activation_checkpoint.selective_ac_option
    if option == "op" or (option.isdigit() and int(option) >= 1):
        return None
    return (f"--activation_checkpoint.selective_ac_option {option!r} must be \"op\" or a whole number k >= 1 "
            f"(checkpoint every k-th block).")


def check_resharded_experts_under_recording_checkpoints(model: Model, parallelism: Parallelism,
                                                        activation_checkpoint: ActivationCheckpoint, compile: Compile,
                                                        accelerator: Accelerator) -> str | None:
    """Under pipeline parallel the schedule keeps FSDP units gathered after each micro-batch's backward but the last:
    experts resharded after every forward (always) are then gathered in a later micro-batch's recompute and not in
    its forward, inside a block that selective checkpointing records op by op, which torch 2.13 refuses at the first
    backward (titan/parallel/fsdp.py reshard_experts_after_forward)."""
    par, ac = parallelism, activation_checkpoint
    if par.fsdp_reshard_after_forward != "always" or par.pipeline_parallel_degree == 1:
        return None
    if par.expert_parallel_degree == 1 or not has_experts(flavor_args(model)):
        return None
    keep_attention = keeps_attention(ac.save_attention, compile.enable, accelerator.is_cuda)
    if not records_ops(ac.mode, ac.selective_ac_option, keep_attention):
        return None
    return (f"--parallelism.fsdp_reshard_after_forward always reshards the experts (an FSDP unit inside each block "
            f"under --parallelism.expert_parallel_degree {par.expert_parallel_degree}) after every forward, which "
            f"--parallelism.pipeline_parallel_degree {par.pipeline_parallel_degree} makes a later micro-batch's "
            f"recompute gather again, and --activation_checkpoint.mode {ac.mode} records each block's ops to replay "
            f"them (torch 2.13 refuses the extra gather). Use --parallelism.fsdp_reshard_after_forward default, or "
            f"--activation_checkpoint.no_save_attention (full AC, or selective with a block count).")
