"""scripts/gpu_check.py on the CPU, everything of it that needs no GPU: its list of CUDA-only tests against the
suite, the kernel comparisons that have a CPU path (torch._grouped_mm and the bf16-state update run on the CPU
too), the NaN-skip rules, the parsers of the runs it times, the table and its section of docs/performance.md, the
documented device command, and torchtitan's side of the 1B job (its config, model shape, tokenizer and data;
torchtitan 0.3.0 trains on CUDA only). The FlexAttention check has no CPU run: torch has no FlexAttention backward
on the CPU (tests/test_attention.py covers the masks it compares)."""

from pathlib import Path

import pytest
import torch

import gpu_check
import train_levers_off
from gpu_check import (
    BEGIN,
    CUDA_ONLY_TESTS,
    DEVICE_COMMAND,
    END,
    TITAN_1B_JOB,
    TORCHTITAN_MATCHED_FLAGS,
    CheckFailed,
    Result,
)
from levers import LEVERS, levers_off
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer
from titan.models.common.family import BuildOptions
from titan.models.common.flops import num_params
from titan.models.families import FAMILIES
from titan.validate import load_job_config

from harness.train_script import run_train_argv

ROOT = Path(__file__).resolve().parents[1]


def test_every_cuda_only_test_is_listed_and_exists() -> None:
    """The list the GPU runs names every test marked skipif(not torch.cuda.is_available()), and each of its ids
    still names a test: a renamed or moved test fails here, in CI, before a GPU minute is spent on it."""
    unlisted = set(gpu_check.cuda_only_tests_in(ROOT / "tests")) - set(CUDA_ONLY_TESTS)
    assert not unlisted, f"add to CUDA_ONLY_TESTS in scripts/gpu_check.py: {sorted(unlisted)}"
    collected = gpu_check.collected_node_ids(CUDA_ONLY_TESTS)
    assert gpu_check.missing_node_ids(CUDA_ONLY_TESTS, collected) == []


def test_cuda_only_tests_are_found_by_their_mark(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_kernels.py").write_text(
        "import pytest\nimport torch\n\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')\ndef test_on_gpu():\n    pass\n\n"
        "@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU only')\ndef test_on_cpu():\n    pass\n")
    assert gpu_check.cuda_only_tests_in(tests) == ["tests/test_kernels.py::test_on_gpu"]


def test_missing_node_ids_name_the_tests_that_are_gone() -> None:
    collected = ["tests/test_cp.py::test_ring[allgather]", "tests/test_cp.py::test_ring[alltoall]",
                 "tests/test_train.py::test_loop"]
    listed = ["tests/test_cp.py::test_ring", "tests/test_train.py::test_loop", "tests/test_train.py::test_gone",
              "tests/test_cp.py::test_rin"]
    assert gpu_check.missing_node_ids(listed, collected) == ["tests/test_train.py::test_gone",
                                                             "tests/test_cp.py::test_rin"]


def test_junit_outcomes_tell_passed_failed_and_skipped(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cp" name="test_ring[allgather]" />'
        '<testcase classname="tests.test_mx" name="test_native"><skipped message="this GPU runs MX natively" />'
        '</testcase><testcase classname="tests.test_train" name="test_loop"><failure message="sync in step 3" />'
        '</testcase></testsuite></testsuites>')
    assert gpu_check.junit_outcomes(report) == {
        "tests.test_cp::test_ring[allgather]": "passed",
        "tests.test_mx::test_native": "skipped: this GPU runs MX natively",
        "tests.test_train::test_loop": "failure: sync in step 3"}


def test_grouped_matmuls_match_the_expert_loop_on_cpu() -> None:
    """torch._grouped_mm runs in bf16 on the CPU as well (moe.py's grouped_mm_supported), so the check's rule runs
    here as on the GPU."""
    assert "within" in gpu_check.grouped_mm_against_loop(torch.device("cpu"))


def test_bf16_state_update_compiled_matches_eager_on_cpu() -> None:
    assert "skipped bit for bit" in gpu_check.bf16_adam_compiled_against_eager(torch.device("cpu"), numel=100_003)


