"""Cross-field config rules, checked once right after parsing and before any model or process-group work.

Each rule is one function returning a problem line (or None); validate() runs all of them and raises a
single ConfigError listing every problem, so a user fixes them in one go.
"""

import glob
import os
from collections.abc import Callable

import torch

from titan.config.errors import ConfigError
from titan.config.job import CHECKPOINT_PARTS, JobConfig
from titan.config.paths import resolve_path
from titan.models.llama.args import LLAMA3_FLAVORS, ffn_hidden_dim

# Model converters this build provides; each converter issue registers its name here.
AVAILABLE_CONVERTERS: tuple[str, ...] = ("float8", "mx")
# Float8 matmuls need SM89+ (Ada, Hopper, Blackwell).
FLOAT8_MIN_CAPABILITY = (8, 9)
# Block-scaled (MX) matmuls need SM100+ (Blackwell).
MX_MIN_CAPABILITY = (10, 0)

POSITIVE_FIELDS = (
    ("training", "steps"), ("training", "local_batch_size"), ("training", "seq_len"),
    ("metrics", "log_freq"), ("profiling", "profile_freq"), ("model", "vocab_size_multiple_of"),
    ("comm", "init_timeout_seconds"), ("comm", "train_timeout_seconds"), ("checkpoint", "interval"),
)


def check_positive(cfg: JobConfig) -> list[str]:
    """Counts and sizes that must be at least 1."""
    problems = []
    for section, name in POSITIVE_FIELDS:
        value = getattr(getattr(cfg, section), name)
        if value < 1:
            problems.append(f"--{section}.{name} must be at least 1 (got {value}).")
    return problems


def check_seq_len(cfg: JobConfig, world_size: int) -> str | None:
    max_seq_len = LLAMA3_FLAVORS[cfg.model.flavor].max_seq_len
    if cfg.training.seq_len > max_seq_len:
        return (f"--training.seq_len {cfg.training.seq_len} is longer than --model.flavor {cfg.model.flavor} "
                f"supports ({max_seq_len}). Use --training.seq_len {max_seq_len} or less.")
    return None


def check_global_batch(cfg: JobConfig, world_size: int) -> str | None:
    t = cfg.training
    dp_degree = data_parallel_degree(cfg, world_size)
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1 or (t.global_batch_size >= per_step and t.global_batch_size % per_step == 0):
        return None
    return (f"--training.global_batch_size {t.global_batch_size} must be a multiple of --training.local_batch_size "
            f"{t.local_batch_size} x data-parallel degree {dp_degree} = {per_step} "
            f"(it sets the gradient accumulation steps). Try {max(per_step, t.global_batch_size // per_step * per_step)} "
            f"or -1.")


def check_converters(cfg: JobConfig, world_size: int) -> str | None:
    unknown = [c for c in cfg.model.converters if c not in AVAILABLE_CONVERTERS]
    if not unknown:
        return None
    available = ", ".join(AVAILABLE_CONVERTERS) if AVAILABLE_CONVERTERS else "none in this version of Titan"
    return f"--model.converters has unknown converter(s) {', '.join(map(repr, unknown))}. Available: {available}."


def check_tokenizer_path(cfg: JobConfig, world_size: int) -> str | None:
    if resolve_path(cfg.model.tokenizer_path).is_file():
        return None
    return (f"--model.tokenizer_path {cfg.model.tokenizer_path!r} is not a file. Point it at a tiktoken-format "
            f"tokenizer such as tokenizers/titan_2256.tiktoken or Llama 3's tokenizer.model.")


def check_dataset_path(cfg: JobConfig, world_size: int) -> str | None:
    t = cfg.training
    if t.dataset == "shipped":
        return None
    if t.dataset_path is None:
        return f"--training.dataset {t.dataset} needs --training.dataset_path (files, a folder or a glob; a dataset name for hf)."
    if t.dataset in ("text", "jsonl") and not (resolve_path(t.dataset_path).exists() or glob.glob(t.dataset_path)):
        return f"--training.dataset_path {t.dataset_path!r} matches no file or folder. Check the path or glob."
    return None


def check_lr_schedule(cfg: JobConfig, world_size: int) -> list[str]:
    problems = []
    if cfg.optimizer.lr <= 0:
        problems.append(f"--optimizer.lr must be positive (got {cfg.optimizer.lr}).")
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        problems.append(f"--lr_scheduler.warmup_steps must be 0 or more (got {s.warmup_steps}).")
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        problems.append(f"--lr_scheduler.decay_ratio must be between 0 and 1 (got {s.decay_ratio}).")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        problems.append(f"--lr_scheduler.min_lr_factor must be between 0 and 1 (got {s.min_lr_factor}).")
    return problems


