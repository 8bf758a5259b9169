"""A sweep of bad inputs, as a new user makes them: every one exits 2 with a message naming the field, flag,
variable or path to fix, and no traceback.

Flag, TOML, file and checkpoint mistakes run train.py's main() in this process (the same handler a rank runs);
launcher environment mistakes, one mistake of each kind and a rank-dependent data mistake run ./run_train.sh for
real.
"""

import dataclasses
import gzip
import json
import logging
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from titan.config.domain import field_ranges
from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.load import parse_args
from titan.launch import read_max_restarts
from titan.models.llama import LLAMA3_FLAVORS, Transformer
from titan.parallel.ac import apply_ac
from titan.train.optim import parameter_groups

from harness.train_script import TRAIN, run_train

ROOT = Path(__file__).resolve().parents[1]

# Small enough that a case which gets as far as building the model takes about a second.
TINY = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1",
        "--lr_scheduler.warmup_steps", "1"]


@dataclass
class Case:
    """Arguments (where "{tmp}" is the test's folder), files to create there first, and the text the message must
    hold. `world_size` is the WORLD_SIZE the run sees (only validation runs, so no process group is needed);
    `marks` are the case's pytest marks."""

    args: list[str]
    expected: str
    files: dict[str, bytes] = field(default_factory=dict)
    world_size: int = 1
    marks: tuple[pytest.MarkDecorator, ...] = ()


WITHOUT_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake is asking for a GPU feature on a "
                                                                   "machine without a CUDA GPU; this one has one")


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def flag(name: str, value: str) -> Case:
    """A single flag whose value is out of its domain; the message must name the flag."""
    return Case([f"--{name}", value], f"--{name}")


def toml(text: bytes, expected: str) -> Case:
    return Case(["--job.config_file", "{tmp}/job.toml"], expected, files={"job.toml": text})


LONG_TEXT = "Titan reads this sentence many times over. " * 40


def chats(*conversations: list[tuple[str, str]]) -> bytes:
    """A chat JSONL file: one row of {role, content} messages per conversation."""
    return "".join(json.dumps({"messages": [{"role": role, "content": content} for role, content in conversation]})
                   + "\n" for conversation in conversations).encode()


# Conversations whose question fills TINY's window (32 + 1 tokens) before the answer starts.
LONG_PROMPTS = chats(*[[("user", LONG_TEXT), ("assistant", f"Answer {i}.")] for i in range(3)])

