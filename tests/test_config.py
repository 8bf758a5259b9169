"""Config parsing, precedence and every config error path, through the real parser and validator."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

from titan.config.errors import ConfigError
from titan.config.job import JobConfig, Model
from titan.config.load import load_toml, parse_args, to_toml
from titan.hardware import (
    CPU,
    Accelerator,
    cpu_scaled_mm_takes_rowwise_scales,
    local_accelerator,
    simulated_accelerator,
    target_accelerator,
)
from titan.models.families import FAMILIES
from titan.validate import load_job_config, validate

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli(tmp_path: Path) -> None:
    toml = write(tmp_path, "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 1e-3\n")
    cfg = parse_args(["--job.config_file", toml, "--training.steps", "50"])
    assert cfg.training.steps == 50  # CLI beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default kept


def test_torchtitan_spellings_parse() -> None:
    cfg = parse_args([
        "--training.steps", "50", "--compile.enable", "--model.converters", "mx", "--model.print_after_conversion",
        "--optimizer.lr", "3e-4", "--training.local_batch_size", "4", "--training.seq_len", "512",
        "--training.max_norm", "0.5", "--model.flavor", "1B", "--job.dump_folder", "/tmp/x",
        "--metrics.log_freq", "5", "--metrics.enable_tensorboard",
    ])
    assert cfg.training.steps == 50 and cfg.compile.enable and cfg.model.print_after_conversion
    assert cfg.model.converters == ["mx"]
    assert cfg.optimizer.lr == 3e-4 and cfg.training.local_batch_size == 4 and cfg.training.seq_len == 512
    assert cfg.training.max_norm == 0.5 and cfg.model.flavor == "1B" and cfg.job.dump_folder == "/tmp/x"
    assert cfg.metrics.log_freq == 5 and cfg.metrics.enable_tensorboard


@pytest.mark.parametrize("flags, enabled", [
    (["--training.compile"], True), (["--training.compile", "false"], False), (["--training.compile=true"], True),
    (["--compile.enable", "--training.no_compile"], False),
])
def test_training_compile_is_an_alias_of_compile_enable(flags: list[str], enabled: bool, tmp_path: Path) -> None:
    """Titan's earlier spelling, on the command line and in a TOML file, sets torchtitan's; both in one file is an
    error naming both."""
    assert parse_args(flags).compile.enable is enabled
    (tmp_path / "alias.toml").write_text(f"[training]\ncompile = {str(enabled).lower()}\n")
    assert load_toml(tmp_path / "alias.toml").compile.enable is enabled
    (tmp_path / "both.toml").write_text("[training]\ncompile = true\n[compile]\nenable = false\n")
    with pytest.raises(ConfigError, match=r"\[training\] compile and \[compile\] enable are one field"):
        load_toml(tmp_path / "both.toml")


@pytest.mark.parametrize("args", [["float8", "mx"], ["float8,mx"], ["float8, mx"]])
def test_converter_lists_and_commas(args: list[str]) -> None:
    assert parse_args(["--model.converters", *args]).model.converters == ["float8", "mx"]


def test_toml_list_or_comma_string(tmp_path: Path) -> None:
    toml = write(tmp_path, '[model]\nconverters = "float8,mx"\n')
    assert parse_args(["--job.config_file", toml]).model.converters == ["float8", "mx"]


def test_config_file_equals_form(tmp_path: Path) -> None:
    toml = write(tmp_path, "[training]\nsteps = 3\n")
    assert parse_args([f"--job.config_file={toml}"]).training.steps == 3


def test_unknown_section_and_key_suggest_closest(tmp_path: Path) -> None:
    toml = write(tmp_path, "[trainig]\nsteps = 3\n[optimizer]\nlearning_rate = 1.0\nlrr = 2.0\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", toml])
    message = str(err.value)
    assert "unknown section [trainig]" in message and "'training'" in message
    assert "unknown key 'lrr' in [optimizer]" in message and "Did you mean 'lr'" in message
    assert "learning_rate" in message
    assert len(err.value.problems) == 3


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    toml = write(tmp_path, "[training]\nsteps = 3\nseq_len = = 4\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", toml])
    assert toml in str(err.value) and "line 3" in str(err.value)


def test_toml_wrong_types_name_field_and_expected(tmp_path: Path) -> None:
    toml = write(tmp_path, '[training]\nsteps = "ten"\ncompile = 1\n[model]\nflavor = "2B"\n[optimizer]\nlr = 1\n')
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", toml])
    message = str(err.value)
    assert "[training] steps = 'ten' must be an integer" in message
    assert "[training] compile = 1 must be true or false" in message
    assert "[model] flavor = '2B' must be one of" in message and "'1B'" in message
    assert len(err.value.problems) == 3  # an int where a float goes is fine


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="--job.config_file"):
        parse_args(["--job.config_file", "/nonexistent/job.toml"])


def test_cli_wrong_type_and_unknown_flag_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--training.steps", "ten"])
    assert exit_info.value.code == 2
    assert "--training.steps" in capsys.readouterr().err


def test_unknown_flags_are_named_with_the_nearest_by_edit_distance() -> None:
    """Every unknown flag in one error, each with the valid flag nearest by edit distance: `--training.step` gets
    --training.steps, not --training.max_skipped_steps (difflib's ratio ranked that first)."""
    with pytest.raises(ConfigError) as raised:
        parse_args(["--training.step", "10", "--training.compile=false", "--model.flavr", "1B", "--fp8.x", "1"])
    assert raised.value.problems == [
        "--training.step is not a Titan flag. Did you mean --training.steps?",
        "--model.flavr is not a Titan flag. Did you mean --model.flavor?",
        "--fp8.x is not a Titan flag. See ./run_train.sh --help for every field."]


def test_help_lists_every_field_with_its_doc(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(section.type):
            assert f"--{section.name}.{f.name}" in text, f"--{section.name}.{f.name} missing from --help"
    assert "Peak learning rate" in text
    assert "--training.compile, Titan's earlier spelling, is an alias" in text


def problems_for(*args: str, world_size: int = 1, accelerator: Accelerator | None = None) -> list[str]:
    """The problems validation finds in the debug job with `args`, on `accelerator` (default: the one it targets)."""
    cfg = parse_args(["--job.config_file", DEBUG_TOML, *args])
    try:
        validate(cfg, world_size, accelerator)
    except ConfigError as e:
        return e.problems
    return []


def test_the_config_takes_every_registered_family_and_flavor() -> None:
    """--model.name and --model.flavor accept what titan/models/families.py registers, and nothing else: a family
    added there needs no edit of titan/config/job.py."""
    hints = typing.get_type_hints(Model)
    assert typing.get_args(hints["name"]) == tuple(FAMILIES)
    flavors = {flavor for family in FAMILIES.values() for flavor in family.flavors}
    assert set(typing.get_args(hints["flavor"])) == flavors


def test_debug_config_is_valid() -> None:
    assert problems_for() == []
    assert problems_for("--training.enable_cpu_offload", world_size=2) == []


@pytest.mark.parametrize("args, field", [
    (["--training.global_batch_size", "12"], "--training.global_batch_size 12"),
    (["--training.seq_len", "4096"], "--training.seq_len 4096"),
    (["--model.converters", "int3"], "--model.converters"),
    (["--model.tokenizer_path", "nope.model"], "--model.tokenizer_path 'nope.model'"),
    (["--training.dataset", "text"], "--training.dataset_path"),
    (["--training.dataset", "jsonl", "--training.dataset_path", "/nonexistent/*.jsonl"], "--training.dataset_path"),
    (["--training.dataset", "prepared", "--training.dataset_path", "/nonexistent/store"],
     "--training.dataset_path '/nonexistent/store' is not a folder: --training.dataset prepared reads a token store "
     "made by `python -m titan.data.prepare`"),
    (["--training.dataset", "hf", "--training.dataset_path", "org/set"],
     "--training.dataset hf --training.dataset_path 'org/set' is not a local folder: a dataset from the Hugging Face "
     "hub is tokenized once, before training, with `python -m titan.data.prepare --dataset hf --dataset_path org/set "
     "--out STORE`"),
    (["--optimizer.lr", "0"], "--optimizer.lr"),
    (["--lr_scheduler.decay_ratio", "1.5"], "--lr_scheduler.decay_ratio"),
    (["--training.steps", "0"], "--training.steps"),
    (["--metrics.log_freq", "0"], "--metrics.log_freq"),
])
def test_each_cross_field_rule(args: list[str], field: str) -> None:
    problems = problems_for(*args)
    assert len(problems) == 1 and field in problems[0], problems


# A problem starts with the flag it is about and suggests "Try N" for that flag, or "Use --flag N".
SUGGESTION = re.compile(r"^(--[\w.]+) .*?(?:Try|Use) (?:(--[\w.]+) )?(-?\d+)\b")


def follow_suggestion(args: tuple[str, ...], problem: str) -> list[str]:
    """`args` with the suggested value of the problem's flag appended (the last value of a flag wins)."""
    match = SUGGESTION.search(problem)
    assert match, f"no value suggested in: {problem}"
    return [*args, match.group(2) or match.group(1), match.group(3)]


@pytest.mark.parametrize("args, world_size", [
    (("--training.global_batch_size", "12"), 1),
    (("--training.global_batch_size", "8"), 2),
    (("--training.seq_len", "4096"), 1),
    # heads, kv heads, the padded vocab and seq_len: one suggestion each
    (("--parallelism.tensor_parallel_degree", "3"), 6),
    (("--parallelism.tensor_parallel_degree", "3"), 3),  # the suggested degree must divide the world size too
])
def test_following_each_suggestion_fixes_its_problem(args: tuple[str, ...], world_size: int) -> None:
    """Every problem suggests a value, and rerunning with it removes that problem and adds none."""
    problems = problems_for(*args, world_size=world_size)
    assert problems
    for problem in problems:
        after = problems_for(*follow_suggestion(args, problem), world_size=world_size)
        assert problem not in after and set(after) < set(problems), (problem, after)


H100 = simulated_accelerator("H100")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_float8_rowwise_on_the_cpu_follows_this_torchs_kernel(recipe: str) -> None:
    """The CPU's torch._scaled_mm takes rowwise scales from torch 2.13 on; on an older torch (2.11: this test runs in
    .ci/run's 2.11 subset), native rowwise float8 on the CPU is a config error that points at the emulated mode, not
    the kernel's internal assert at step 1."""
    args = ["--model.converters", "float8", "--float8.recipe_name", recipe]
    found = problems_for(*args, accelerator=CPU)
    if cpu_scaled_mm_takes_rowwise_scales():
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(f"--float8.recipe_name {recipe} multiplies with rowwise"), found
        assert "--float8.emulate" in found[0]
    assert problems_for(*args, "--float8.emulate", accelerator=CPU) == []


@pytest.mark.parametrize("args, world_size, problem", [
    (["--training.local_batch_size", "1", "--training.seq_len", "250"], 1,
     "--training.local_batch_size 1 x --training.seq_len 250 = 250 tokens"),
    # 8 x 250 = 2000 tokens per step, but each pipeline micro-batch's backward sums over 1 x 250
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
      "--training.seq_len", "250"], 2,
     "--parallelism.pipeline_parallel_microbatch_size 1 x --training.seq_len 250 = 250 tokens"),
    # 1 x 48 = 48 tokens per step, but each context-parallel rank holds 24 of them
    (["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "1", "--training.seq_len", "48"], 2,
     "--training.local_batch_size 1 x --training.seq_len 48 / --parallelism.context_parallel_degree 2 = 24 tokens"),
])
def test_float8_tokens_per_weight_gradient_matmul(args: list[str], world_size: int, problem: str) -> None:
    """The float8 weight-gradient matmul sums over one backward's tokens: a pipeline micro-batch's under PP, and a
    context-parallel rank's share of each sequence. CUDA's float8 matmul needs that count divisible by 16; following
    the suggestion fixes it."""
    args = ["--model.converters", "float8", *args]
    found = problems_for(*args, world_size=world_size, accelerator=H100)
    assert len(found) == 1 and found[0].startswith(problem), found
    assert problems_for(*follow_suggestion(tuple(args), found[0]), world_size=world_size, accelerator=H100) == []
    assert problems_for(*args, "--float8.emulate", world_size=world_size, accelerator=H100) == []
    assert problems_for(*args, world_size=world_size, accelerator=CPU) == []  # CPU's _scaled_mm takes any count


# Valid on H100s, and each flag needs a GPU: FlexAttention, native float8 (rowwise), async TP (with compile), a
# pinned-memory async checkpoint, the CUDA memory snapshot.
GPU_JOB = ("--model.attn_backend", "flex", "--model.converters", "float8", "--float8.recipe_name", "rowwise",
           "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel",
           "--training.compile", "--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem",
           "--profiling.enable_memory_snapshot")


def test_a_dry_run_validates_for_the_gpu_it_simulates() -> None:
    """A dry run checks the job against --estimate.gpu, whatever machine it runs on: a job valid on H100s passes
    on this machine, and MX (Blackwell only) is refused for H100s and accepted for B200s."""
    load_job_config(["--job.config_file", DEBUG_TOML, *GPU_JOB, "--job.dry_run"], world_size=2)
    mx = ["--job.config_file", DEBUG_TOML, "--model.converters", "mx", "--job.dry_run"]
    with pytest.raises(ConfigError, match="compute capability 10.0 or newer.*the dry run's simulated NVIDIA H100 80GB "
                                          "HBM3 is 9.0"):
        load_job_config(mx, world_size=1)
    load_job_config([*mx, "--estimate.gpu", "B200"], world_size=1)


def test_a_gpu_job_is_refused_for_a_cpu_run() -> None:
    found = problems_for(*GPU_JOB, world_size=2, accelerator=CPU)
    flags = ["--profiling.enable_memory_snapshot", "--parallelism.enable_async_tensor_parallel",
             "--checkpoint.async_mode async_with_pinned_mem", "--model.attn_backend flex"]
    if not cpu_scaled_mm_takes_rowwise_scales():  # torch 2.11's CPU kernel: per-tensor scales only
        flags.append("--float8.recipe_name rowwise")
    assert len(found) == len(flags) and all(any(problem.startswith(flag) for problem in found) for flag in flags), found
    assert problems_for(*GPU_JOB, world_size=2, accelerator=H100) == []
    # async TP is an inductor pass: another compile backend has none
    (found_backend,) = problems_for(*GPU_JOB, "--compile.backend", "aot_eager", world_size=2, accelerator=H100)
    assert found_backend.startswith("--parallelism.enable_async_tensor_parallel")
    assert "--compile.backend" in found_backend
    if not torch.cuda.is_available():  # without --job.dry_run, the job targets this machine
        assert problems_for(*GPU_JOB, world_size=2) == found


def test_the_target_accelerator() -> None:
    """A dry run targets the card --estimate.gpu names, under the name torch.cuda gives it; a run, this machine."""
    assert target_accelerator(True, "H100") == Accelerator("NVIDIA H100 80GB HBM3", (9, 0), simulated=True)
    assert target_accelerator(True, "H200").capability == (9, 0)
    assert target_accelerator(True, "B200") == Accelerator("NVIDIA B200", (10, 0), simulated=True)
    assert target_accelerator(False, "B200") == local_accelerator()
    if not torch.cuda.is_available():
        assert local_accelerator() == CPU and not CPU.is_cuda


def test_all_problems_reported_together() -> None:
    problems = problems_for("--training.global_batch_size", "12", "--model.converters", "int3",
                            "--training.seq_len", "4096")
    assert len(problems) == 3


@pytest.mark.parametrize("name, world_size", [("llama3_405b.toml", 512), ("llama3_70b.toml", 256),
                                              ("llama3_8b_128k.toml", 8)])
def test_large_configs_are_valid_at_the_world_size_they_document(name: str, world_size: int) -> None:
    """The pipeline and context-parallel layouts of the shipped large jobs divide their model and world size (with the
    shipped tokenizer and corpus standing in for Llama 3's, which are not shipped, and SDPA for FlexAttention, which
    needs a GPU to train)."""
    path = ROOT / "configs" / name
    assert f"{world_size} GPUs" in path.read_text() or f"NGPU={world_size}" in path.read_text()
    load_job_config(["--job.config_file", str(path), "--model.tokenizer_path", "tokenizers/titan_2256.tiktoken",
                     "--training.dataset", "shipped", "--training.dataset_path", "None", "--model.attn_backend",
                     "sdpa"], world_size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is about gloo on CPU; NCCL runs are not affected")
@pytest.mark.parametrize("version, problems", [((2, 11), 1), ((2, 13), 0)])
def test_zero_bubble_v_schedule_needs_torch_2_13_on_cpu(monkeypatch: pytest.MonkeyPatch, version: tuple[int, int],
                                                        problems: int) -> None:
    """torch 2.11's ZBVZeroBubble stage setup fails over gloo; the config says so before any process group forms."""
    monkeypatch.setattr("titan.parallel.rules.torch_version", lambda: version)
    found = problems_for("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                         "ZBVZeroBubble", world_size=2)
    assert len(found) == problems and all("Use torch 2.13 or newer" in p for p in found)


def test_world_size_is_validated() -> None:
    with pytest.raises(ConfigError, match="must multiply to the world size 4"):
        load_job_config(["--job.config_file", DEBUG_TOML, "--parallelism.data_parallel_shard_degree", "3"],
                        world_size=4)
    cfg = load_job_config(["--job.config_file", DEBUG_TOML, "--parallelism.tensor_parallel_degree", "2"], world_size=4)
    assert cfg.parallelism.data_parallel_shard_degree == -1  # resolved later, never written back


@pytest.mark.parametrize("args, world_size, fields", [
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_split_points", "layers.3"], 2, ["runs 2 or more stage(s)"]),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--training.local_batch_size", "5"], 2, ["and a multiple of 2, but --training.local_batch_size 5"]),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4",
      "--training.seq_len", "36"], 8, ["--parallelism.context_parallel_degree 2 (and its 1/2 share by "
                                        "--parallelism.tensor_parallel_degree 4): context parallel splits each "
                                        "sequence into 4 load-balanced chunks. Try 32."]),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
      "--parallelism.tensor_parallel_degree", "2"], 4, ["--parallelism.pipeline_parallel_degree 2 x"]),
    (["--parallelism.tensor_parallel_degree", "3"], 3,
     ["attention heads", "kv heads", "--model.vocab_size_multiple_of 64", "--training.seq_len 256"]),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"], 2,
     ["--parallelism.enable_async_tensor_parallel"]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "every"], 1,
     ["--activation_checkpoint.selective_ac_option 'every'"]),
    (["--parallelism.data_parallel_replicate_degree", "0"], 1,
     ["--parallelism.data_parallel_replicate_degree 0 must be an integer >= 1"]),
    (["--training.global_batch_size", "8"], 2, ["--training.global_batch_size 8 must be a multiple of "
                                                "--training.local_batch_size 8 x data-parallel degree 2 = 16"]),
])
def test_parallel_rules(args: list[str], world_size: int, fields: list[str]) -> None:
    problems = problems_for(*args, world_size=world_size)
    assert len(problems) == len(fields), problems
    for problem, field in zip(problems, fields):
        assert field in problem, (field, problem)


