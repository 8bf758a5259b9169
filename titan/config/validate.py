"""Config rules, checked once right after parsing and before any model or process-group work.

First every numeric field against the range its type declares (titan/config/domain.py), then the cross-field
rules: each is one function returning a problem line (or None). validate() runs all of them and raises a single
ConfigError listing every problem, so a user fixes them in one go.
"""

import dataclasses
import difflib
import glob
import importlib.util
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from titan.config.activation_checkpoint import keeps_attention, records_ops
from titan.config.degrees import data_parallel_degree, resolved_shard_degree
from titan.config.domain import field_ranges, parse_duration
from titan.config.errors import ConfigError
from titan.config.hardware import Accelerator, target_accelerator
from titan.config.job import CHECKPOINT_PARTS, JobConfig
from titan.config.mixture import MIXTURE_DATASETS, MixtureEntry, parse_mixture_entry
from titan.config.multipliers import parse_lr_multiplier
from titan.config.paths import is_url, missing_backend, resolve_path
from titan.config.stages import (
    LOOPED_SCHEDULES,
    ROUND_SCHEDULES,
    V_SCHEDULES,
    default_stages_per_rank,
    requested_num_stages,
    split_point_layers,
)
from titan.models.common.moe import GroupedExperts
from titan.models.families import FAMILIES, module_fqns

Rule = Callable[[JobConfig, int], str | list[str] | None]
HardwareRule = Callable[[JobConfig, Accelerator], str | list[str] | None]
"""A rule about the accelerator the job runs on: this machine's, or the GPU a dry run simulates."""
AnyRule = TypeVar("AnyRule", Rule, HardwareRule)

# Model converters this build provides.
AVAILABLE_CONVERTERS: tuple[str, ...] = ("float8", "mx", "nvfp4")
# The GPUs whose kernels torch 2.11, 2.12 and 2.13 ship for each low-precision matmul (the same in all three, read
# from their CUDA builds: the device checks and the architectures each kernel is compiled for; torch's own test suite
# gates these tests alike, torch/testing/_internal/common_cuda.py).
FLOAT8_MIN_CAPABILITY = (8, 9)
"""torch._scaled_mm in float8 (the linears, tensorwise and rowwise): 8.9 and newer (Ada, Hopper, Blackwell)."""
MX_MIN_CAPABILITY = (10, 0)
"""torch._scaled_mm with block scales (MX and NVFP4 linears, cuBLAS's block-scaled GEMMs): Blackwell, 10.0 and newer."""
FLOAT8_GROUPED_MAJORS = (9,)
"""torch._scaled_grouped_mm in float8 (the experts): its rowwise kernel is built for Hopper alone. The op's own check
also lets 10.x through, which then has no kernel for it (PLATFORM_SUPPORTS_FP8_GROUPED_GEMM: SM90 and not SM100)."""
MX_GROUPED_MAJORS = (10,)
"""torch._scaled_grouped_mm with MXFP8 block scales (the experts): its kernel is built for 10.0 and 10.3 (B200,
GB200, B300) alone; Blackwell's other parts (12.x) fail the op's check and Hopper passes it with no kernel."""


def check_domains(cfg: JobConfig) -> tuple[list[str], set[str]]:
    """Every numeric field against the Range declared on its type (titan/config/domain.py). Returns the problems
    and the "section.name" of each field out of its range."""
    problems: list[str] = []
    bad_fields: set[str] = set()
    defaults = JobConfig()
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        for field_name, domain in field_ranges(type(section)).items():
            value = getattr(section, field_name)
            if value is None or domain.contains(value):
                continue
            name = f"{section_field.name}.{field_name}"
            default = getattr(getattr(defaults, section_field.name), field_name)
            problems.append(f"--{name} {value} must be {domain.describe()}. Try {default} (the default).")
            bad_fields.add(name)
    return problems, bad_fields


def needs_in_range(*fields: str) -> Callable[[AnyRule], AnyRule]:
    """Mark a rule that computes with these fields ("section.name"): validate() skips it while any of them is
    out of its range, since that problem is already reported and the rule could divide by zero."""
    def mark(rule: AnyRule) -> AnyRule:
        rule.needs_in_range = fields  # type: ignore[attr-defined]
        return rule
    return mark


def flavor_args(cfg: JobConfig):  # noqa: ANN201 (a family's args class)
    """The shape of --model.flavor in --model.name's family, or None when the family has no such flavor
    (check_flavor reports it, and the rules that read the shape skip)."""
    return FAMILIES[cfg.model.name].flavors.get(cfg.model.flavor)


def check_flavor(cfg: JobConfig, world_size: int) -> str | None:
    flavors = FAMILIES[cfg.model.name].flavors
    if cfg.model.flavor in flavors:
        return None
    others = [name for name, family in FAMILIES.items() if cfg.model.flavor in family.flavors]
    elsewhere = f" (it is a {' and '.join(others)} flavor)" if others else ""
    return (f"--model.flavor {cfg.model.flavor} is not a flavor of --model.name {cfg.model.name}{elsewhere}. "
            f"{cfg.model.name} has: {', '.join(flavors)}.")


def check_seq_len(cfg: JobConfig, world_size: int) -> str | None:
    args = flavor_args(cfg)
    if args is None:
        return None
    max_seq_len = args.max_seq_len
    if cfg.training.seq_len > max_seq_len:
        return (f"--training.seq_len {cfg.training.seq_len} is longer than --model.flavor {cfg.model.flavor} "
                f"supports ({max_seq_len}). Use --training.seq_len {max_seq_len} or less.")
    return None


@needs_in_range("training.local_batch_size", "training.global_batch_size", "parallelism.tensor_parallel_degree",
                "parallelism.pipeline_parallel_degree", "parallelism.context_parallel_degree")
def check_global_batch(cfg: JobConfig, world_size: int) -> str | None:
    t = cfg.training
    dp_degree = data_parallel_degree(cfg.parallelism, world_size)
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1 or (t.global_batch_size >= per_step and t.global_batch_size % per_step == 0):
        return None
    return (f"--training.global_batch_size {t.global_batch_size} must be a multiple of --training.local_batch_size "
            f"{t.local_batch_size} x data-parallel degree {dp_degree} = {per_step} "
            f"(it sets the gradient accumulation steps). "
            f"Try {max(per_step, t.global_batch_size // per_step * per_step)} or -1.")