CASES: dict[str, Case] = {
    # [job] and the TOML file itself
    "dump_folder_is_file": Case(["--job.dump_folder", "{tmp}/taken"], "--job.dump_folder", files={"taken": b"x"}),
    "dump_folder_below_file": Case(["--job.dump_folder", "{tmp}/taken/run"], "--job.dump_folder",
                                   files={"taken": b"x"}),
    "config_file_missing": Case(["--job.config_file", "{tmp}/missing.toml"], "--job.config_file"),
    "config_file_is_folder": Case(["--job.config_file", "{tmp}"], "is a folder"),
    "toml_latin1": toml(b"[training]\nsteps = 2 # caf\xe9\n", "not UTF-8"),
    "toml_random_bytes": toml(bytes(range(128, 256)), "not UTF-8"),
    "toml_syntax": toml(b"[training\nsteps = 2\n", "job.toml is not valid TOML"),
    "toml_unknown_section": toml(b"[trainer]\nsteps = 2\n", "unknown section [trainer]"),
    "toml_unknown_key": toml(b"[training]\nstepz = 2\n", "unknown key 'stepz'"),
    "toml_wrong_type": toml(b'[training]\nsteps = "ten"\n', "[training] steps"),
    "toml_wrong_bool": toml(b"[training]\ncompile = 1\n", "[training] compile"),
    "toml_value_not_table": toml(b"training = 3\n", "training must be a table"),
    "toml_list_of_numbers": toml(b"[model]\nconverters = [1]\n", "[model] converters"),
    "toml_out_of_range": toml(b"[optimizer]\nlr = -1.0\n", "--optimizer.lr"),
    "toml_number_beyond_float": toml(b"[optimizer]\nlr = 1" + b"0" * 400 + b"\n", "[optimizer] lr"),
    "toml_bad_choice": toml(b'[model]\nflavor = "9B"\n', "[model] flavor"),
    "job_description_without_value": Case(["--job.description"], "--job.description"),
    # [model]
    "flavor_unknown": flag("model.flavor", "9B"),
    "model_name_unknown": flag("model.name", "gpt2"),
    "tokenizer_missing": Case(["--model.tokenizer_path", "{tmp}/none.tiktoken"], "--model.tokenizer_path"),
    "tokenizer_is_folder": Case(["--model.tokenizer_path", "{tmp}"], "--model.tokenizer_path"),
    "tokenizer_garbage": Case(["--model.tokenizer_path", "{tmp}/bad.tiktoken"], "--model.tokenizer_path",
                              files={"bad.tiktoken": b"not a tokenizer\n"}),
    "vocab_multiple_zero": flag("model.vocab_size_multiple_of", "0"),
    "vocab_multiple_negative": flag("model.vocab_size_multiple_of", "-64"),
    "vocab_multiple_not_int": flag("model.vocab_size_multiple_of", "6.4"),
    "converter_unknown": flag("model.converters", "int3"),
    # [optimizer]
    "lr_negative": flag("optimizer.lr", "-1"),
    "lr_zero": flag("optimizer.lr", "0"),
    "lr_nan": flag("optimizer.lr", "nan"),
    "lr_inf": flag("optimizer.lr", "inf"),
    "lr_not_number": flag("optimizer.lr", "fast"),
    "beta1_above_one": flag("optimizer.beta1", "1.5"),
    "beta1_negative": flag("optimizer.beta1", "-0.1"),
    "beta2_one": flag("optimizer.beta2", "1.0"),
    "beta2_nan": flag("optimizer.beta2", "nan"),
    "eps_negative": flag("optimizer.eps", "-1e-8"),
    "eps_zero": flag("optimizer.eps", "0"),
    "weight_decay_negative": flag("optimizer.weight_decay", "-0.1"),
    "weight_decay_inf": flag("optimizer.weight_decay", "inf"),
    "optimizer_unknown": flag("optimizer.name", "SGD"),
    "optimizer_implementation_unknown": flag("optimizer.implementation", "cuda"),
    "lr_multiplier_matches_nothing": Case(["--optimizer.lr_multipliers", "tok_embeddings=0.5", "embedding.tok=2"],
                                          "--optimizer.lr_multipliers 'embedding.tok=2' matches no parameter"),
    "lr_multiplier_renamed_layer": Case(["--optimizer.lr_multipliers", "lm_head=0.5"],
                                        "--optimizer.lr_multipliers 'lm_head=0.5' matches no parameter"),
    "muon_adamw_fqns_typo": Case(["--optimizer.name", "Muon", "--optimizer.adamw_fqns", "attention.wz"],
                                 "--optimizer.adamw_fqns 'attention.wz' matches no parameter"),
    # [lr_scheduler]
    "warmup_negative": flag("lr_scheduler.warmup_steps", "-1"),
    "warmup_fractional": flag("lr_scheduler.warmup_steps", "1.5"),
    "decay_ratio_above_one": flag("lr_scheduler.decay_ratio", "1.5"),
    "decay_ratio_negative": flag("lr_scheduler.decay_ratio", "-0.1"),
    "decay_ratio_nan": flag("lr_scheduler.decay_ratio", "nan"),
    "decay_type_unknown": flag("lr_scheduler.decay_type", "exp"),
    "min_lr_factor_above_one": flag("lr_scheduler.min_lr_factor", "5"),
    "min_lr_factor_negative": flag("lr_scheduler.min_lr_factor", "-1"),
    # [training]
    "steps_zero": flag("training.steps", "0"),
    "steps_negative": flag("training.steps", "-3"),
    "steps_not_int": flag("training.steps", "ten"),
    "local_batch_zero": flag("training.local_batch_size", "0"),
    "seq_len_zero": flag("training.seq_len", "0"),
    "seq_len_too_long": flag("training.seq_len", "999999"),
    "global_batch_not_multiple": flag("training.global_batch_size", "13"),
    "global_batch_zero": flag("training.global_batch_size", "0"),
    "global_batch_minus_two": flag("training.global_batch_size", "-2"),
    "max_norm_nan": flag("training.max_norm", "nan"),
    "max_norm_inf": flag("training.max_norm", "inf"),
    "seed_negative": flag("training.seed", "-1"),
    "seed_above_64_bits": flag("training.seed", str(2**64)),
    "seed_huge": flag("training.seed", "99999999999999999999999"),
    "seed_400_digits": flag("training.seed", "9" * 400),  # too large to compare as a float
    "precision_float16": flag("training.mixed_precision_param", "float16"),
    "reduce_precision_unknown": flag("training.mixed_precision_reduce", "fp8"),
    "dataset_unknown": flag("training.dataset", "c4"),
    "dataset_text_without_path": Case(["--training.dataset", "text"], "--training.dataset_path"),
    "dataset_path_missing": Case(["--training.dataset", "text", "--training.dataset_path", "{tmp}/none.txt"],
                                 "--training.dataset_path"),
    "dataset_folder_without_files": Case(["--training.dataset", "jsonl", "--training.dataset_path", "{tmp}/data"],
                                         "--training.dataset_path", files={"data/readme.md": b"x"}),
    "dataset_glob_matches_nothing": Case(["--training.dataset", "text", "--training.dataset_path", "{tmp}/*.none"],
                                         "--training.dataset_path"),
    "dataset_empty_file": Case(["--training.dataset", "text", "--training.dataset_path", "{tmp}/empty.txt"],
                               "--training.dataset_path", files={"empty.txt": b""}),
    "dataset_too_short": Case(["--training.dataset", "text", "--training.dataset_path", "{tmp}/short.txt"],
                              "--training.seq_len", files={"short.txt": b"hi"}),
    "dataset_path_beside_shipped": Case(["--training.dataset_path", "{tmp}/chats.jsonl", "--chat.train_on",
                                         "last_assistant"], "chats.jsonl' is given, but --training.dataset shipped "
                                        "reads the shipped corpus and ignores it", files={"chats.jsonl": LONG_PROMPTS}),
    "chat_train_on_without_conversations": Case(["--chat.train_on", "last_assistant"],
                                                "--chat.train_on 'last_assistant' only applies to conversations"),
    "chat_every_conversation_dropped": Case(["--training.dataset", "chat", "--training.dataset_path",
                                             "{tmp}/chats.jsonl"], "all 3 would be dropped",
                                            files={"chats.jsonl": LONG_PROMPTS}),
    "dataset_text_not_utf8": Case(["--training.dataset", "text", "--training.dataset_path", "{tmp}/l1.txt"],
                                  "l1.txt", files={"l1.txt": b"caf\xe9 " * 100}),
    "dataset_jsonl_bad_json": Case(["--training.dataset", "jsonl", "--training.dataset_path", "{tmp}/d.jsonl"],
                                   "d.jsonl line 1", files={"d.jsonl": b"{not json\n" + jsonl(LONG_TEXT)}),
    "dataset_jsonl_no_text": Case(["--training.dataset", "jsonl", "--training.dataset_path", "{tmp}/d.jsonl"],
                                  'd.jsonl line 1 has no string "text"', files={"d.jsonl": b'{"body": "x"}\n'}),
    "dataset_jsonl_truncated_gzip": Case(["--training.dataset", "jsonl", "--training.dataset_path", "{tmp}/d.jsonl.gz"],
                                         "d.jsonl.gz", files={"d.jsonl.gz": gzip.compress(jsonl(LONG_TEXT))[:30]}),
    "switch_with_bad_value": Case(["--training.compile", "yes"], "--training.compile"),
    "switch_with_bad_equals_value": Case(["--checkpoint.enable=sometimes"], "--checkpoint.enable"),
    "unknown_flag": Case(["--training.stepz", "5"], "--training.steps"),
    "unknown_section_flag": Case(["--trainer.steps", "5"], "--trainer.steps"),
    # [metrics], [profiling], [comm]
    "log_freq_zero": flag("metrics.log_freq", "0"),
    "tensorboard_with_value": Case(["--metrics.enable_tensorboard", "maybe"], "--metrics.enable_tensorboard"),
    "profile_freq_zero": flag("profiling.profile_freq", "0"),
    "memory_snapshot_without_cuda": Case(["--profiling.enable_memory_snapshot"], "--profiling.enable_memory_snapshot",
                                         marks=(WITHOUT_GPU,)),
    "init_timeout_zero": flag("comm.init_timeout_seconds", "0"),
    "train_timeout_negative": flag("comm.train_timeout_seconds", "-5"),
    # [parallelism] and [activation_checkpoint]
    "replicate_zero": flag("parallelism.data_parallel_replicate_degree", "0"),
    "shard_zero": flag("parallelism.data_parallel_shard_degree", "0"),
    "shard_minus_two": flag("parallelism.data_parallel_shard_degree", "-2"),
    "tp_zero": flag("parallelism.tensor_parallel_degree", "0"),
    "tp_more_than_world": flag("parallelism.tensor_parallel_degree", "3"),
    "pp_zero": flag("parallelism.pipeline_parallel_degree", "0"),
    "pp_more_than_world": Case(["--parallelism.pipeline_parallel_degree", "2"], "world size 1"),
    "pp_schedule_unknown": flag("parallelism.pipeline_parallel_schedule", "Sideways"),
    "pp_microbatch_zero": flag("parallelism.pipeline_parallel_microbatch_size", "0"),
    "pp_layers_per_stage_zero": flag("parallelism.pipeline_parallel_layers_per_stage", "0"),
    "pp_split_points_without_pp": Case(["--parallelism.pipeline_parallel_split_points", "layers.2"],
                                       "only apply with --parallelism.pipeline_parallel_degree"),
    "pp_split_point_misspelt": Case(["--parallelism.pipeline_parallel_degree", "2",
                                     "--parallelism.pipeline_parallel_split_points", "layer3"],
                                    "--parallelism.pipeline_parallel_split_points has 'layer3'", world_size=2),
    "pp_split_points_past_the_model": Case(["--parallelism.pipeline_parallel_degree", "2",
                                            "--parallelism.pipeline_parallel_split_points", "layers.6"],
                                           "between layers.1 and layers.5", world_size=2),
    "pp_stages_do_not_divide_layers": Case(["--parallelism.pipeline_parallel_degree", "2",
                                            "--parallelism.pipeline_parallel_layers_per_stage", "4"],
                                           "--parallelism.pipeline_parallel_layers_per_stage 4", world_size=2),
    "pp_too_few_stages_for_schedule": Case(["--parallelism.pipeline_parallel_degree", "2",
                                            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                            "--parallelism.pipeline_parallel_layers_per_stage", "3"],
                                           "runs 2 or more stage(s)", world_size=2),
    "pp_too_few_microbatches": Case(["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"],
                                    "needs at least 2 micro-batches", world_size=2),
    "pp_microbatch_does_not_divide_batch": Case(["--parallelism.pipeline_parallel_degree", "2",
                                                 "--parallelism.pipeline_parallel_microbatch_size", "3"],
                                                "--parallelism.pipeline_parallel_microbatch_size 3", world_size=2),
    "cp_zero": flag("parallelism.context_parallel_degree", "0"),
    "cp_rotate_method_unknown": flag("parallelism.context_parallel_rotate_method", "ring"),
    "cp_seq_len_not_in_chunks": Case(["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
                                     "--training.seq_len 66 must be divisible by 2 x", world_size=2),
    "reshard_choice_unknown": flag("parallelism.fsdp_reshard_after_forward", "sometimes"),
    "async_tp_without_cuda": Case(["--parallelism.enable_async_tensor_parallel"],
                                  "--parallelism.enable_async_tensor_parallel"),
    "degrees_do_not_multiply": Case(["--parallelism.data_parallel_shard_degree", "3"], "world size 2", world_size=2),
    "tp_seq_len_odd": Case(["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
                           "--training.seq_len 63", world_size=2),
    "tp_vocab_multiple_odd": Case(["--parallelism.tensor_parallel_degree", "2", "--model.vocab_size_multiple_of", "3"],
                                  "--model.vocab_size_multiple_of 3", world_size=2),
    "tp_heads_do_not_divide": Case(["--parallelism.tensor_parallel_degree", "3"],
                                   "--parallelism.tensor_parallel_degree 3", world_size=3),
    "experts_resharded_under_recorded_checkpoints": Case(
        ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.expert_parallel_degree", "2", "--parallelism.fsdp_reshard_after_forward", "always",
         "--activation_checkpoint.mode", "selective"],
        "--parallelism.fsdp_reshard_after_forward always reshards the experts", world_size=4),
    "ac_mode_unknown": flag("activation_checkpoint.mode", "partial"),
    "ac_option_word": Case(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                            "every"], "--activation_checkpoint.selective_ac_option"),
    "ac_option_zero": Case(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                            "0"], "--activation_checkpoint.selective_ac_option"),
    # [float8], [mx], [compile]
    "float8_recipe_unknown": flag("float8.recipe_name", "columnwise"),
    "float8_filter_typo": Case(["--model.converters", "float8", "--float8.emulate", "--float8.filter_fqns", "outptu"],
                               "--float8.filter_fqns 'outptu'"),
    "float8_filter_renamed_layer": Case(["--model.converters", "float8", "--float8.emulate", "--float8.filter_fqns",
                                         "lm_head"], "--float8.filter_fqns 'lm_head'"),
    "float8_all_gather_rowwise": Case(["--float8.enable_fsdp_float8_all_gather", "--float8.recipe_name", "rowwise"],
                                      "--float8.enable_fsdp_float8_all_gather"),
    "float8_precompute_alone": flag("float8.precompute_float8_dynamic_scale_for_fsdp", "true"),
    "float8_emulate_with_value": Case(["--float8.emulate", "2"], "--float8.emulate"),
    "mx_recipe_unknown": flag("mx.recipe_name", "mxfp4"),
    "mx_without_emulate_on_cpu": Case(["--model.converters", "mx"], "--mx.emulate", marks=(WITHOUT_GPU,)),
    "mx_filter_typo": Case(["--model.converters", "mx", "--mx.emulate", "--mx.filter_fqns", "ouput"],
                           "--mx.filter_fqns 'ouput'"),
    "nvfp4_filter_typo": Case(["--model.converters", "nvfp4", "--nvfp4.emulate", "--nvfp4.filter_fqns", "outptu"],
                              "--nvfp4.filter_fqns 'outptu'"),
    "float8_experts_typo": Case(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.converters",
                                 "float8", "--float8.emulate", "--float8.moe_fqns_prototype", "moe.expert_s"],
                                "--float8.moe_fqns_prototype 'moe.expert_s'"),
    "mx_experts_typo": Case(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.converters", "mx",
                             "--mx.emulate", "--mx.moe_fqns_prototype", "moe.expert_"],
                            "--mx.moe_fqns_prototype 'moe.expert_'"),
    "float8_and_mx_overlap": Case(["--model.converters", "float8,mx", "--float8.emulate", "--mx.emulate"],
                                  "--float8.filter_fqns"),
    "compile_casts_with_value": Case(["--compile.emulate_precision_casts", "on"], "--compile.emulate_precision_casts"),
    # [checkpoint]
    "interval_zero": flag("checkpoint.interval", "0"),
    "keep_latest_negative": flag("checkpoint.keep_latest_k", "-1"),
    "load_step_minus_two": flag("checkpoint.load_step", "-2"),
    "exclude_unknown_part": Case(["--checkpoint.exclude_from_loading", "weights"], "--checkpoint.exclude_from_loading"),
    "pinned_memory_without_cuda": Case(["--checkpoint.async_mode", "async_with_pinned_mem"], "--checkpoint.async_mode",
                                       marks=(WITHOUT_GPU,)),
    "async_mode_unknown": flag("checkpoint.async_mode", "threads"),
    "export_dtype_unknown": flag("checkpoint.export_dtype", "int8"),
    "seed_checkpoint_without_enable": Case(["--checkpoint.create_seed_checkpoint"],
                                           "--checkpoint.create_seed_checkpoint"),
    "seed_checkpoint_on_two_ranks": Case(["--checkpoint.create_seed_checkpoint", "--checkpoint.enable"],
                                         "--checkpoint.create_seed_checkpoint", world_size=2),
    "hf_without_path": Case(["--checkpoint.initial_load_in_hf"], "--checkpoint.initial_load_path"),
    "initial_load_path_missing": Case(["--checkpoint.initial_load_path", "{tmp}/none"],
                                      "--checkpoint.initial_load_path"),
    "initial_load_path_not_checkpoint": Case(["--checkpoint.enable", "--checkpoint.initial_load_path", "{tmp}/plain"],
                                             "--checkpoint.initial_load_path", files={"plain/a.txt": b"x"}),
    "initial_load_path_hf_folder_empty": Case(["--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                                               "--checkpoint.initial_load_path", "{tmp}/plain"], "plain",
                                              files={"plain/a.txt": b"x"}),
    "load_step_without_checkpoint": Case(["--checkpoint.enable", "--checkpoint.load_step", "5"],
                                         "--checkpoint.load_step 5"),
    "fault_step_after_the_last_step": Case(["--fault.kind", "kill", "--fault.step", "20"],
                                           "--fault.step 20 is after the run's last step (--training.steps 1)"),
    "mtp_weight_without_mtp": Case(["--training.mtp_loss_weight", "0.1"], "--training.mtp_loss_weight 0.1 only "
                                   "applies to flavors with multi-token prediction modules"),
    "hf_export_without_a_class": Case(["--model.name", "deepseek_v3", "--model.flavor", "16B", "--checkpoint.enable",
                                       "--checkpoint.last_save_in_hf"], "--checkpoint.last_save_in_hf needs a Hugging "
                                      "Face class for --model.name deepseek_v3 --model.flavor 16B"),
    "initial_load_path_only_an_unfinished_step": Case(
        ["--checkpoint.initial_load_path", "{tmp}/run/checkpoint"], "it holds only step-2.partial",
        files={"run/checkpoint/step-2.partial/__0_0.distcp": b"x"}),
    "fault_kind_unknown": flag("fault.kind", "meteor"),
    "fault_without_a_time": Case(["--fault.kind", "kill"], "--fault.step"),
    "fault_rank_outside_the_job": Case(["--fault.kind", "hang", "--fault.step", "3", "--fault.rank", "2"],
                                       "--fault.rank 2 is not a rank of this job", world_size=2),
    "storage_fault_without_checkpoints": Case(["--fault.kind", "storage", "--fault.step", "3"], "--checkpoint.enable"),
    "storage_fault_on_object_storage": Case(["--fault.kind", "storage", "--fault.step", "3", "--checkpoint.enable",
                                             "--checkpoint.folder", "s3://bucket/run"], "whose outage Titan cannot"),
    "straggler_threshold_above_one": flag("metrics.straggler_threshold", "1.5"),
}