def test_written_config_reads_back_identically(tmp_path: Path) -> None:
    cfg = parse_args(["--job.config_file", DEBUG_TOML, "--training.steps", "3", "--model.converters", "a,b",
                      "--optimizer.eps", "1e-12", "--job.description", 'quote " and \\ slash'])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = load_toml(path)
    again.job.config_file = cfg.job.config_file
    assert again == cfg


# Data mixtures and validation data


@pytest.mark.parametrize("entries, problem", [
    (["shipped"], "--training.mixture entry 'shipped' has no weight. Write DATASET[:PATH]=WEIGHT"),
    (["parquet:x=1"], "--training.mixture entry 'parquet:x=1' names dataset 'parquet', which is not one of shipped, "
                      "text, jsonl, hf, chat, prepared."),
    (["hf:some/set=1"], "--training.mixture hf entry 'some/set' is not a local folder: a dataset from the Hugging "
                        "Face hub is tokenized once, before training, with `python -m titan.data.prepare"),
    (["jsonl=2"], "--training.mixture entry 'jsonl=2' needs a path: jsonl:PATH=WEIGHT"),
    (["shipped:x.txt=1"], "--training.mixture entry 'shipped:x.txt=1' gives a path to shipped, which takes none."),
    (["shipped=0"], "--training.mixture entry 'shipped=0' has weight '0', which must be a positive finite number"),
    (["shipped=inf"], "--training.mixture entry 'shipped=inf' has weight 'inf', which must be a positive finite"),
    (["shipped=-1"], "--training.mixture entry 'shipped=-1' has weight '-1', which must be a positive finite"),
    (["text:/nonexistent/*.txt=1"], "--training.mixture entry 'text:/nonexistent/*.txt=1' has path "
                                    "'/nonexistent/*.txt', which matches no file or folder."),
    (["shipped=1", "shipped=2"], "--training.mixture lists shipped twice. Give each source once"),
])
def test_mixture_entry_rules(entries: list[str], problem: str) -> None:
    problems = problems_for("--training.mixture", *entries)
    assert len(problems) == 1 and problem in problems[0], problems


