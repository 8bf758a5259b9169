"""Validation: every stage's config rules, run once right after parsing and before any model or process-group work.

First every numeric field against the range its type declares (titan/config/domain.py), then the cross-field rules
that live beside their stages (titan/config/rule.py says what a rule is). validate() runs all of them and raises a
single ConfigError listing every problem, so a user fixes them in one go. This module sits above the stages it
gathers; nothing imports it at run time.
"""

import inspect
from collections.abc import Mapping

from titan.checkpoint.rules import (
    check_checkpoint,
    check_hugging_face_class,
    check_initial_load_path,
    check_pinned_memory_checkpoint,
)
from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.load import parse_args
from titan.config.rule import Rule, check_domains, found_problems
from titan.data.rules import (
    check_chat_attention,
    check_chat_fields_apply,
    check_chat_template_path,
    check_dataset_path,
    check_ignored_dataset_paths,
    check_mixture,
    check_mixture_paths,
    check_tokenizer_path,
    check_validation_dataset_path,
)
from titan.hardware import Accelerator, target_accelerator
from titan.metrics.rules import check_memory_snapshot, check_wandb_installed
from titan.parallel.rules import (
    check_async_tp,
    check_context_parallel,
    check_degree_product,
    check_mixture_of_experts,
    check_pipeline_microbatches,
    check_pipeline_schedule_support,
    check_pipeline_split_points,
    check_pipeline_stages,
    check_resharded_experts_under_recording_checkpoints,
    check_selective_ac_option,
    check_tensor_parallel_shapes,
    check_tied_embeddings,
)
from titan.quant.rules import (
    check_converter_filters,
    check_converters,
    check_float8_all_gather,
    check_float8_blockwise_options,
    check_float8_experts_hardware,
    check_float8_hardware,
    check_float8_tokens,
    check_mx_hardware,
    check_nvfp4,
    check_nvfp4_hardware,
)
from titan.train.rules import (
    check_dump_folder,
    check_fault,
    check_flavor,
    check_flex_attention_device,
    check_global_batch,
    check_lr_multipliers,
    check_multi_token_prediction,
    check_muon,
    check_seq_len,
    check_spike_rollback,
    check_time_limit,
    check_validation_pipeline,
    check_validation_seq_len,
)

RULES: tuple[Rule, ...] = (
    check_flavor, check_mixture_of_experts, check_tied_embeddings, check_multi_token_prediction, check_seq_len,
    check_global_batch, check_converters, check_converter_filters, check_nvfp4, check_tokenizer_path,
    check_dataset_path, check_dump_folder, check_lr_multipliers, check_muon, check_wandb_installed,
    check_degree_product, check_pipeline_split_points, check_pipeline_stages, check_pipeline_microbatches,
    check_context_parallel, check_tensor_parallel_shapes, check_selective_ac_option, check_float8_all_gather,
    check_float8_blockwise_options, check_checkpoint, check_spike_rollback, check_time_limit, check_mixture,
    check_mixture_paths, check_validation_dataset_path, check_validation_pipeline, check_validation_seq_len,
    check_fault, check_chat_attention, check_chat_template_path, check_initial_load_path, check_ignored_dataset_paths,
    check_chat_fields_apply, check_hugging_face_class,
    # Hardware rules, about the accelerator the job runs on: this machine's, or the GPU a dry run simulates.
    check_memory_snapshot, check_pipeline_schedule_support, check_async_tp, check_float8_hardware, check_float8_tokens,
    check_float8_experts_hardware, check_mx_hardware, check_nvfp4_hardware, check_flex_attention_device,
    check_pinned_memory_checkpoint, check_resharded_experts_under_recording_checkpoints,
)
"""Every cross-field rule, in the order their problems are listed."""


def load_job_config(argv: list[str], world_size: int) -> JobConfig:
    """The validated JobConfig for `argv` (without the program name) in a run of `world_size` processes: the one way
    a JobConfig is made from command-line arguments."""
    cfg = parse_args(argv)
    validate(cfg, world_size)
    return cfg


def validate(cfg: JobConfig, world_size: int, accelerator: Accelerator | None = None) -> None:
    """Raise one ConfigError listing every problem in `cfg` for a run of `world_size` processes on `accelerator`
    (default: the one the config targets, target_accelerator: the simulated --estimate.gpu for a dry run, else this
    machine's GPU or CPU). With --job.print_config only the config's own problems raise: the job is printed, not
    run, and this machine's problems follow it as warnings (titan/dry_run.py print_config)."""
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
        about_this_machine = getattr(rule, "about_this_machine", False)
        if about_this_machine and cfg.job.dry_run:
            continue
        parameters = inspect.signature(rule).parameters
        found = run_rule(rule, parameters, cfg, world_size, accelerator)
        if "accelerator" in parameters:  # the simulated GPU is part of a dry run's config
            (problems if cfg.job.dry_run else on_this_machine).extend(found)
        else:
            (on_this_machine if about_this_machine else problems).extend(found)
    return problems, on_this_machine


def run_rule(rule: Rule, parameters: Mapping[str, inspect.Parameter], cfg: JobConfig, world_size: int,
             accelerator: Accelerator) -> list[str]:
    """`rule`'s problems with `cfg`: each of its `parameters` is a section of `cfg` by name, or `world_size` or
    `accelerator`."""
    given = {"world_size": world_size, "accelerator": accelerator}
    return found_problems(rule(**{name: given[name] if name in given else getattr(cfg, name) for name in parameters}))