def check_converters(cfg: JobConfig, world_size: int) -> str | None:
    unknown = [c for c in cfg.model.converters if c not in AVAILABLE_CONVERTERS]
    if not unknown:
        return None
    return (f"--model.converters has unknown converter(s) {', '.join(map(repr, unknown))}. Available: "
            f"{', '.join(AVAILABLE_CONVERTERS)}.")


def unmatched_patterns(flag: str, entries: list[tuple[str, str]], fqns: list[str], what: str, flavor: str,
                       effect: str) -> list[str]:
    """One problem per entry of `flag`, given as (the entry as written, its FQN substring), whose substring is in
    none of `fqns`, the FQNs of the flavor's `what`s: after a typo or a rename it would silently match nothing, and
    `effect` says what that leaves undone. Each problem names the closest FQNs to try."""
    # Every dotted suffix of an FQN ("wq", "attention.wq", ...) is a plausible entry to suggest.
    suffixes = sorted({".".join(fqn.split(".")[i:]) for fqn in fqns for i in range(len(fqn.split(".")))})
    kinds = sorted({re.sub(r"^layers\.\d+\.", "", fqn) for fqn in fqns})
    problems = []
    for entry, substring in entries:
        if any(substring in fqn for fqn in fqns):
            continue
        close = difflib.get_close_matches(substring, suffixes, n=3, cutoff=0.5)
        nearest = (f"Closest FQNs: {', '.join(close)}." if close else
                   f"Its {what}s (the layers.<i>. prefix left out): {', '.join(kinds)}.")
        problems.append(f"{flag} {entry!r} matches no {what} of --model.flavor {flavor}, so it would {effect}. "
                        f"{nearest}")
    return problems


def check_converter_filters(cfg: JobConfig, world_size: int) -> list[str]:
    """A filter entry that matches no layer keeps nothing out, so the layer it was meant to protect (after a typo
    or a rename) would silently train in low precision; an experts entry that matches no experts converts nothing."""
    sections = {"float8": cfg.float8, "mx": cfg.mx, "nvfp4": cfg.nvfp4}
    used = [name for name in sections if name in cfg.model.converters]
    if not used or flavor_args(cfg) is None:
        return []
    # Module names don't depend on the vocab or sequence length.
    linears = module_fqns(cfg.model.name, cfg.model.flavor, nn.Linear)
    experts = module_fqns(cfg.model.name, cfg.model.flavor, GroupedExperts)
    problems = [problem for name in used
                for problem in unmatched_patterns(f"--{name}.filter_fqns",
                                                  [(entry, entry) for entry in sections[name].filter_fqns], linears,
                                                  "linear layer", cfg.model.flavor, "keep nothing in high precision")]
    if experts:  # a dense flavor has no experts to name (and the default entry, "experts", names none of its layers)
        problems += [problem for name in used if name != "nvfp4"  # NVFP4 keeps the experts in high precision
                     for problem in unmatched_patterns(f"--{name}.moe_fqns_prototype",
                                                       [(entry, entry) for entry in sections[name].moe_fqns_prototype],
                                                       experts, "experts module", cfg.model.flavor,
                                                       "leave every expert in high precision")]
    return problems


def parameter_fqns(cfg: JobConfig) -> list[str]:
    """FQNs of the parameters of --model.flavor, from a build on the meta device (no memory, milliseconds): the names
    the optimizer matches --optimizer.lr_multipliers against (titan/train/optim.py)."""
    with torch.device("meta"):
        model = FAMILIES[cfg.model.name].model(flavor_args(cfg))
    return [name for name, _ in model.named_parameters()]


def about_this_machine(rule: Rule) -> Rule:
    """Mark a rule that checks this machine's files or packages, not the config: a dry run (--job.dry_run) reads no
    files, so validate() skips these rules for it, and --job.print_config shows what they find as warnings. Rules
    about the GPU are HARDWARE_RULES, which check the GPU the dry run simulates."""
    rule.about_this_machine = True  # type: ignore[attr-defined]
    return rule


@about_this_machine
def check_tokenizer_path(cfg: JobConfig, world_size: int) -> str | None:
    if resolve_path(cfg.model.tokenizer_path).is_file():
        return None
    return (f"--model.tokenizer_path {cfg.model.tokenizer_path!r} is not a file. Point it at a tiktoken-format "
            f"tokenizer such as tokenizers/titan_2256.tiktoken or Llama 3's tokenizer.model, or at a Hugging Face "
            f"tokenizer.json such as Qwen3's.")


@about_this_machine
def check_dataset_path(cfg: JobConfig, world_size: int) -> str | None:
    return dataset_path_problem("--training", cfg.training.dataset, cfg.training.dataset_path)


def dataset_path_problem(section: str, dataset: str, dataset_path: str | None) -> str | None:
    """A missing or unmatched `{section}.dataset_path` for `dataset` (the path is unused for shipped)."""
    if dataset == "shipped":
        return None
    if dataset_path is None:
        return (f"{section}.dataset {dataset} needs {section}.dataset_path (files, a folder or a glob; a dataset name "
                f"for hf; a store's folder for prepared).")
    if dataset in ("text", "jsonl", "chat") and not path_matches(dataset_path):
        return f"{section}.dataset_path {dataset_path!r} matches no file or folder. Check the path or glob."
    if dataset == "hf" and not resolve_path(dataset_path).is_dir():
        return hub_dataset_problem(f"{section}.dataset", f"{section}.dataset_path", dataset_path)
    if dataset == "prepared" and not resolve_path(dataset_path).is_dir():
        return (f"{section}.dataset_path {dataset_path!r} is not a folder: --training.dataset prepared reads a token "
                f"store made by `python -m titan.data.prepare`. Check the path, or prepare the store first.")
    return None


def hub_dataset_problem(dataset_flag: str, path_flag: str, name: str) -> str:
    """Hub datasets are too large to tokenize on a job's first start: they are prepared once, on their own."""
    return (f"{dataset_flag} hf {path_flag} {name!r} is not a local folder: a dataset from the Hugging Face hub is "
            f"tokenized once, before training, with `python -m titan.data.prepare --dataset hf --dataset_path {name} "
            f"--out STORE` (needs the `hf` extra and the network), then trained on with --training.dataset prepared "
            f"--training.dataset_path STORE.")


def path_matches(path: str) -> bool:
    return resolve_path(path).exists() or bool(glob.glob(path))


