"""The training run's config rules (titan/config/rule.py says what a rule is): the flavor and its sequence length, the
batch the step accumulates, the model features the layout must keep together, the optimizer's multipliers and Muon, the
validation pass, the run's folder and time limit, and the spike and fault settings."""

import os
from pathlib import Path

import torch

from titan.config.domain import parse_duration
from titan.config.job import Checkpoint, Fault, Job, Model, Optimizer, Parallelism, Training, Validation
from titan.config.paths import is_url
from titan.config.rule import (
    about_this_machine,
    fields_set,
    flavor_args,
    flavors_with,
    needs_in_range,
    unmatched_patterns,
)
from titan.hardware import Accelerator
from titan.models.families import FAMILIES
from titan.parallel.degrees import data_parallel_degree
from titan.parallel.rules import context_parallel_length_problem
from titan.train.muon import newton_schulz_bound
from titan.train.optim import ns_coefficients, parse_lr_multiplier, uses_muon

MAX_SINGULAR_VALUE = 1e3
"""Where Newton-Schulz may take a singular value at most: bounded coefficients stay near 1 (the defaults below 1.3),
diverging ones pass 1e6 within a few steps."""


def check_flavor(model: Model) -> str | None:
    flavors = FAMILIES[model.name].flavors
    if model.flavor in flavors:
        return None
    others = [name for name, family in FAMILIES.items() if model.flavor in family.flavors]
    elsewhere = f" (it is a {' and '.join(others)} flavor)" if others else ""
    return (f"--model.flavor {model.flavor} is not a flavor of --model.name {model.name}{elsewhere}. "
            f"{model.name} has: {', '.join(flavors)}.")


def check_seq_len(model: Model, training: Training) -> str | None:
    args = flavor_args(model)
    if args is None:
        return None
    max_seq_len = args.max_seq_len
    if training.seq_len > max_seq_len:
        return (f"--training.seq_len {training.seq_len} is longer than --model.flavor {model.flavor} "
                f"supports ({max_seq_len}). Use --training.seq_len {max_seq_len} or less.")
    return None


@needs_in_range("training.local_batch_size", "training.global_batch_size", "parallelism.tensor_parallel_degree",
                "parallelism.pipeline_parallel_degree", "parallelism.context_parallel_degree")
def check_global_batch(training: Training, parallelism: Parallelism, world_size: int) -> str | None:
    t = training
    dp_degree = data_parallel_degree(parallelism, world_size)
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1 or (t.global_batch_size >= per_step and t.global_batch_size % per_step == 0):
        return None
    return (f"--training.global_batch_size {t.global_batch_size} must be a multiple of --training.local_batch_size "
            f"{t.local_batch_size} x data-parallel degree {dp_degree} = {per_step} "
            f"(it sets the gradient accumulation steps). "
            f"Try {max(per_step, t.global_batch_size // per_step * per_step)} or -1.")


def has_multi_token_prediction(args: object) -> bool:
    return args.mtp_depth > 0


def check_multi_token_prediction(model: Model, training: Training, parallelism: Parallelism) -> list[str]:
    """Multi-token prediction reads the tokens up to mtp_depth places ahead of each position, and runs the embedding
    and the output layer again after the last block."""
    args, par = flavor_args(model), parallelism
    if args is None:
        return []
    if args.mtp_depth == 0:
        if "mtp_loss_weight" not in fields_set(training):
            return []
        return [f"--training.mtp_loss_weight {training.mtp_loss_weight} only applies to flavors with multi-token "
                f"prediction modules, and --model.name {model.name} --model.flavor {model.flavor} has none. "
                f"Drop it, or use {flavors_with(has_multi_token_prediction)}."]
    problems = []
    if par.pipeline_parallel_degree > 1:
        problems.append(f"--model.flavor {model.flavor} has multi-token prediction modules, which run the "
                        f"embedding and the output layer after the last block: --parallelism.pipeline_parallel_degree "
                        f"{par.pipeline_parallel_degree} puts those on different stages. Use 1, or a flavor without "
                        f"MTP (debugmodel, 671B).")
    if par.context_parallel_degree > 1:
        problems.append(f"--model.flavor {model.flavor} has multi-token prediction modules, which read the "
                        f"tokens ahead of each position: --parallelism.context_parallel_degree "
                        f"{par.context_parallel_degree} puts them on other ranks. Use 1, or a flavor without MTP "
                        f"(debugmodel, 671B).")
    return problems