def test_sweep_has_at_least_100_cases() -> None:
    assert len(CASES) + len(LAUNCHER_CASES) >= 100


# Fields that name modules or parameters (by FQN substring, or a checkpoint's parts), and the case whose entry
# matches none of them: each must be refused, naming the entry, rather than silently change nothing.
PATTERN_FIELDS = {"float8.filter_fqns": "float8_filter_typo", "mx.filter_fqns": "mx_filter_typo",
                  "nvfp4.filter_fqns": "nvfp4_filter_typo", "float8.moe_fqns_prototype": "float8_experts_typo",
                  "mx.moe_fqns_prototype": "mx_experts_typo",
                  "optimizer.lr_multipliers": "lr_multiplier_matches_nothing",
                  "optimizer.adamw_fqns": "muon_adamw_fqns_typo",
                  "checkpoint.exclude_from_loading": "exclude_unknown_part"}


def test_every_name_pattern_field_refuses_an_entry_that_matches_nothing() -> None:
    fqn_fields = {f"{section.name}.{name}" for section in dataclasses.fields(JobConfig)
                  for name in typing.get_type_hints(section.type)
                  if name.endswith(("_fqns", "_fqns_prototype"))}
    assert fqn_fields <= PATTERN_FIELDS.keys(), f"add a case for {fqn_fields - PATTERN_FIELDS.keys()}"
    for field_name, case in PATTERN_FIELDS.items():
        assert CASES[case].expected.startswith(f"--{field_name}"), (field_name, CASES[case].expected)


