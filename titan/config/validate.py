"""Cross-field config rules, checked once right after parsing and before any model or process-group work.

Each rule is one function returning a problem line (or None); validate() runs all of them and raises a
single ConfigError listing every problem, so a user fixes them in one go.
"""

import glob
from collections.abc import Callable

import torch

from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.paths import resolve_path
from titan.models.llama.args import LLAMA3_FLAVORS

# Model converters this build provides; each converter issue registers its name here.
AVAILABLE_CONVERTERS: tuple[str, ...] = ()

POSITIVE_FIELDS = (
    ("training", "steps"), ("training", "local_batch_size"), ("training", "seq_len"),
    ("metrics", "log_freq"), ("profiling", "profile_freq"), ("model", "vocab_size_multiple_of"),
    ("comm", "init_timeout_seconds"), ("comm", "train_timeout_seconds"),
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
    per_step = t.local_batch_size * data_parallel_degree(world_size)
    if t.global_batch_size == -1 or (t.global_batch_size >= per_step and t.global_batch_size % per_step == 0):
        return None
    return (f"--training.global_batch_size {t.global_batch_size} must be a multiple of --training.local_batch_size "
            f"{t.local_batch_size} x data-parallel degree {data_parallel_degree(world_size)} = {per_step} "
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


def check_world_size(cfg: JobConfig, world_size: int) -> str | None:
    if world_size == 1:
        return None
    return (f"this run has {world_size} processes (NGPU={world_size}), but this version of Titan trains on one "
            f"process only. Launch with NGPU=1.")


def data_parallel_degree(world_size: int) -> int:
    """Ranks that read distinct data."""
    return world_size


RULES: tuple[Callable[[JobConfig, int], str | list[str] | None], ...] = (
    check_seq_len, check_global_batch, check_converters, check_tokenizer_path, check_dataset_path,
    check_lr_schedule, check_memory_snapshot, check_world_size,
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
