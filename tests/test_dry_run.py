"""The dry run's contracts on small simulated jobs, and every shipped config's documented world size (CI dry-runs
each config at that size with scripts/dry_run_configs.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.dry_run import documented_world_size, dry_run_cli, main
from titan.estimate.report import format_report
from titan.estimate.simulate import DryRunResult, run_dry_run
from titan.estimate.trace import OFFLOADED
from titan.models.llama.args import LLAMA3_FLAVORS
from titan.models.llama.model import TransformerBlock

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_shipped_config_documents_its_world_size(config: Path) -> None:
    """CI's scripts/dry_run_configs.py runs each config's first and last rank at this size (minutes for 405B, so
    outside the test suite)."""
    assert documented_world_size(config) >= 1


def test_pipeline_layout_dry_runs_its_last_rank() -> None:
    """PP=2 x TP=2 x FSDP=2 of the debug model, the last rank (output and loss): every micro-batch receives this
    rank's sequence shard of the residual stream (float32 here) and sends its gradient back."""
    config = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--parallelism.tensor_parallel_degree",
              "2", "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    cfg = load_job_config([*config, "--job.dry_run"], 8)
    result = run_dry_run(cfg, 8, rank=7)
    assert result.stages == "stage 1"
    shard = 1 * (cfg.training.seq_len // 2) * 256 * 4  # (microbatch, seq / tp, dim) in float32
    received = [c.bytes for c in result.collectives if c.dim == "pp" and c.kind == "recv"]
    sent = [c.bytes for c in result.collectives if c.dim == "pp" and c.kind == "send"]
    assert received == [shard] * 4 and sent == [shard] * 4


def test_report_counts_fsdp_traffic_and_memory() -> None:
    """FSDP=8 of the 1B job: the rank holds 1/8 of the weights in float32 and twice that in Adam state; a step
    all-gathers the bf16 weights for forward and again for backward (minus the root and the last block, kept
    gathered) and reduce-scatters float32 gradients once. Every 1B weight splits evenly over 8 ranks, so no
    padding enters the byte counts."""
    world_size = 8
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / "llama3_1b.toml"), "--job.dry_run"],
                          world_size)
    result = run_dry_run(cfg, world_size, rank=3)
    shard = result.num_params / world_size
    assert result.local_params == pytest.approx(shard, rel=1e-3)
    assert result.memory.by_category["parameters"] == pytest.approx(4 * shard, rel=0.01)
    assert result.memory.by_category["optimizer state"] == pytest.approx(8 * shard, rel=0.01)
    gathered = sum(c.bytes for c in result.collectives if c.kind == "all_gather" and c.dim == "dp_shard")
    scattered = sum(c.bytes for c in result.collectives if c.kind == "reduce_scatter" and c.dim == "dp_shard")
    with torch.device("meta"):
        block_params = sum(p.numel() for p in TransformerBlock(LLAMA3_FLAVORS["1B"]).parameters())
    assert scattered == 4 * result.num_params
    assert gathered == 2 * result.num_params + 2 * block_params * (LLAMA3_FLAVORS["1B"].n_layers - 1)
    report = format_report(result, cfg.estimate)
    assert "tokens/s per GPU" in report and "dp_shard" in report


def test_memory_savers_are_accounted() -> None:
    """FSDP=2 of the debug model: bfloat16 optimizer state holds half the bytes of float32 state; CPU offload takes
    the sharded parameters, their gradients and the optimizer state off the GPU (a lower peak, nothing in those
    categories) and reports them as host memory: at least the parameters and state a plain rank holds."""
    config = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dry_run"]

    def dry_run(*flags: str) -> DryRunResult:
        return run_dry_run(load_job_config([*config, *flags], 2), 2, rank=0)

    plain, bf16_state = dry_run().memory, dry_run("--optimizer.state_dtype", "bfloat16").memory
    offloaded_run = dry_run("--training.enable_cpu_offload")
    offloaded = offloaded_run.memory
    assert bf16_state.by_category["optimizer state"] == pytest.approx(plain.by_category["optimizer state"] / 2,
                                                                      rel=0.01)
    assert plain.host == bf16_state.host == 0
    assert all(offloaded.by_category[name] == 0 for name in OFFLOADED)
    assert offloaded.total < plain.total
    assert offloaded.host >= plain.by_category["parameters"] + plain.by_category["optimizer state"]
    assert "host memory (CPU offload)" in format_report(offloaded_run, load_job_config(config, 2).estimate)