def test_lr_multipliers_match_the_names_validation_checks() -> None:
    """Validation checks --optimizer.lr_multipliers against the model's own FQNs; the optimizer must match the same
    names when activation checkpointing wraps the blocks (its wrapper adds `_checkpoint_wrapped_module.`)."""
    cfg = parse_args(["--optimizer.lr_multipliers", "layers.0.attention=0.5"])
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS["debugmodel"])
    apply_ac(model, "full", "op", save_attention=False)
    scaled = {id(p) for group in parameter_groups(model, cfg.optimizer) if group["lr_multiplier"] == 0.5
              for p in group["params"]}
    attention = dict(model.layers["0"].named_parameters())  # the wrapper names them without its prefix
    assert scaled == {id(p) for name, p in attention.items() if name.startswith("attention")}  # and attention_norm


def run_in_process(argv: list[str], world_size: int, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str], records: list[logging.LogRecord]) -> tuple[int, str]:
    """train.py's main() on `argv`: its exit code and everything it said (tyro's own errors end in SystemExit)."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        code = TRAIN.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert not any(record.exc_info for record in records)
    return code, captured.out + captured.err + "\n".join(record.getMessage() for record in records)


def case_argv(case: Case, tmp_path: Path) -> list[str]:
    """Write the case's files to `tmp_path` and return its arguments, after TINY and with a dump folder there."""
    for relative, content in case.files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(content)
    # TINY first: if a check were missing, the run would train a tiny model briefly instead of 10,000 steps.
    argv = [*TINY, *(arg.replace("{tmp}", str(tmp_path)) for arg in case.args)]
    if "--job.dump_folder" not in argv:
        argv += ["--job.dump_folder", str(tmp_path / "out")]
    return argv