def test_the_bf16_rule_refuses_a_kernel_far_from_the_golden() -> None:
    golden = torch.linspace(-1, 1, 1000)
    reference = golden.bfloat16()
    assert gpu_check.within_bf16_error("output", reference, reference, golden) <= 1
    with pytest.raises(CheckFailed, match="output: largest error against fp32"):
        gpu_check.within_bf16_error("output", (golden + 0.05).bfloat16(), reference, golden)


def metrics(losses: list[float], lrs: list[float]) -> list[dict]:
    return [{"step": step, "loss": loss, "lr": lr} for step, (loss, lr) in enumerate(zip(losses, lrs), start=1)]


def test_a_skipped_nan_step_is_recognised_and_a_missed_skip_is_not() -> None:
    skip = [{"step": 3, "kind": "nonfinite", "action": "skip"}]
    skipped = metrics([8.2, 8.1, float("nan"), 8.0], [1e-4, 2e-4, 3e-4, 3e-4])
    assert gpu_check.nan_skip_problems(skipped, skip, nan_step=3, steps=4) == []
    applied = metrics([8.2, 8.1, float("nan"), float("nan")], [1e-4, 2e-4, 3e-4, 4e-4])
    assert gpu_check.nan_skip_problems(applied, [], nan_step=3, steps=4) == [
        "anomalies.jsonl holds [], not one skip at step 3",
        "the LR moved on after the skipped step 3: the update was not skipped",
        "a loss other than the injected NaN is not finite"]
    assert gpu_check.largest_loss_difference(skipped, metrics([8.2, 8.1, 9.9, 8.00005], [0] * 4), 3) == \
        pytest.approx(5e-5)


def test_the_throughput_lines_of_benchmark_and_torchtitan_are_read() -> None:
    benchmark = ("model debugmodel  device cuda:0  batch 8x256\ntitan  tokens/s       86,796\n"
                 "bare   tokens/s       95,450\ntitan/bare ratio 0.857 (0.806-0.909)  (tokens/s, median over rounds, "
                 "and range)\n")
    assert gpu_check.benchmark_summary(benchmark) == ("titan tokens/s 86,796; bare tokens/s 95,450; titan/bare ratio "
                                                      "0.857 (0.806-0.909)")
    with pytest.raises(CheckFailed, match="its output changed"):
        gpu_check.benchmark_summary("titan  tokens/s 1\n")
    # torchtitan 0.3.0's MetricsProcessor.log line, colours off
    torchtitan = ("[titan] 2026-11-27 14:09:31,684 - root - INFO - step: 10  loss:  8.15627  grad_norm:  0.7276  "
                  "memory: 20.12GiB(25.41%)  tps: 41,234  tflops: 374.71  mfu: 37.89%\n"
                  "[titan] 2026-11-27 14:09:31,690 - root - INFO - Synchronizing and adjusting timeout\n")
    assert gpu_check.torchtitan_records(torchtitan) == [{"step": 10, "tps": 41234.0, "mfu": 37.89}]
    records = [{"step": 1, "tps": 10.0}, {"step": 5, "tps": 20.0}, {"step": 10, "tps": 40.0}, {"step": 15, "tps": 42.0}]
    assert gpu_check.median_after_warmup(records, "tps", warmup_steps=5) == 41.0
    with pytest.raises(CheckFailed, match="no logged mfu_pct after step 5"):
        gpu_check.median_after_warmup(records, "mfu_pct", warmup_steps=5)


def results() -> list[Result]:
    return [Result("flex", "FlexAttention", True, 21.4, "within 0.41 | of the tolerance"),
            Result("torchtitan_1B", "torchtitan 0.3.0", False, 60.2, "exit 1: ImportError")]