def check_memory_snapshot(cfg: JobConfig, world_size: int) -> str | None:
    if cfg.profiling.enable_memory_snapshot and not torch.cuda.is_available():
        return ("--profiling.enable_memory_snapshot records CUDA allocator history and needs a GPU; none is "
                "visible. Drop the flag, or use --profiling.enable_profiling for CPU traces.")
    return None


def check_reserved_parallelisms(cfg: JobConfig, world_size: int) -> list[str]:
    par = cfg.parallelism
    return [f"--parallelism.{name} {value}: {label} parallelism is not supported yet. Set it to 1 and use data "
            f"and tensor parallelism." for name, value, label in
            (("pipeline_parallel_degree", par.pipeline_parallel_degree, "pipeline"),
             ("context_parallel_degree", par.context_parallel_degree, "context")) if value != 1]


def check_degree_product(cfg: JobConfig, world_size: int) -> str | None:
    par = cfg.parallelism
    replicate, shard, tp = (par.data_parallel_replicate_degree, par.data_parallel_shard_degree,
                            par.tensor_parallel_degree)
    if replicate < 1 or tp < 1 or (shard < 1 and shard != -1):
        return (f"parallel degrees must be at least 1 (data_parallel_shard_degree may be -1): got "
                f"--parallelism.data_parallel_replicate_degree {replicate}, --parallelism.data_parallel_shard_degree "
                f"{shard}, --parallelism.tensor_parallel_degree {tp}.")
    fixed = replicate * tp * (1 if shard == -1 else shard)
    if (shard == -1 and world_size % fixed == 0) or fixed == world_size:
        return None
    return (f"--parallelism.data_parallel_replicate_degree {replicate} x --parallelism.data_parallel_shard_degree "
            f"{shard} x --parallelism.tensor_parallel_degree {tp} must multiply to the world size {world_size} "
            f"(NGPU x nodes). Change the degrees, or leave data_parallel_shard_degree at -1 to use the rest.")


def check_tensor_parallel_shapes(cfg: JobConfig, world_size: int) -> list[str]:
    tp = cfg.parallelism.tensor_parallel_degree
    if tp <= 1:
        return []
    args = LLAMA3_FLAVORS[cfg.model.flavor]
    sizes = (("attention heads", args.n_heads), ("kv heads", args.n_kv_heads), ("FFN hidden size", ffn_hidden_dim(args)))
    problems = [f"--parallelism.tensor_parallel_degree {tp} must divide the {what} of --model.flavor "
                f"{cfg.model.flavor} ({size}). Try {largest_divisor_at_most(size, tp)}."
                for what, size in sizes if size % tp]
    if cfg.model.vocab_size_multiple_of % tp:
        problems.append(f"--model.vocab_size_multiple_of {cfg.model.vocab_size_multiple_of} must be a multiple of "
                        f"--parallelism.tensor_parallel_degree {tp}, so the padded vocab splits evenly. Try "
                        f"{cfg.model.vocab_size_multiple_of * tp}.")
    if cfg.training.seq_len % tp:
        problems.append(f"--training.seq_len {cfg.training.seq_len} must be divisible by "
                        f"--parallelism.tensor_parallel_degree {tp} (sequence parallel splits it). Try "
                        f"{cfg.training.seq_len // tp * tp}.")
    return problems


def check_async_tp(cfg: JobConfig, world_size: int) -> str | None:
    par = cfg.parallelism
    if not par.enable_async_tensor_parallel:
        return None
    if par.tensor_parallel_degree <= 1 or not cfg.training.compile or not torch.cuda.is_available():
        return ("--parallelism.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree above 1, "
                "--training.compile and CUDA GPUs (it is an inductor pass over NCCL symmetric memory). Drop the "
                "flag, or add the missing ones.")
    return None


def check_selective_ac_option(cfg: JobConfig, world_size: int) -> str | None:
    option = cfg.activation_checkpoint.selective_ac_option
    if option == "op" or (option.isdigit() and int(option) >= 1):
        return None
    return (f"--activation_checkpoint.selective_ac_option {option!r} must be \"op\" or a whole number k >= 1 "
            f"(checkpoint every k-th block).")


def check_float8_all_gather(cfg: JobConfig, world_size: int) -> list[str]:
    f8 = cfg.float8
    problems = []
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        problems.append(f"--float8.enable_fsdp_float8_all_gather only works with --float8.recipe_name tensorwise "
                        f"(got {f8.recipe_name!r}). Switch to tensorwise or turn off the all-gather.")
    if f8.enable_fsdp_float8_all_gather and cfg.parallelism.tensor_parallel_degree > 1:
        problems.append(f"--float8.enable_fsdp_float8_all_gather does not combine with --parallelism."
                        f"tensor_parallel_degree {cfg.parallelism.tensor_parallel_degree} yet (TP re-wraps the "
                        f"weights before FSDP sees them). Turn one of them off.")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        problems.append("--float8.precompute_float8_dynamic_scale_for_fsdp needs --float8.enable_fsdp_float8_all_gather "
                        "(it precomputes the all-gather's scales). Add it or drop the precompute flag.")
    return problems