def check_flex_attention_device(model: Model, accelerator: Accelerator) -> str | None:
    if model.attn_backend != "flex" or accelerator.is_cuda:
        return None
    return ("--model.attn_backend flex needs a CUDA GPU: torch has no FlexAttention backward on CPU. Use "
            f"--model.attn_backend sdpa, which masks {model.attn_mask_type} attention on any device.")


def parameter_fqns(model: Model) -> list[str]:
    """FQNs of the parameters of --model.flavor, from a build on the meta device (no memory, milliseconds): the names
    the optimizer matches --optimizer.lr_multipliers against (titan/train/optim.py)."""
    with torch.device("meta"):
        built = FAMILIES[model.name].model(flavor_args(model))
    return [name for name, _ in built.named_parameters()]


def check_lr_multipliers(model: Model, optimizer: Optimizer) -> list[str]:
    problems, entries = [], []
    for text in optimizer.lr_multipliers:
        try:
            substring, _ = parse_lr_multiplier(text)
        except ValueError:
            problems.append(f"--optimizer.lr_multipliers {text!r} is not FQN_SUBSTRING=FACTOR with a positive "
                            f"FACTOR. Write e.g. tok_embeddings=0.5.")
            continue
        entries.append((text, substring))
    if entries and flavor_args(model) is not None:
        problems += unmatched_patterns("--optimizer.lr_multipliers", entries, parameter_fqns(model), "parameter",
                                       model.flavor, "change no learning rate")
    return problems


MUON_FIELDS = ("momentum", "nesterov", "ns_steps", "ns_a", "ns_b", "ns_c", "ns_eps", "adjust_lr_fn", "adamw_fqns")
"""The [optimizer] fields only Muon reads."""


def check_muon(model: Model, optimizer: Optimizer, training: Training) -> list[str]:
    """Muon's fields only with Muon, and with Muon: Newton-Schulz coefficients that keep the iteration bounded,
    float32 state, the matrices on the device (their gathers run on the device's process group), and
    --optimizer.adamw_fqns naming parameters there are."""
    if not uses_muon(optimizer):
        return [f"--optimizer.{name} is Muon's (--optimizer.name Muon); --optimizer.name {optimizer.name} ignores "
                f"it. Leave it unset." for name in MUON_FIELDS if name in fields_set(optimizer)]
    problems = []
    coefficients = ns_coefficients(optimizer)
    value, reached = newton_schulz_bound(coefficients, optimizer.ns_steps)
    if not abs(reached) < MAX_SINGULAR_VALUE:
        problems.append(f"--optimizer.ns_a {coefficients[0]:g}, --optimizer.ns_b {coefficients[1]:g}, "
                        f"--optimizer.ns_c {coefficients[2]:g} and --optimizer.ns_steps {optimizer.ns_steps} take a "
                        f"singular value of {value:.3g} to {reached:.3g}: the Newton-Schulz iteration diverges and "
                        f"would write non-finite weights. Use coefficients that keep [0, 1] bounded, e.g. the "
                        f"defaults 3.4445, -4.775, 2.0315.")
    if optimizer.state_dtype == "bfloat16":
        problems.append(f"--optimizer.state_dtype bfloat16 is Adam's and AdamW's; --optimizer.name {optimizer.name} "
                        f"keeps one float32 momentum per matrix element (half of Adam's state already). Leave it "
                        f"at float32.")
    if training.enable_cpu_offload:
        problems.append(f"--optimizer.name {optimizer.name} can't run with --training.enable_cpu_offload: "
                        f"Newton-Schulz gathers each matrix over the device's process group, and offload keeps the "
                        f"shards in host memory. Use --optimizer.name AdamW, or turn offload off.")
    if optimizer.adamw_fqns and flavor_args(model) is not None:
        problems += unmatched_patterns("--optimizer.adamw_fqns", [(text, text) for text in optimizer.adamw_fqns],
                                       parameter_fqns(model), "parameter", model.flavor,
                                       "leave every matrix with Muon")
    return problems


@needs_in_range("validation.local_batch_size", "validation.seq_len", "parallelism.pipeline_parallel_degree")
def check_validation_pipeline(validation: Validation, training: Training, parallelism: Parallelism) -> list[str]:
    """The pipeline schedule is built for training's micro-batch shapes, and evaluates through it."""
    v, t, pp = validation, training, parallelism.pipeline_parallel_degree
    if not v.enable or pp == 1:
        return []
    problems = []
    if parallelism.pipeline_parallel_schedule == "ZBVZeroBubble":
        # torch's V schedule cannot run forward only: its eval() fails with "can't steal_bwd_input if this stage
        # doesn't have backward" (torch 2.11 to 2.13).
        problems.append("--validation.enable can't run under --parallelism.pipeline_parallel_schedule ZBVZeroBubble: "
                        "torch's V schedule has no forward-only pass. Use InterleavedZeroBubble (same zero-bubble "
                        "idea, looped stages) or turn validation off.")
    return problems + [f"--validation.{name} {value} must equal --training.{name} {training_value} under "
            f"--parallelism.pipeline_parallel_degree {pp}: the pipeline schedule's micro-batch shapes are fixed. Use "
            f"--validation.{name} {training_value} or leave it unset."
            for name, value, training_value in (("local_batch_size", v.local_batch_size, t.local_batch_size),
                                                ("seq_len", v.seq_len, t.seq_len))
            if value is not None and value != training_value]