def test_the_table_marks_failures_and_replaces_only_its_section(tmp_path: Path) -> None:
    section = gpu_check.render_section("2026-11-27, NVIDIA H100 80GB HBM3", results())
    assert section.startswith(BEGIN) and section.endswith(END)
    assert "| FlexAttention | ok | 21 | within 0.41 / of the tolerance |" in section
    assert "| torchtitan 0.3.0 | **FAILED** | 60 | exit 1: ImportError |" in section
    assert "Not matched between the Titan and torchtitan runs" in section
    text = f"# Performance\n\nbefore\n\n{BEGIN}\nan older table\n{END}\n\nafter\n"
    replaced = gpu_check.replace_section(text, section, "performance.md")
    assert replaced == f"# Performance\n\nbefore\n\n{section}\n\nafter\n"
    with pytest.raises(ValueError, match="must hold one <!-- gpu_check:begin --> ... <!-- gpu_check:end --> section"):
        gpu_check.replace_section("# Performance\n", section, "performance.md")


def test_a_device_runs_table_is_pasted_into_the_docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text((ROOT / "docs" / "performance.md").read_text())
    monkeypatch.setattr(gpu_check, "DOC", doc)
    returned = tmp_path / "gpu_check.md"
    returned.write_text(gpu_check.render_section("a run", results()) + "\n")
    gpu_check.apply_section(returned)
    assert doc.read_text().count(BEGIN) == 1 and "| torchtitan 0.3.0 | **FAILED** |" in doc.read_text()


def test_each_selection_fills_its_own_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A --perf run's table replaces the perf section and leaves the proof's (and the levers') as they were."""
    doc = tmp_path / "performance.md"
    doc.write_text((ROOT / "docs" / "performance.md").read_text())
    monkeypatch.setattr(gpu_check, "DOC", doc)
    before = doc.read_text()
    returned = tmp_path / "gpu_check.md"
    returned.write_text(gpu_check.render_section("a perf run", results(), "perf") + "\n")
    gpu_check.apply_section(returned)
    after = doc.read_text()
    for selection in ("proof", "levers"):
        begin, end = gpu_check.section_of(before, "before", selection)
        assert before[begin:end] in after
    begin, end = gpu_check.section_of(after, "after", "perf")
    assert after[begin:end].startswith("<!-- gpu_check perf:begin -->\na perf run")
    with pytest.raises(ValueError, match="holds no gpu_check table"):
        gpu_check.selection_of_section("no markers", "returned.md")


def test_the_selections_run_issue_51s_rows_in_its_order() -> None:
    """Every selection names existing checks; --perf starts with the matched eager pair, then the compiled pair,
    then the recommended job; --levers runs the matched job with all levers on before each one off."""
    keys = {check.key for check in gpu_check.CHECKS}
    assert all(set(names) <= keys for names in gpu_check.SELECTIONS.values())
    assert gpu_check.SELECTIONS["perf"] == ["titan_1B_fsdp", "torchtitan_1B", "titan_1B_fsdp_compiled",
                                            "torchtitan_1B_compiled", "titan_1B_recommended"]
    levers = gpu_check.SELECTIONS["levers"]
    assert levers[0] == "titan_1B_fsdp" and {f"lever_{name}" for name in LEVERS} <= set(levers)


def test_every_lever_off_keeps_the_loss(tmp_path: Path) -> None:
    """scripts/train_levers_off.py's command line with all of scripts/levers.py's changes off trains the debug model
    to the losses of train.py with them on (fp32 on the CPU: the same arithmetic but RoPE's rounding order). Both in
    this process: the script is its parse and the levers around train.py's main."""
    flags = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--training.steps", "3",
             "--metrics.log_freq", "1"]
    names, train_argv = train_levers_off.parse(["--off", ",".join(LEVERS), "--", *flags])
    assert names == list(LEVERS) and train_argv == flags
    with levers_off(names):
        off = run_train_argv([*train_argv, "--job.dump_folder", str(tmp_path / "off")])
    assert off.returncode == 0, off.stdout[-3000:]
    on = run_train_argv([*flags, "--job.dump_folder", str(tmp_path / "on")])
    assert on.returncode == 0, on.stdout[-3000:]
    losses = {name: [record["loss"] for record in gpu_check.step_records(tmp_path / name)] for name in ("on", "off")}
    assert len(losses["on"]) == 3
    assert losses["off"] == pytest.approx(losses["on"], abs=1e-5)
    with pytest.raises(SystemExit):
        train_levers_off.parse(["--off", "fused_norm,no_such_lever", "--"])