def test_mixture_excludes_dataset_flags() -> None:
    assert problems_for("--training.mixture", "shipped=1", f"jsonl:{DEBUG_TOML}=2.5") == []
    problems = problems_for("--training.mixture", "shipped=1", "--training.dataset", "text",
                            "--training.dataset_path", DEBUG_TOML)
    assert problems == [f"--training.mixture replaces --training.dataset and --training.dataset_path, but "
                        f"--training.dataset text --training.dataset_path {DEBUG_TOML!r} is also given. Drop it, or "
                        f"add it to the mixture as text:{DEBUG_TOML}=WEIGHT."]


def test_mixture_tables_in_toml_become_entries_and_round_trip(tmp_path: Path) -> None:
    toml = write(tmp_path, '[training]\nmixture = [{dataset = "shipped", weight = 1}, '
                           f'{{dataset = "jsonl", path = "{DEBUG_TOML}", weight = 0.25}}, "text:{DEBUG_TOML}=2"]\n')
    cfg = parse_args(["--job.config_file", toml])
    assert cfg.training.mixture == ["shipped=1", f"jsonl:{DEBUG_TOML}=0.25", f"text:{DEBUG_TOML}=2"]
    validate(cfg, world_size=1)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_toml(path).training.mixture == cfg.training.mixture