@needs_in_range("validation.seq_len", "training.seq_len", "parallelism.context_parallel_degree",
                "parallelism.tensor_parallel_degree")
def check_validation_seq_len(validation: Validation, training: Training, parallelism: Parallelism) -> str | None:
    """At most the length the model's rotary table is built for, and a length context and tensor parallel can
    split. Unset, it is --training.seq_len, which the training rules check."""
    seq_len, training_seq_len = validation.seq_len, training.seq_len
    if not validation.enable or seq_len is None:
        return None
    if seq_len > training_seq_len:
        return (f"--validation.seq_len {seq_len} is longer than --training.seq_len {training_seq_len}, the length "
                f"the model's rotary table is built for. Use --validation.seq_len {training_seq_len} or less.")
    cp, tp = parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
    if cp > 1:
        return context_parallel_length_problem("--validation.seq_len", seq_len, cp, tp)
    if seq_len % tp:
        return (f"--validation.seq_len {seq_len} must be divisible by --parallelism.tensor_parallel_degree {tp} "
                f"(sequence parallel splits it). Try {max(tp, seq_len // tp * tp)}.")
    return None


@about_this_machine
def check_dump_folder(job: Job) -> str | None:
    """The dump folder must be a folder, or creatable: its nearest existing ancestor a writable folder."""
    given = job.dump_folder
    folder = Path(given).expanduser().absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    fix = "Choose another --job.dump_folder."
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"is below the file {existing}"
        return f"--job.dump_folder {given!r} {where}, not a folder. {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--job.dump_folder {given!r} can't be written: {existing} is not writable by this user. {fix}"
    return None


def check_time_limit(job: Job) -> str | None:
    limit = job.time_limit
    if limit is None or parse_duration(limit) is not None:
        return None
    return (f"--job.time_limit {limit!r} is not a duration. Write hours, minutes and seconds, larger units first, "
            f"as in 3h50m, 90m, 45s or 1h (a little under the scheduler's limit).")


def check_spike_rollback(training: Training, checkpoint: Checkpoint) -> str | None:
    if training.on_spike == "rollback" and not checkpoint.enable:
        return ("--training.on_spike rollback reloads the last checkpoint, but --checkpoint.enable is off, so there "
                "is none to reload. Add --checkpoint.enable (and a --checkpoint.interval to roll back to), or use "
                "--training.on_spike skip.")
    return None


def check_fault(fault: Fault, training: Training, checkpoint: Checkpoint, world_size: int) -> list[str]:
    problems: list[str] = []
    if fault.kind in ("none", "random"):
        return problems
    if fault.step == 0 and fault.after_seconds == 0:
        problems.append(f"--fault.kind {fault.kind} needs a time to strike: --fault.step (the end of that step) or "
                        f"--fault.after_seconds (after the first step). Try --fault.step 5.")
    if fault.step > training.steps:
        problems.append(f"--fault.step {fault.step} is after the run's last step (--training.steps "
                        f"{training.steps}), so the fault would never strike. Try --fault.step "
                        f"{max(1, training.steps // 2)}.")
    if fault.rank >= world_size:
        problems.append(f"--fault.rank {fault.rank} is not a rank of this job (ranks 0 to {world_size - 1}). Try "
                        f"--fault.rank {world_size - 1}.")
    if fault.kind == "storage" and not checkpoint.enable:
        problems.append("--fault.kind storage makes checkpoint saves fail, but --checkpoint.enable is off. Add "
                        "--checkpoint.enable.")
    if fault.kind == "storage" and is_url(checkpoint.folder):
        problems.append(f"--fault.kind storage swaps a local --checkpoint.folder for a file; "
                        f"{checkpoint.folder!r} is on object storage, whose outage Titan cannot cause. Make the "
                        f"server refuse requests instead (the tests' S3 server: tests/harness/s3_server.py), or use "
                        f"a local folder.")
    return problems