@about_this_machine
def check_mixture_paths(cfg: JobConfig, world_size: int) -> list[str]:
    problems = []
    for text in cfg.training.mixture:
        try:
            entry = parse_mixture_entry(text)
        except ValueError:
            continue  # check_mixture reports it
        if entry.dataset == "hf" and not resolve_path(str(entry.path)).is_dir():
            problems.append(hub_dataset_problem("--training.mixture", "entry", str(entry.path)))
        elif entry.path is not None and not path_matches(entry.path):
            problems.append(f"--training.mixture entry {text!r} has path {entry.path!r}, which matches no file or "
                            f"folder. Check the path or glob.")
    return problems


def dataset_flags(cfg: JobConfig, dataset: str) -> list[str]:
    """The flags that name data of kind `dataset` (chat, prepared, ...), as the user gave them: a mixture's entries
    or --training.dataset, and --validation.dataset where validation runs."""
    flags = []
    if cfg.training.mixture:
        for text in cfg.training.mixture:
            try:
                if parse_mixture_entry(text).dataset == dataset:
                    flags.append(f"--training.mixture entry {text!r}")
            except ValueError:
                continue  # check_mixture reports it
    elif cfg.training.dataset == dataset:
        flags.append(f"--training.dataset {dataset}")
    if cfg.validation.enable and cfg.validation.dataset == dataset:
        flags.append(f"--validation.dataset {dataset}")
    return flags


def data_sources(cfg: JobConfig) -> str:
    """What the run reads, for messages: "--training.dataset shipped", or the mixture."""
    if cfg.training.mixture:
        return f"--training.mixture {' '.join(cfg.training.mixture)}"
    return f"--training.dataset {cfg.training.dataset}"


def check_ignored_dataset_paths(cfg: JobConfig, world_size: int) -> list[str]:
    """A path beside --training.dataset (or --validation.dataset) shipped reads nothing: the run would train on the
    shipped corpus while the user means their files. (Beside a mixture, check_mixture says so.)"""
    problems = []
    for section, settings, read in (("training", cfg.training, not cfg.training.mixture),
                                    ("validation", cfg.validation, cfg.validation.enable)):
        if not read or settings.dataset != "shipped" or settings.dataset_path is None:
            continue
        kind = "chat" if fields_set(cfg.chat) else "jsonl, text, chat, hf or prepared"
        problems.append(f"--{section}.dataset_path {settings.dataset_path!r} is given, but --{section}.dataset shipped "
                        f"reads the shipped corpus and ignores it. Add --{section}.dataset {kind} (what the path "
                        f"holds), or unset the path (--{section}.dataset_path None, where a TOML sets it).")
    return problems


def fields_set(section: object) -> dict[str, object]:
    """The fields of a config section (cfg.chat, cfg.training, ...) set away from their defaults, by name."""
    defaults = type(section)()
    return {item.name: getattr(section, item.name) for item in dataclasses.fields(section)
            if getattr(section, item.name) != getattr(defaults, item.name)}


def check_chat_fields_apply(cfg: JobConfig, world_size: int) -> list[str]:
    """[chat] fields change how conversations are rendered (template_path, messages_field) and which of their tokens
    train (train_on, which also reads the roles of a prepared store of conversations): set in a run that reads no
    conversations, they are ignored."""
    given = fields_set(cfg.chat)
    if not given or dataset_flags(cfg, "chat"):
        return []
    problems = []
    for name, value in given.items():
        if name == "train_on" and dataset_flags(cfg, "prepared"):
            continue  # a prepared store may hold conversations, which train_on then selects tokens of
        stores = " or --training.dataset prepared with a store of them" if name == "train_on" else ""
        problems.append(f"--chat.{name} {value!r} only applies to conversations (--training.dataset chat, a chat: "
                        f"entry of --training.mixture or --validation.dataset chat{stores}), and this run reads none: "
                        f"it trains on {data_sources(cfg)}. Add --training.dataset chat with --training.dataset_path, "
                        f"or drop --chat.{name}.")
    return problems


def check_chat_attention(cfg: JobConfig, world_size: int) -> str | None:
    """Conversations are packed several to a sequence: only block-causal attention keeps them apart."""
    flags = dataset_flags(cfg, "chat")
    if not flags or cfg.model.attn_mask_type == "block_causal":
        return None
    return (f"{' and '.join(flags)} packs conversations into sequences, which needs --model.attn_mask_type "
            f"block_causal to keep each from reading the ones before it (got {cfg.model.attn_mask_type!r}). Use "
            f"block_causal.")


@about_this_machine
def check_chat_template_path(cfg: JobConfig, world_size: int) -> str | None:
    path = cfg.chat.template_path
    if not path or not dataset_flags(cfg, "chat") or resolve_path(path).is_file():
        return None
    return (f"--chat.template_path {path!r} is not a file. Point it at a Jinja chat template or a "
            f"tokenizer_config.json, or leave it empty for the tokenizer's.")


def check_mixture(cfg: JobConfig, world_size: int) -> list[str]:
    t = cfg.training
    problems = []
    sources: list[str] = []
    for text in t.mixture:
        try:
            entry = parse_mixture_entry(text)
        except ValueError as bad:
            problems.append(f"--training.mixture entry {text!r} {bad}")
            continue
        if entry.source in sources:
            problems.append(f"--training.mixture lists {entry.source} twice. Give each source once, with the sum of "
                            f"its weights.")
        sources.append(entry.source)
    defaults = JobConfig().training
    if t.mixture and (t.dataset, t.dataset_path) != (defaults.dataset, defaults.dataset_path):
        given = f"--training.dataset {t.dataset}" + (f" --training.dataset_path {t.dataset_path!r}"
                                                     if t.dataset_path is not None else "")
        source = MixtureEntry(t.dataset, None if t.dataset == "shipped" else t.dataset_path, weight=1.0).source
        as_entry = f", or add it to the mixture as {source}=WEIGHT" if t.dataset in MIXTURE_DATASETS else ""
        problems.append(f"--training.mixture replaces --training.dataset and --training.dataset_path, but {given} is "
                        f"also given. Drop it{as_entry}.")
    return problems