def test_malformed_mixture_tables_are_named(tmp_path: Path) -> None:
    toml = write(tmp_path, '[training]\nmixture = [{dataset = "shipped", wieght = 1}, {path = "a.jsonl", weight = 1},'
                           ' {dataset = "shipped", weight = "heavy"}]\n')
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", toml])
    assert err.value.problems == [
        f"{toml}: [training] mixture entry 1 {{'dataset': 'shipped', 'wieght': 1}} has unknown key(s) 'wieght'. "
        f"Keys: dataset, path, weight.",
        f"{toml}: [training] mixture entry 2 {{'path': 'a.jsonl', 'weight': 1}} needs dataset, and optionally path, "
        f'as strings (e.g. {{dataset = "jsonl", path = "data/code.jsonl", weight = 3}}).',
        f"{toml}: [training] mixture entry 3 {{'dataset': 'shipped', 'weight': 'heavy'}} needs a number weight (e.g. "
        f"weight = 1)."]


@pytest.mark.parametrize("args, world_size, problems", [
    (["--validation.dataset", "jsonl"], 1,
     ["--validation.dataset jsonl needs --validation.dataset_path (files, a folder or a glob"]),
    (["--validation.dataset", "text", "--validation.dataset_path", "/nonexistent.txt"], 1,
     ["--validation.dataset_path '/nonexistent.txt' matches no file or folder."]),
    (["--validation.dataset", "hf", "--validation.dataset_path", "org/set"], 1,
     ["--validation.dataset hf --validation.dataset_path 'org/set' is not a local folder"]),
    (["--validation.seq_len", "512"], 1,
     ["--validation.seq_len 512 is longer than --training.seq_len 256, the length the model's rotary table is built "
      "for. Use --validation.seq_len 256 or less."]),
    (["--validation.local_batch_size", "4", "--validation.seq_len", "128", "--parallelism.pipeline_parallel_degree",
      "2"], 2,
     ["--validation.local_batch_size 4 must equal --training.local_batch_size 8 under "
      "--parallelism.pipeline_parallel_degree 2: the pipeline schedule's micro-batch shapes are fixed. Use "
      "--validation.local_batch_size 8 or leave it unset.",
      "--validation.seq_len 128 must equal --training.seq_len 256 under --parallelism.pipeline_parallel_degree 2"]),
    (["--validation.seq_len", "102", "--parallelism.context_parallel_degree", "2",
      "--parallelism.tensor_parallel_degree", "2"], 4,
     ["--validation.seq_len 102 must be divisible by 2 x --parallelism.context_parallel_degree 2 (and its 1/2 share by "
      "--parallelism.tensor_parallel_degree 2): context parallel splits each sequence into 4 load-balanced chunks. "
      "Try 100."]),
    (["--validation.seq_len", "101", "--parallelism.tensor_parallel_degree", "2"], 2,
     ["--validation.seq_len 101 must be divisible by --parallelism.tensor_parallel_degree 2 (sequence parallel "
      "splits it). Try 100."]),
])
def test_validation_rules(args: list[str], world_size: int, problems: list[str]) -> None:
    """Each rule holds only with --validation.enable; unset sizes are training's and pass every rule."""
    found = problems_for("--validation.enable", *args, world_size=world_size)
    assert len(found) == len(problems) and all(want in got for want, got in zip(problems, found)), found
    assert problems_for(*args, world_size=world_size) == []