@pytest.mark.parametrize("name", [pytest.param(name, marks=CASES[name].marks) for name in sorted(CASES)])
def test_bad_input_exits_2_naming_the_field(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str],
                                            titan_records: list[logging.LogRecord]) -> None:
    case = CASES[name]
    code, output = run_in_process(case_argv(case, tmp_path), case.world_size, monkeypatch, capsys, titan_records)
    assert code == 2, output
    assert case.expected in output, output
    assert "Traceback" not in output, output


# One case of each kind of mistake, as a user meets it through ./run_train.sh: a flag tyro can't parse and a value
# validation rejects stop in the launcher (titan/launch.py) before any rank starts; a tokenizer or checkpoint that
# can't be read stops the rank, under torchrun, and the launcher passes its code on. The rank-time data mistake is
# test_data_mistake_stops_every_rank_quietly's. Name -> whether a rank stops (rather than the launcher).
LAUNCHED_CASES = {"steps_not_int": False, "lr_negative": False, "tokenizer_garbage": True,
                  "load_step_without_checkpoint": True}


@pytest.mark.parametrize("name", sorted(LAUNCHED_CASES))
def test_bad_input_through_run_train_sh_exits_2_naming_the_field(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    result = run_train(*case_argv(case, tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert case.expected in output, output
    assert "Traceback" not in output, output
    assert ("Rank 0 exited with code 2" in output) == LAUNCHED_CASES[name], output


def test_every_problem_is_listed_at_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                         titan_records: list[logging.LogRecord], tmp_path: Path) -> None:
    argv = ["--training.steps", "0", "--optimizer.lr", "-1", "--lr_scheduler.min_lr_factor", "5",
            "--training.local_batch_size", "0", "--training.global_batch_size", "12",
            "--job.dump_folder", str(tmp_path)]
    code, output = run_in_process(argv, 1, monkeypatch, capsys, titan_records)
    assert code == 2
    assert "(4 problems)" in output, output
    for name in ("--training.steps 0", "--optimizer.lr -1", "--lr_scheduler.min_lr_factor 5",
                 "--training.local_batch_size 0"):
        assert name in output


def saved_checkpoint(tmp_path: Path) -> Path:
    """A run folder with a complete checkpoint at step 1 (one tiny training step)."""
    run = tmp_path / "run"
    code = TRAIN.main([*TINY, "--checkpoint.enable", "--checkpoint.interval", "1", "--job.dump_folder", str(run)])
    assert code == 0
    return run


@pytest.mark.parametrize("damage", ["truncate_data", "drop_metadata"])
def test_damaged_checkpoint_names_the_folder_and_keeps_the_runs_config(
        damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        titan_records: list[logging.LogRecord]) -> None:
    run = saved_checkpoint(tmp_path)
    step = run / "checkpoint" / "step-1"
    if damage == "truncate_data":
        data = next(step.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:1000])
    else:
        (step / ".metadata").unlink()
    record = (run / "config.toml").read_text()
    titan_records.clear()
    argv = [*TINY, "--training.steps", "2", "--training.seed", "7", "--checkpoint.enable",
            "--job.dump_folder", str(run)]
    code, output = run_in_process(argv, 1, monkeypatch, capsys, titan_records)
    assert code == 2 and str(step) in output and "--checkpoint.load_step" in output, output
    assert "Traceback" not in output and "tuple" not in output and "FrameSummary" not in output, output
    # The failed attempt (another seed) must not replace the record of what the run ran.
    assert (run / "config.toml").read_text() == record


def test_help_reads_each_fields_declared_domain(run_train_help: subprocess.CompletedProcess) -> None:
    result = run_train_help
    assert result.returncode == 0
    assert "must be a number in [0, 1)" in result.stdout  # --optimizer.beta1 / beta2
    assert "must be an integer >= 1, or -1" in result.stdout  # --training.global_batch_size


def test_launcher_help_shows_titans_fields() -> None:
    result = subprocess.run([sys.executable, "-m", "titan.launch", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--nproc_per_node" in result.stdout and "--training.local_batch_size" in result.stdout


@pytest.mark.parametrize("value, on", [("true", True), ("True", True), ("false", False), ("FALSE", False)])
def test_switches_take_toml_style_values(value: str, on: bool) -> None:
    assert parse_args(["--compile.enable", value]).compile.enable is on
    assert parse_args([f"--checkpoint.enable={value}"]).checkpoint.enable is on


def test_toml_with_byte_order_mark_loads(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    assert parse_args(["--job.config_file", str(tmp_path / "job.toml")]).training.steps == 3


# Launcher environment: run_train.sh and titan.launch check NGPU, LOG_RANK, CONFIG_FILE and MAX_RESTARTS before any
# rank starts.
LAUNCHER_CASES: dict[str, tuple[dict[str, str], list[str], str]] = {
    "ngpu_zero": ({"NGPU": "0"}, [], "NGPU"),
    "ngpu_negative": ({"NGPU": "-1"}, [], "NGPU"),
    "ngpu_word": ({"NGPU": "abc"}, [], "NGPU"),
    "log_rank_word": ({"LOG_RANK": "abc"}, [], "LOG_RANK"),
    "log_rank_outside_job": ({"LOG_RANK": "5"}, [], "LOG_RANK"),
    "config_file_env_missing": ({"CONFIG_FILE": "/no/such/job.toml"}, [], "CONFIG_FILE"),
    "max_restarts_fraction": ({"MAX_RESTARTS": "1.5"}, [], "MAX_RESTARTS=1.5 (--max-restarts for python -m "
                                                          "titan.launch) must be a whole number"),
}


@pytest.mark.parametrize("text", ["-1", "1.5", "three", ""])
def test_a_restart_budget_that_is_no_count_names_max_restarts(text: str) -> None:
    """What the launcher reads --max-restarts (MAX_RESTARTS) with; launched, in LAUNCHER_CASES."""
    with pytest.raises(ConfigError, match=f"MAX_RESTARTS={re.escape(text)} \\(--max-restarts for python -m "
                                          f"titan.launch\\) must be a whole number, 0 or more"):
        read_max_restarts(text)
    assert read_max_restarts("3") == 3


@pytest.mark.parametrize("name", sorted(LAUNCHER_CASES))
def test_launcher_environment_mistakes_exit_2(name: str, tmp_path: Path) -> None:
    env, args, expected = LAUNCHER_CASES[name]
    result = run_train(*args, "--training.steps", "1", "--job.dump_folder", str(tmp_path), env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert expected in output and "Traceback" not in output, output
    assert not (tmp_path / "config.toml").exists()


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="NGPU=2 gives each rank its own GPU; this machine has one")
def test_data_mistake_stops_every_rank_quietly(tmp_path: Path) -> None:
    """Every rank reads the whole (global) stream, so every rank finds the data empty and stops with the same
    message naming the flag, exit code 2 and no traceback."""
    (tmp_path / "d.jsonl").write_bytes(jsonl("", ""))
    result = run_train("--training.dataset", "jsonl", "--training.dataset_path", str(tmp_path / "d.jsonl"),
                       "--training.seq_len", "32", "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out"),
                       env={"NGPU": "2", "LOG_RANK": "0,1"})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert (f"--training.dataset_path {str(tmp_path / 'd.jsonl')!r} has no documents with text. Point it at "
            f"non-empty data.") in output, output
    assert re.search(r"Rank [01] exited with code 2", output), output
    assert "Traceback" not in output, output


def test_every_numeric_field_declares_its_range() -> None:
    numeric = [(section.type, name) for section in dataclasses.fields(JobConfig)
               for name, hint in typing.get_type_hints(section.type).items()
               if {int, float} & {hint, *typing.get_args(hint)}]
    assert len(numeric) > 25
    undeclared = [f"{cls.__name__}.{name}" for cls, name in numeric if name not in field_ranges(cls)]
    assert not undeclared, f"give these fields a Range type from titan/config/domain.py: {undeclared}"