@about_this_machine
def check_dump_folder(cfg: JobConfig, world_size: int) -> str | None:
    """The dump folder must be a folder, or creatable: its nearest existing ancestor a writable folder."""
    given = cfg.job.dump_folder
    folder = Path(given).expanduser().absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    fix = "Choose another --job.dump_folder."
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"is below the file {existing}"
        return f"--job.dump_folder {given!r} {where}, not a folder. {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--job.dump_folder {given!r} can't be written: {existing} is not writable by this user. {fix}"
    return None


def check_time_limit(cfg: JobConfig, world_size: int) -> str | None:
    limit = cfg.job.time_limit
    if limit is None or parse_duration(limit) is not None:
        return None
    return (f"--job.time_limit {limit!r} is not a duration. Write hours, minutes and seconds, larger units first, "
            f"as in 3h50m, 90m, 45s or 1h (a little under the scheduler's limit).")


def check_memory_snapshot(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    if cfg.profiling.enable_memory_snapshot and not accelerator.is_cuda:
        return ("--profiling.enable_memory_snapshot records CUDA allocator history and needs a GPU; none is "
                "visible. Drop the flag, or use --profiling.enable_profiling for CPU traces.")
    return None


def check_lr_multipliers(cfg: JobConfig, world_size: int) -> list[str]:
    problems, entries = [], []
    for text in cfg.optimizer.lr_multipliers:
        try:
            substring, _ = parse_lr_multiplier(text)
        except ValueError:
            problems.append(f"--optimizer.lr_multipliers {text!r} is not FQN_SUBSTRING=FACTOR with a positive "
                            f"FACTOR. Write e.g. tok_embeddings=0.5.")
            continue
        entries.append((text, substring))
    if entries and flavor_args(cfg) is not None:
        problems += unmatched_patterns("--optimizer.lr_multipliers", entries, parameter_fqns(cfg), "parameter",
                                       cfg.model.flavor, "change no learning rate")
    return problems


@about_this_machine
def check_wandb_installed(cfg: JobConfig, world_size: int) -> str | None:
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        return ("--metrics.enable_wandb needs the wandb package, an optional extra: pip install -e \".[wandb]\" (or "
                "pip install wandb). Or drop the flag; metrics.jsonl and --metrics.enable_tensorboard need nothing.")
    return None


@needs_in_range("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree")
def check_degree_product(cfg: JobConfig, world_size: int) -> str | None:
    par = cfg.parallelism
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


def check_pipeline_split_points(cfg: JobConfig, world_size: int) -> str | None:
    par = cfg.parallelism
    points = par.pipeline_parallel_split_points
    if not points or flavor_args(cfg) is None:
        return None
    num_layers = flavor_args(cfg).n_layers
    try:
        layers = split_point_layers(points)
    except ValueError as bad:
        return (f"--parallelism.pipeline_parallel_split_points has {str(bad)!r}: each point names the first block "
                f"of a stage as \"layers.<k>\", e.g. \"layers.{num_layers // 2}\".")
    if layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] >= num_layers:
        return (f"--parallelism.pipeline_parallel_split_points {' '.join(points)} must be increasing block indices "
                f"between layers.1 and layers.{num_layers - 1} (--model.flavor {cfg.model.flavor} has {num_layers} "
                f"blocks), so every stage holds at least one block.")
    return None


@needs_in_range("parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_layers_per_stage")
def check_pipeline_stages(cfg: JobConfig, world_size: int) -> list[str]:
    par = cfg.parallelism
    pp, schedule = par.pipeline_parallel_degree, par.pipeline_parallel_schedule
    if flavor_args(cfg) is None:
        return []
    num_layers = flavor_args(cfg).n_layers
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
                        f"{num_layers} blocks of --model.flavor {cfg.model.flavor}.{hint}")
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
                        f"{cfg.model.flavor} has {num_layers}. Use fewer stages or a deeper flavor.")
    return problems


@needs_in_range("parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_microbatch_size",
                "training.local_batch_size")
def check_pipeline_microbatches(cfg: JobConfig, world_size: int) -> str | None:
    par, local_batch = cfg.parallelism, cfg.training.local_batch_size
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