def test_dry_run_keeps_attention_as_the_simulated_gpu_would() -> None:
    """Full AC on a GPU keeps attention outputs when the job compiles and recomputes them in eager mode
    (titan/parallel/ac.py keeps_attention), although the dry run itself never compiles: the recorded step of the
    6-block debug model runs attention forward 6 times (kept) or 12 (recomputed), backward 6 times, and keeping
    holds more memory at the peak."""
    flags = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--activation_checkpoint.mode", "full"]
    eager = run_dry_run(load_job_config([*flags, "--job.dry_run"], 1), 1, rank=0)
    compiled = run_dry_run(load_job_config([*flags, "--training.compile", "--job.dry_run"], 1), 1, rank=0)
    assert sum(op.attention for op in eager.ops) == 12 + 6
    assert sum(op.attention for op in compiled.ops) == 6 + 6
    assert compiled.memory.total > eager.memory.total


# PyTorch's own test for native bf16 matmuls on this CPU (AVX512-BF16 or AMX, through oneDNN).
NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("cases", [
    ["debug-ac-none", "debug-ac-full", "debug-ac-selective", "debug-fsdp2", "debug-tp2"],
    pytest.param(["100M-ac-selective"], marks=pytest.mark.skipif(
        not NATIVE_BF16, reason="without native bf16 matmuls a CPU runs the 100M flavor's bf16 steps in minutes "
                                "(7.5 min on 2 cores with ATEN_CPU_CAPABILITY=avx2, 17 s with AVX512-BF16)")),
], ids=["debug", "100M-bf16"])
def test_predictions_match_real_cpu_runs(cases: list[str]) -> None:
    """The dry run against real steps on this machine (scripts/validate_estimate.py, the table in docs/scale.md):
    peak tensor memory within 10% (MemTracker on the real step) and the same collective bytes per mesh dim on 2
    gloo ranks, for no AC, full AC, selective AC, FSDP=2 and TP=2 on the debug model (float32), and selective AC on
    the 100M flavor in bf16 autocast."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_estimate.py"), "--check", *cases],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"All {len(cases)} cases within 10%." in result.stdout


def test_step_time_off_the_measurement_is_a_problem() -> None:
    """validate_estimate --cuda --check: a predicted step time past --step-tolerance of the measured one fails."""
    from validate_estimate import Case, compare

    case = Case("1B-cuda-ac-none", 1, ())
    measured = {"peak": 2**30, "collectives": {}, "step_s": 0.352}
    _, close = compare(case, {"peak": 2**30, "collectives": {}, "step_s": 0.346}, measured, 0.10, 0.30)
    _, far = compare(case, {"peak": 2**30, "collectives": {}, "step_s": 0.2}, measured, 0.10, 0.30)
    assert close == []
    assert far == ["1B-cuda-ac-none: predicted step time 200.0 ms is -43.2% off the measured 352.0 ms "
                   "(tolerance 30%)."]


def test_not_fitting_is_a_config_error() -> None:
    """8B with 8 sequences of 8192 tokens per GPU does not fit an H100: the dry run says so and which fields help."""
    with pytest.raises(ConfigError, match="--activation_checkpoint.mode"):
        dry_run_cli(["--job.config_file", str(ROOT / "configs" / "llama3_8b.toml"), "--estimate.gpu", "H100",
                     "--training.local_batch_size", "8"], 8, ranks=[0])


def test_cli_rejects_a_rank_outside_the_job() -> None:
    assert main(["--world_size", "8", "--rank", "8", "--job.config_file",
                 str(ROOT / "configs" / "llama3_8b.toml")]) == 2