def test_the_device_command_is_the_documented_one() -> None:
    """One shell line under the device tool's 2,000 characters, that installs the carried wheels first, in the docs
    and in scripts/gpu_wheels.sh as the script runs it."""
    assert len(DEVICE_COMMAND) < 2000 and "\n" not in DEVICE_COMMAND
    assert DEVICE_COMMAND.startswith("python3 -m pip install") and ".whl/*.whl" in DEVICE_COMMAND
    assert DEVICE_COMMAND in (ROOT / "docs" / "performance.md").read_text()
    assert DEVICE_COMMAND in (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    assert gpu_check.ANOMALY_PROBE.exists()


def titan_job_and_model() -> tuple:
    """Titan's config of the job torchtitan is compared on, and its 1B model on the meta device."""
    cfg = load_job_config([*TITAN_1B_JOB, *TORCHTITAN_MATCHED_FLAGS, "--job.dry_run"], world_size=1)
    vocab_size = build_tokenizer(str(ROOT / SHIPPED_TOKENIZER)).vocab_size
    family = FAMILIES["llama3"]
    args = family.build_args("1B", BuildOptions(vocab_size=vocab_size, vocab_size_multiple_of=64,
                                                max_seq_len=cfg.training.seq_len))
    with torch.device("meta"):
        model = family.model(args)
    return cfg, args, model


def test_torchtitan_gets_titans_1b_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/torchtitan_llama3_1b.py, through torchtitan's own config parser with the flags gpu_check.py passes:
    the same parameters and FLOPs per token as Titan's 1B model, the job's settings, the same token ids from the
    shipped tokenizer, and a batch from the shipped corpus, all offline."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed; scripts/gpu_wheels.sh downloads it")
    from torchtitan.config import ConfigManager

    import torchtitan_llama3_1b

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    tokenizer_folder, data_folder = gpu_check.torchtitan_assets(tmp_path)
    flags = gpu_check.torchtitan_flags(tokenizer_folder, data_folder, tmp_path / "out")
    config = ConfigManager().parse_args(torchtitan_llama3_1b.torchtitan_argv(flags))
    cfg, args, model = titan_job_and_model()

    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        torchtitan_model = model_config.build()
    titan_flops = FAMILIES["llama3"].flops_per_token(args, model, cfg.training.seq_len)
    assert model_config.get_nparams_and_flops(torchtitan_model, config.training.seq_len) == (
        num_params(model, exclude_embedding=False), titan_flops)
    training = config.training
    assert (training.local_batch_size, training.seq_len, training.mixed_precision_param, training.max_norm) == (
        cfg.training.local_batch_size, cfg.training.seq_len, cfg.training.mixed_precision_param, cfg.training.max_norm)
    assert training.steps == gpu_check.RUN_1B_STEPS and not config.compile.enable and not cfg.compile.enable
    optimizer = config.optimizer.param_groups[0].optimizer_kwargs
    assert (optimizer["lr"], optimizer["betas"], optimizer["eps"], optimizer["weight_decay"]) == (
        cfg.optimizer.lr, (cfg.optimizer.beta1, cfg.optimizer.beta2), cfg.optimizer.eps, cfg.optimizer.weight_decay)
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    assert cfg.activation_checkpoint.selective_ac_option == "op" and cfg.model.attn_backend == "flex"

    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    titan_tokenizer = build_tokenizer(str(ROOT / SHIPPED_TOKENIZER))
    text = "def train(steps: int) -> None:\n    return None  # ünïcode"
    assert tokenizer.encode(text, add_bos=True, add_eos=True) == titan_tokenizer.encode(text, bos=True, eos=True)
    dataloader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=training.seq_len,
                                         local_batch_size=training.local_batch_size)
    inputs, labels = next(iter(dataloader))
    assert labels.shape == (cfg.training.local_batch_size, cfg.training.seq_len)
    assert int(inputs["input"].max()) < titan_tokenizer.vocab_size