def check_pipeline_schedule_support(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    par = cfg.parallelism
    if (par.pipeline_parallel_degree > 1 and par.pipeline_parallel_schedule in V_SCHEDULES
            and not accelerator.is_cuda and torch_version() < (2, 13)):
        return (f"--parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule} fails in torch "
                f"{torch.__version__}'s stage setup over gloo (CPU): its first send goes to an unconnected peer "
                f"(seen on torch 2.11). Use torch 2.13 or newer, or another schedule such as InterleavedZeroBubble.")
    return None


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


@needs_in_range("parallelism.context_parallel_degree", "parallelism.tensor_parallel_degree")
def check_context_parallel(cfg: JobConfig, world_size: int) -> str | None:
    par, seq_len = cfg.parallelism, cfg.training.seq_len
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    if cp == 1:
        return None
    if seq_len % (2 * cp) == 0 and (seq_len // cp) % tp == 0:
        return None
    step = 2 * cp * tp // math.gcd(2, tp)  # the smallest length both splits divide
    with_tp = f" (and its 1/{cp} share by --parallelism.tensor_parallel_degree {tp})" if tp > 1 else ""
    return (f"--training.seq_len {seq_len} must be divisible by 2 x --parallelism.context_parallel_degree {cp}"
            f"{with_tp}: context parallel splits each sequence into {2 * cp} load-balanced chunks. Try "
            f"{max(step, seq_len // step * step)}.")


@about_this_machine
def check_validation_dataset_path(cfg: JobConfig, world_size: int) -> str | None:
    v = cfg.validation
    return dataset_path_problem("--validation", v.dataset, v.dataset_path) if v.enable else None


@needs_in_range("validation.local_batch_size", "validation.seq_len", "parallelism.pipeline_parallel_degree")
def check_validation_pipeline(cfg: JobConfig, world_size: int) -> list[str]:
    """The pipeline schedule is built for training's micro-batch shapes, and evaluates through it."""
    v, t, pp = cfg.validation, cfg.training, cfg.parallelism.pipeline_parallel_degree
    if not v.enable or pp == 1:
        return []
    schedule = cfg.parallelism.pipeline_parallel_schedule
    problems = []
    if schedule == "ZBVZeroBubble":
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
def check_validation_seq_len(cfg: JobConfig, world_size: int) -> str | None:
    """At most the length the model's rotary table is built for, and a length context and tensor parallel can
    split. Unset, it is --training.seq_len, which the training rules check."""
    v, par = cfg.validation, cfg.parallelism
    seq_len, training_seq_len = v.seq_len, cfg.training.seq_len
    if not v.enable or seq_len is None:
        return None
    if seq_len > training_seq_len:
        return (f"--validation.seq_len {seq_len} is longer than --training.seq_len {training_seq_len}, the length "
                f"the model's rotary table is built for. Use --validation.seq_len {training_seq_len} or less.")
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    if cp > 1 and (seq_len % (2 * cp) or (seq_len // cp) % tp):
        step = 2 * cp * tp // math.gcd(2, tp)  # the smallest length both splits divide, as in check_context_parallel
        with_tp = f" (and its 1/{cp} share by --parallelism.tensor_parallel_degree {tp})" if tp > 1 else ""
        return (f"--validation.seq_len {seq_len} must be divisible by 2 x --parallelism.context_parallel_degree "
                f"{cp}{with_tp}: context parallel splits each sequence into {2 * cp} load-balanced chunks. Try "
                f"{max(step, seq_len // step * step)}.")
    if cp == 1 and seq_len % tp:
        return (f"--validation.seq_len {seq_len} must be divisible by --parallelism.tensor_parallel_degree {tp} "
                f"(sequence parallel splits it). Try {max(tp, seq_len // tp * tp)}.")
    return None


def check_tensor_parallel_shapes(cfg: JobConfig, world_size: int) -> list[str]:
    tp = cfg.parallelism.tensor_parallel_degree
    if tp <= 1 or flavor_args(cfg) is None:
        return []
    sizes = FAMILIES[cfg.model.name].tensor_parallel_sizes(flavor_args(cfg))
    problems = [f"--parallelism.tensor_parallel_degree {tp} must divide the {what} of --model.flavor "
                f"{cfg.model.flavor} ({size}). Try {largest_divisor_at_most(tp, size, world_size)}."
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


@needs_in_range("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree")
def check_mixture_of_experts(cfg: JobConfig, world_size: int) -> list[str]:
    args, par, model = flavor_args(cfg), cfg.parallelism, cfg.model
    if args is None:
        return []
    moe, ep = getattr(args, "moe", None), par.expert_parallel_degree
    if moe is None:
        problems = []
        if ep > 1:
            problems.append(f"--parallelism.expert_parallel_degree {ep} needs a mixture-of-experts flavor, and "
                            f"--model.name {model.name} --model.flavor {model.flavor} has no experts. Use 1, or "
                            f"{flavors_with(has_experts)}.")
        if cfg.moe.aux_loss_weight > 0:
            problems.append(f"--moe.aux_loss_weight {cfg.moe.aux_loss_weight} only applies to mixture-of-experts "
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
                        f"Try {largest_divisor_at_most(ep, borrowed, moe.num_experts)}.")
    if moe.num_experts % ep:
        problems.append(f"--parallelism.expert_parallel_degree {ep} must divide the {moe.num_experts} experts of "
                        f"--model.flavor {model.flavor}, so every rank holds as many. Try "
                        f"{largest_divisor_at_most(ep, borrowed, moe.num_experts)}.")
    return problems


def check_tied_embeddings(cfg: JobConfig, world_size: int) -> str | None:
    args, pp = flavor_args(cfg), cfg.parallelism.pipeline_parallel_degree
    if args is None or pp == 1 or not getattr(args, "tie_embeddings", False):
        return None
    return (f"--model.flavor {cfg.model.flavor} ties its output layer to the token embedding, which "
            f"--parallelism.pipeline_parallel_degree {pp} would put on different stages. Use "
            f"--parallelism.pipeline_parallel_degree 1 (FSDP and TP keep the tie), or an untied flavor (8B and up).")


def check_multi_token_prediction(cfg: JobConfig, world_size: int) -> list[str]:
    """Multi-token prediction reads the tokens up to mtp_depth places ahead of each position, and runs the embedding
    and the output layer again after the last block."""
    args, par = flavor_args(cfg), cfg.parallelism
    if args is None:
        return []
    if args.mtp_depth == 0:
        if "mtp_loss_weight" not in fields_set(cfg.training):
            return []
        return [f"--training.mtp_loss_weight {cfg.training.mtp_loss_weight} only applies to flavors with multi-token "
                f"prediction modules, and --model.name {cfg.model.name} --model.flavor {cfg.model.flavor} has none. "
                f"Drop it, or use {flavors_with(has_multi_token_prediction)}."]
    problems = []
    if par.pipeline_parallel_degree > 1:
        problems.append(f"--model.flavor {cfg.model.flavor} has multi-token prediction modules, which run the "
                        f"embedding and the output layer after the last block: --parallelism.pipeline_parallel_degree "
                        f"{par.pipeline_parallel_degree} puts those on different stages. Use 1, or a flavor without "
                        f"MTP (debugmodel, 671B).")
    if par.context_parallel_degree > 1:
        problems.append(f"--model.flavor {cfg.model.flavor} has multi-token prediction modules, which read the "
                        f"tokens ahead of each position: --parallelism.context_parallel_degree "
                        f"{par.context_parallel_degree} puts them on other ranks. Use 1, or a flavor without MTP "
                        f"(debugmodel, 671B).")
    return problems


def check_async_tp(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    par = cfg.parallelism
    if not par.enable_async_tensor_parallel:
        return None
    if (par.tensor_parallel_degree <= 1 or not cfg.compile.enable or cfg.compile.backend != "inductor"
            or not accelerator.is_cuda):
        return ("--parallelism.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree above 1, "
                "--compile.enable with --compile.backend inductor, and CUDA GPUs (it is an inductor pass over NCCL "
                "symmetric memory). Drop the flag, or add the missing ones.")
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
    if f8.enable_fsdp_float8_all_gather and cfg.training.enable_cpu_offload:
        # On CUDA, FSDP pins each offloaded shard: a copy, which drops the all-gather's weight wrapper
        # (torch 2.13's FSDPParam.reset_sharded_param), so the all-gather would silently run in high precision.
        problems.append("--float8.enable_fsdp_float8_all_gather does not combine with --training.enable_cpu_offload "
                        "(FSDP's copy of the offloaded shards into pinned memory drops the float8 all-gather). Turn "
                        "one of them off.")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        problems.append("--float8.precompute_float8_dynamic_scale_for_fsdp needs "
                        "--float8.enable_fsdp_float8_all_gather (it precomputes the all-gather's scales). Add it or "
                        "drop the precompute flag.")
    return problems


def check_float8_hardware(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    if "float8" not in cfg.model.converters or cfg.float8.emulate or not accelerator.is_cuda:
        return None
    if accelerator.capability >= FLOAT8_MIN_CAPABILITY:
        return None
    return (f"--model.converters float8 needs a GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{accelerator.describe()}. Add --float8.emulate to run the same quantization with high-precision "
            f"matmuls.")


def converts_experts(cfg: JobConfig, converter: str, moe_fqns: list[str]) -> bool:
    """Whether `converter` (float8 or mx, natively) takes experts: a mixture-of-experts flavor and experts named."""
    return (converter in cfg.model.converters and not getattr(cfg, converter).emulate and bool(moe_fqns)
            and has_experts(flavor_args(cfg)))


def check_float8_experts_hardware(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    """Float8 experts multiply with torch._scaled_grouped_mm, whose float8 kernel runs on Hopper alone, and which has
    none for the CPU (the dense float8 linears' torch._scaled_mm runs from Ada on, and on the CPU)."""
    f8 = cfg.float8
    if not converts_experts(cfg, "float8", f8.moe_fqns_prototype):
        return None
    if accelerator.is_cuda and accelerator.capability[0] in FLOAT8_GROUPED_MAJORS:
        return None
    blackwell = (" On this Blackwell GPU, convert the experts with --model.converters mx (MXFP8 grouped matmuls) "
                 "instead." if accelerator.is_cuda and accelerator.capability[0] in MX_GROUPED_MAJORS else "")
    return (f"--model.converters float8 converts the experts of --model.flavor {cfg.model.flavor} (--float8."
            f"moe_fqns_prototype {' '.join(f8.moe_fqns_prototype)}) to float8 grouped matmuls, which torch 2.11 to "
            f"2.13 run natively only on NVIDIA Hopper GPUs (compute capability 9.x: H100, H200); "
            f"{accelerator.describe()}.{blackwell} Add --float8.emulate to run the same quantization with "
            f"high-precision matmuls, or pass --float8.moe_fqns_prototype with no value to keep the experts in high "
            f"precision.")


@needs_in_range("training.local_batch_size", "training.seq_len", "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_microbatch_size", "parallelism.context_parallel_degree",
                "parallelism.tensor_parallel_degree")
def check_float8_tokens(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    """CUDA's float8 matmuls need each dim divisible by 16. The weight-gradient matmul (grad_output^T @ input)
    contracts over the tokens of one backward: under PP a pipeline micro-batch's, under CP this rank's 1/cp share
    of each sequence. CPU's _scaled_mm takes any size."""
    if "float8" not in cfg.model.converters or cfg.float8.emulate or not accelerator.is_cuda:
        return None
    t, par = cfg.training, cfg.parallelism
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    if par.pipeline_parallel_degree > 1:
        batch_flag, batch = "--parallelism.pipeline_parallel_microbatch_size", par.pipeline_parallel_microbatch_size
    else:
        batch_flag, batch = "--training.local_batch_size", t.local_batch_size
    tokens = batch * t.seq_len // cp
    if tokens % 16 == 0:
        return None
    per_rank = f" / --parallelism.context_parallel_degree {cp}" if cp > 1 else ""
    # Lengths that give a multiple of 16 tokens and that context parallel (2 x cp chunks) and the sequence-parallel
    # split of each rank's share by tp still divide.
    step = math.lcm(cp * 16 // math.gcd(16, batch), 2 * cp if cp > 1 else 1, cp * tp)
    return (f"{batch_flag} {batch} x --training.seq_len {t.seq_len}{per_rank} = {tokens} tokens reach each float8 "
            f"weight-gradient matmul, which contracts over them, and CUDA's float8 matmuls need a multiple of 16. Try "
            f"--training.seq_len {max(step, t.seq_len // step * step)}, or --float8.emulate.")


def check_resharded_experts_under_recording_checkpoints(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    """Under pipeline parallel the schedule keeps FSDP units gathered after each micro-batch's backward but the last:
    experts resharded after every forward (always) are then gathered in a later micro-batch's recompute and not in
    its forward, inside a block that selective checkpointing records op by op, which torch 2.13 refuses at the first
    backward (titan/parallel/fsdp.py reshard_experts_after_forward)."""
    par, ac = cfg.parallelism, cfg.activation_checkpoint
    if par.fsdp_reshard_after_forward != "always" or par.pipeline_parallel_degree == 1:
        return None
    if par.expert_parallel_degree == 1 or not has_experts(flavor_args(cfg)):
        return None
    keep_attention = keeps_attention(ac.save_attention, cfg.compile.enable, accelerator.is_cuda)
    if not records_ops(ac.mode, ac.selective_ac_option, keep_attention):
        return None
    return (f"--parallelism.fsdp_reshard_after_forward always reshards the experts (an FSDP unit inside each block "
            f"under --parallelism.expert_parallel_degree {par.expert_parallel_degree}) after every forward, which "
            f"--parallelism.pipeline_parallel_degree {par.pipeline_parallel_degree} makes a later micro-batch's "
            f"recompute gather again, and --activation_checkpoint.mode {ac.mode} records each block's ops to replay "
            f"them (torch 2.13 refuses the extra gather). Use --parallelism.fsdp_reshard_after_forward default, or "
            f"--activation_checkpoint.no_save_attention (full AC, or selective with a block count).")


def check_flex_attention_device(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    if cfg.model.attn_backend != "flex" or accelerator.is_cuda:
        return None
    return ("--model.attn_backend flex needs a CUDA GPU: torch has no FlexAttention backward on CPU. Use "
            f"--model.attn_backend sdpa, which masks {cfg.model.attn_mask_type} attention on any device.")


def check_nvfp4(cfg: JobConfig, world_size: int) -> list[str]:
    """NVFP4 takes every eligible linear (no filter splits layers between it and float8 or mx), and its per-tensor
    scales need the whole tensor's amax, which a tensor-parallel shard does not see."""
    if "nvfp4" not in cfg.model.converters:
        return []
    problems = []
    others = [name for name in ("float8", "mx") if name in cfg.model.converters]
    if others:
        problems.append(f"--model.converters nvfp4 does not combine with {' and '.join(others)} in one run. Use "
                        f"nvfp4 alone for the dense linears, or {' or '.join(others)} for the linears and the "
                        f"experts.")
    tp = cfg.parallelism.tensor_parallel_degree
    if tp > 1:
        problems.append(f"--model.converters nvfp4 does not combine with --parallelism.tensor_parallel_degree {tp}: "
                        f"its per-tensor scales need each tensor's whole amax, which a TP shard does not hold. Use "
                        f"data parallel (FSDP) instead, or --model.converters mx.")
    return problems


def blackwell_problem(converter: str, blocks: str, accelerator: Accelerator) -> str | None:
    """The problem with running `--model.converters converter` natively on `accelerator`, whose block-scaled
    (`blocks`) matmuls need Blackwell, or None where they run."""
    if accelerator.is_cuda and accelerator.capability >= MX_MIN_CAPABILITY:
        return None
    or_simulate = ", or dry-run with --estimate.gpu B200" if accelerator.simulated else ""
    return (f"--model.converters {converter} runs natively only on NVIDIA GPUs with compute capability 10.0 or newer "
            f"(Blackwell: B200, GB200, B300), whose tensor cores multiply {blocks} blocks; {accelerator.describe()}. "
            f"Add --{converter}.emulate to run the same {blocks} quantization with high-precision matmuls (correct "
            f"numerics, no speed-up){or_simulate}.")


def check_nvfp4_hardware(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    if "nvfp4" not in cfg.model.converters or cfg.nvfp4.emulate:
        return None
    return blackwell_problem("nvfp4", "NVFP4", accelerator)


def check_mx_hardware(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    """MX linears run on every Blackwell GPU; MX experts (torch._scaled_grouped_mm) on data-center Blackwell alone."""
    if "mx" not in cfg.model.converters or cfg.mx.emulate:
        return None
    problem = blackwell_problem("mx", "MX", accelerator)
    if problem is not None or not converts_experts(cfg, "mx", cfg.mx.moe_fqns_prototype):
        return problem
    if accelerator.capability[0] in MX_GROUPED_MAJORS:
        return None
    return (f"--model.converters mx converts the experts of --model.flavor {cfg.model.flavor} (--mx.moe_fqns_prototype "
            f"{' '.join(cfg.mx.moe_fqns_prototype)}) to MXFP8 grouped matmuls, which torch 2.11 to 2.13 run natively "
            f"only on GPUs of compute capability 10.x (B200, GB200, B300); {accelerator.describe()}. Add --mx.emulate "
            f"to run the same quantization with high-precision matmuls, or pass --mx.moe_fqns_prototype with no value "
            f"to keep the experts in high precision (the linears still convert).")


def check_checkpoint(cfg: JobConfig, world_size: int) -> list[str]:
    ckpt = cfg.checkpoint
    problems = []
    urls = [(name, url) for name, url in (("folder", ckpt.folder), ("initial_load_path", ckpt.initial_load_path))
            if url is not None and is_url(url)]
    unknown = [part for part in ckpt.exclude_from_loading if part not in CHECKPOINT_PARTS]
    if unknown:
        problems.append(f"--checkpoint.exclude_from_loading has unknown part(s) {', '.join(map(repr, unknown))}. "
                        f"Parts: {', '.join(CHECKPOINT_PARTS)}.")
    if ckpt.create_seed_checkpoint and (world_size != 1 or not ckpt.enable):
        problems.append(f"--checkpoint.create_seed_checkpoint writes the initial weights from one process into "
                        f"--checkpoint.folder: run it with --checkpoint.enable and NGPU=1 "
                        f"(world size is {world_size}).")
    if ckpt.initial_load_in_hf and ckpt.initial_load_path is None:
        problems.append("--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path, the Hugging Face folder "
                        "to load.")
    if ckpt.last_save_in_hf and not ckpt.enable:
        problems.append("--checkpoint.last_save_in_hf exports the last step's checkpoint, but --checkpoint.enable is "
                        "off, so no checkpoint is written. Add --checkpoint.enable.")
    problems += [f"--checkpoint.{name} {url!r}: {problem}" for name, url in urls if (problem := missing_backend(url))]
    initial = ckpt.initial_load_path
    if initial is not None and is_url(initial) and ckpt.initial_load_in_hf:
        problems.append(f"--checkpoint.initial_load_path {initial!r} with --checkpoint.initial_load_in_hf: "
                        f"Hugging Face folders are read from a local (or shared) filesystem only. Copy it there first "
                        f"(aws s3 cp --recursive, gcloud storage cp -r) and pass that folder.")
    return problems


@about_this_machine
def check_initial_load_path(cfg: JobConfig, world_size: int) -> str | None:
    initial = cfg.checkpoint.initial_load_path
    if initial is None or is_url(initial) or os.path.isdir(initial):
        return None
    return (f"--checkpoint.initial_load_path {initial!r} is not a folder. Give a checkpoint step folder (e.g. "
            f"outputs/checkpoint/step-1000, or s3://bucket/run/step-1000), a run's checkpoint folder (its latest "
            f"step: outputs/debug_model/checkpoint after `./run_train.sh --checkpoint.enable`) or a Hugging Face "
            f"model folder.")


def check_pinned_memory_checkpoint(cfg: JobConfig, accelerator: Accelerator) -> str | None:
    if cfg.checkpoint.async_mode == "async_with_pinned_mem" and not accelerator.is_cuda:
        return ("--checkpoint.async_mode async_with_pinned_mem copies device tensors into pinned host memory, which "
                "needs CUDA GPUs. Use --checkpoint.async_mode async on this machine.")
    return None


def check_spike_rollback(cfg: JobConfig, world_size: int) -> str | None:
    if cfg.training.on_spike == "rollback" and not cfg.checkpoint.enable:
        return ("--training.on_spike rollback reloads the last checkpoint, but --checkpoint.enable is off, so there "
                "is none to reload. Add --checkpoint.enable (and a --checkpoint.interval to roll back to), or use "
                "--training.on_spike skip.")
    return None


def check_fault(cfg: JobConfig, world_size: int) -> list[str]:
    fault, problems = cfg.fault, []
    if fault.kind in ("none", "random"):
        return problems
    if fault.step == 0 and fault.after_seconds == 0:
        problems.append(f"--fault.kind {fault.kind} needs a time to strike: --fault.step (the end of that step) or "
                        f"--fault.after_seconds (after the first step). Try --fault.step 5.")
    if fault.step > cfg.training.steps:
        problems.append(f"--fault.step {fault.step} is after the run's last step (--training.steps "
                        f"{cfg.training.steps}), so the fault would never strike. Try --fault.step "
                        f"{max(1, cfg.training.steps // 2)}.")
    if fault.rank >= world_size:
        problems.append(f"--fault.rank {fault.rank} is not a rank of this job (ranks 0 to {world_size - 1}). Try "
                        f"--fault.rank {world_size - 1}.")
    if fault.kind == "storage" and not cfg.checkpoint.enable:
        problems.append("--fault.kind storage makes checkpoint saves fail, but --checkpoint.enable is off. Add "
                        "--checkpoint.enable.")
    if fault.kind == "storage" and is_url(cfg.checkpoint.folder):
        problems.append(f"--fault.kind storage swaps a local --checkpoint.folder for a file; "
                        f"{cfg.checkpoint.folder!r} is on object storage, whose outage Titan cannot cause. Make the "
                        f"server refuse requests instead (the tests' S3 server: tests/harness/s3_server.py), or use "
                        f"a local folder.")
    return problems


def has_experts(args: object) -> bool:
    """Whether a flavor's args hold a mixture of experts."""
    return getattr(args, "moe", None) is not None


def has_multi_token_prediction(args: object) -> bool:
    return args.mtp_depth > 0


def flavors_with(trait: Callable[[object], bool]) -> str:
    """The registered flavors whose args have `trait`, for messages: "--model.name qwen3 --model.flavor
    debugmodel_moe, 30B-A3B or 235B-A22B; or --model.name deepseek_v3 ..."."""
    choices = []
    for name, family in FAMILIES.items():
        flavors = [flavor for flavor, args in family.flavors.items() if trait(args)]
        if flavors:
            listed = flavors[0] if len(flavors) == 1 else f"{', '.join(flavors[:-1])} or {flavors[-1]}"
            choices.append(f"--model.name {name} --model.flavor {listed}")
    return "; or ".join(choices)


def check_hugging_face_class(cfg: JobConfig, world_size: int) -> str | None:
    """An export (or import) of a flavor that no transformers class holds would fail at the last save, after all of
    the training, having replaced the last checkpoint (or at the start, for the import): refused now instead."""
    ckpt, args = cfg.checkpoint, flavor_args(cfg)
    flags = [flag for flag, on in (("--checkpoint.last_save_in_hf", ckpt.last_save_in_hf),
                                   ("--checkpoint.initial_load_in_hf", ckpt.initial_load_in_hf)) if on]
    if not flags or args is None:
        return None
    try:
        FAMILIES[cfg.model.name].hf_mapping(args)
    except ValueError as error:
        return (f"{' and '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a Hugging Face class for "
                f"--model.name {cfg.model.name} --model.flavor {cfg.model.flavor}, and there is none: {error} Or drop "
                f"{' and '.join(flags)}.")
    return None


def largest_divisor_at_most(limit: int, *sizes: int) -> int:
    """The largest degree up to `limit` that divides every one of `sizes` (a shape and the world size)."""
    return max(d for d in range(1, limit + 1) if all(size % d == 0 for size in sizes))


RULES: tuple[Rule, ...] = (
    check_flavor, check_mixture_of_experts, check_tied_embeddings, check_multi_token_prediction, check_seq_len,
    check_global_batch, check_converters, check_converter_filters, check_nvfp4, check_tokenizer_path,
    check_dataset_path, check_dump_folder, check_lr_multipliers, check_wandb_installed, check_degree_product,
    check_pipeline_split_points, check_pipeline_stages, check_pipeline_microbatches, check_context_parallel,
    check_tensor_parallel_shapes, check_selective_ac_option, check_float8_all_gather, check_checkpoint,
    check_spike_rollback, check_time_limit, check_mixture, check_mixture_paths, check_validation_dataset_path,
    check_validation_pipeline, check_validation_seq_len, check_fault, check_chat_attention, check_chat_template_path,
    check_initial_load_path, check_ignored_dataset_paths, check_chat_fields_apply, check_hugging_face_class,
)
HARDWARE_RULES: tuple[HardwareRule, ...] = (
    check_memory_snapshot, check_pipeline_schedule_support, check_async_tp, check_float8_hardware,
    check_float8_tokens, check_float8_experts_hardware, check_mx_hardware, check_nvfp4_hardware,
    check_flex_attention_device, check_pinned_memory_checkpoint, check_resharded_experts_under_recording_checkpoints,
)


def validate(cfg: JobConfig, world_size: int, accelerator: Accelerator | None = None) -> None:
    """Raise one ConfigError listing every problem in `cfg` for a run of `world_size` processes on `accelerator`
    (default: the one the config targets, target_accelerator: the simulated --estimate.gpu for a dry run, else this
    machine's GPU or CPU). With --job.print_config only the config's own problems raise: the job is printed, not
    run, and this machine's problems follow it as warnings (titan/config/print_config.py)."""
    problems, on_this_machine = find_problems(cfg, world_size, accelerator)
    if not cfg.job.print_config:
        problems += on_this_machine
    if problems:
        raise ConfigError(problems)


def find_problems(cfg: JobConfig, world_size: int, accelerator: Accelerator | None = None
                  ) -> tuple[list[str], list[str]]:
    """(the config's own problems, those of running it on this machine: files and packages it lacks, and what its
    GPU or CPU can't do). A dry run reads no files, and the GPU it simulates is part of its config."""
    if accelerator is None:
        accelerator = target_accelerator(cfg.job.dry_run, cfg.estimate.gpu)
    problems, bad_fields = check_domains(cfg)
    on_this_machine: list[str] = []
    for rule in RULES:
        if bad_fields.intersection(getattr(rule, "needs_in_range", ())):
            continue
        if not getattr(rule, "about_this_machine", False):
            problems += found_problems(rule(cfg, world_size))
        elif not cfg.job.dry_run:
            on_this_machine += found_problems(rule(cfg, world_size))
    for hardware_rule in HARDWARE_RULES:
        if not bad_fields.intersection(getattr(hardware_rule, "needs_in_range", ())):
            found = found_problems(hardware_rule(cfg, accelerator))
            (problems if cfg.job.dry_run else on_this_machine).extend(found)
    return problems, on_this_machine


def found_problems(found: str | list[str] | None) -> list[str]:
    """A rule's result as a list of problem lines."""
    if isinstance(found, str):
        return [found]
    return list(found or [])