def check_float8_hardware(cfg: JobConfig, world_size: int) -> list[str]:
    if "float8" not in cfg.model.converters or cfg.float8.emulate or not torch.cuda.is_available():
        return []
    problems = []
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_MIN_CAPABILITY:
        problems.append(f"--model.converters float8 needs a GPU with compute capability 8.9 or newer (Ada, Hopper, "
                        f"Blackwell); this {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}. Add "
                        f"--float8.emulate to run the same quantization with high-precision matmuls.")
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    if tokens % 16:
        problems.append(f"--training.local_batch_size x --training.seq_len = {tokens} tokens must be divisible by 16 "
                        f"for float8's weight-gradient matmul on CUDA. Try --training.seq_len "
                        f"{cfg.training.seq_len // 16 * 16 or 16}.")
    return problems


def check_mx_hardware(cfg: JobConfig, world_size: int) -> str | None:
    if "mx" not in cfg.model.converters or cfg.mx.emulate:
        return None
    if not torch.cuda.is_available():
        found = "this machine has no CUDA GPU"
    elif torch.cuda.get_device_capability() < MX_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        found = f"this {torch.cuda.get_device_name()} is {major}.{minor}"
    else:
        return None
    return (f"--model.converters mx runs natively only on NVIDIA GPUs with compute capability 10.0 or newer "
            f"(Blackwell: B200, GB200, B300), whose tensor cores multiply MX blocks; {found}. Add --mx.emulate to "
            f"run the same MX quantization with high-precision matmuls (correct numerics, no speed-up).")


def check_checkpoint(cfg: JobConfig, world_size: int) -> list[str]:
    ckpt = cfg.checkpoint
    problems = []
    if ckpt.keep_latest_k < 0:
        problems.append(f"--checkpoint.keep_latest_k {ckpt.keep_latest_k} must be 0 (keep all) or a positive count.")
    if ckpt.load_step < -1:
        problems.append(f"--checkpoint.load_step {ckpt.load_step} must be a step number or -1 (the latest).")
    unknown = [part for part in ckpt.exclude_from_loading if part not in CHECKPOINT_PARTS]
    if unknown:
        problems.append(f"--checkpoint.exclude_from_loading has unknown part(s) {', '.join(map(repr, unknown))}. "
                        f"Parts: {', '.join(CHECKPOINT_PARTS)}.")
    if ckpt.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
        problems.append("--checkpoint.async_mode async_with_pinned_mem copies device tensors into pinned host memory, "
                        "which needs CUDA GPUs. Use --checkpoint.async_mode async on this machine.")
    if ckpt.create_seed_checkpoint and (world_size != 1 or not ckpt.enable):
        problems.append(f"--checkpoint.create_seed_checkpoint writes the initial weights from one process into "
                        f"--checkpoint.folder: run it with --checkpoint.enable and NGPU=1 (world size is {world_size}).")
    if ckpt.initial_load_in_hf and ckpt.initial_load_path is None:
        problems.append("--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path, the Hugging Face folder "
                        "to load.")
    if ckpt.initial_load_path is not None and not os.path.isdir(ckpt.initial_load_path):
        problems.append(f"--checkpoint.initial_load_path {ckpt.initial_load_path!r} is not a folder. Give a checkpoint "
                        f"step folder (e.g. outputs/checkpoint/step-1000) or a Hugging Face model folder.")
    return problems


def largest_divisor_at_most(size: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if size % d == 0)


def data_parallel_degree(cfg: JobConfig, world_size: int) -> int:
    """Ranks that read distinct data: the world size over the tensor-parallel degree."""
    return max(world_size // max(cfg.parallelism.tensor_parallel_degree, 1), 1)


RULES: tuple[Callable[[JobConfig, int], str | list[str] | None], ...] = (
    check_seq_len, check_global_batch, check_converters, check_tokenizer_path, check_dataset_path,
    check_lr_schedule, check_memory_snapshot, check_reserved_parallelisms, check_degree_product,
    check_tensor_parallel_shapes, check_async_tp, check_selective_ac_option, check_float8_all_gather,
    check_float8_hardware, check_mx_hardware, check_checkpoint,
)


def validate(cfg: JobConfig, world_size: int) -> None:
    """Raise one ConfigError listing every problem in `cfg` for a run of `world_size` processes."""
    problems = check_positive(cfg)
    if problems:
        # Later rules divide by these counts; report them alone first.
        raise ConfigError(problems)
    for rule in RULES:
        found = rule(cfg, world_size)
        if isinstance(found, str):
            problems.append(found)
        elif found:
            problems.extend(found)
    if problems:
        raise ConfigError(problems)
