"""The dry run's contracts on small simulated jobs, and every shipped config's documented world size (CI dry-runs
each config at that size with scripts/dry_run_configs.py)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend

from titan.config.errors import ConfigError
from titan.dry_run import documented_world_size, dry_run_cli, main
from titan.estimate import rank_server
from titan.estimate.fake_cuda import cuda_refusal, sdpa_backend
from titan.estimate.report import format_report
from titan.estimate.simulate import DryRunResult, run_dry_run
from titan.estimate.trace import SCALED_MM_V2, op_flops, precision_class
from titan.models.llama.args import LLAMA3_FLAVORS, ffn_hidden_dim
from titan.models.llama.model import Transformer, TransformerBlock
from titan.train.muon import least_loaded_owners, matrix_cost
from titan.validate import load_job_config

aten = torch.ops.aten
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


def test_muons_newton_schulz_and_exchanges_are_counted() -> None:
    """Muon on the debug model under FSDP 2: the update's matmul FLOPs on rank 0 are Newton-Schulz's on exactly the
    matrices it owns (the owner assignment's), and its all-to-alls move, in bfloat16, its chunk of every matrix to the
    owners and its owned matrices' chunks back; the report gives their share of the step."""
    world_size = 2
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
                           "--parallelism.data_parallel_shard_degree", "2", "--optimizer.name", "Muon",
                           "--job.dry_run"], world_size)
    result = run_dry_run(cfg, world_size, rank=0)
    with torch.device("meta"):
        model = Transformer(replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256))
    matrices = [param for fqn, param in model.named_parameters() if param.ndim == 2 and fqn.startswith("layers.")]
    owners = least_loaded_owners([matrix_cost(param, cfg.optimizer.ns_steps) for param in matrices], world_size)
    owned = [param for param, owner in zip(matrices, owners) if owner == 0]
    assert 0 < len(owned) < len(matrices)
    assert sum(op.flops for op in result.update_ops) == sum(matrix_cost(param, 5) for param in owned)
    local_rows = [-(-param.size(0) // world_size) for param in matrices]  # FSDP's chunks: rank 0's the larger
    moved = 2 * (sum(rows * param.size(1) for rows, param in zip(local_rows, matrices))
                 + sum(param.numel() for param in owned))
    assert {c.kind for c in result.update_collectives} == {"all_to_all"}
    assert sum(c.bytes for c in result.update_collectives) == moved
    assert "optimizer update (Muon):" in format_report(result, cfg.estimate)


def test_memory_savers_are_accounted() -> None:
    """FSDP=2 of the debug model: bfloat16 optimizer state holds half the bytes of float32 state; CPU offload takes
    the sharded parameters, their gradients and the optimizer state off the GPU (a lower peak; of the parameters'
    category only the buffers stay, the rotary table) and reports them as host memory: at least the parameters and
    state a plain rank holds."""
    config = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dry_run"]

    def dry_run(*flags: str) -> DryRunResult:
        return run_dry_run(load_job_config([*config, *flags], 2), 2, rank=0)

    plain, bf16_state = dry_run().memory, dry_run("--optimizer.state_dtype", "bfloat16").memory
    offloaded_run = dry_run("--training.enable_cpu_offload")
    offloaded = offloaded_run.memory
    assert bf16_state.by_category["optimizer state"] == pytest.approx(plain.by_category["optimizer state"] / 2,
                                                                      rel=0.01)
    assert plain.host < 2**20 and bf16_state.host < 2**20  # the batches' host copies and the step's readback
    assert offloaded.by_category["gradients"] == offloaded.by_category["optimizer state"] == 0
    args = replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=load_job_config(config, 2).training.seq_len)
    with torch.device("meta"):
        rope_bytes = sum(b.numel() * b.element_size() for b in Transformer(args).buffers())
    assert offloaded.by_category["parameters"] == rope_bytes
    assert offloaded.total < plain.total
    assert offloaded.host >= plain.by_category["parameters"] + plain.by_category["optimizer state"]
    assert "host memory (CPU offload)" in format_report(offloaded_run, load_job_config(config, 2).estimate)


def test_each_rank_is_a_child_of_one_serving_process() -> None:
    """Ranks are simulated in children forked from one process per shim, which imported torch once: a later dry run
    reuses it and reports what the first did."""
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dry_run"], 2)
    first = run_dry_run(cfg, 2, rank=0, simulate_gpu=False)
    server = rank_server.SERVERS[""].process
    second = run_dry_run(cfg, 2, rank=0, simulate_gpu=False)
    assert rank_server.SERVERS[""].process is server and server.poll() is None
    assert second.memory.total == first.memory.total and len(second.ops) == len(first.ops)


def test_dry_run_keeps_attention_as_the_simulated_gpu_would() -> None:
    """Full AC on a GPU keeps attention outputs when the job compiles and recomputes them in eager mode
    (titan/parallel/ac.py keeps_attention), although the dry run itself never compiles: the
    recorded step of the 6-block debug model runs attention forward 6 times (kept) or 12 (recomputed), backward 6
    times, and keeping holds more memory at the peak."""
    flags = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--activation_checkpoint.mode", "full"]
    eager = run_dry_run(load_job_config([*flags, "--job.dry_run"], 1), 1, rank=0)
    compiled = run_dry_run(load_job_config([*flags, "--training.compile", "--job.dry_run"], 1), 1, rank=0)
    assert sum(op.attention for op in eager.ops) == 12 + 6
    assert sum(op.attention for op in compiled.ops) == 6 + 6
    assert compiled.memory.total > eager.memory.total


def test_predictions_match_real_cpu_runs() -> None:
    """The dry run against real steps on this machine (scripts/validate_estimate.py, the table in docs/scale.md):
    peak tensor memory within 10% (MemTracker on the real step) and the same collective bytes per mesh dim on 2
    gloo ranks, for full AC, FSDP=2 and TP=2 on the debug model in float32, and selective AC on it in bf16
    autocast. The script's other cases are its alone: no AC and float32 selective AC take no path of the estimator
    that these four miss, and the 100M flavor's take minutes without native bf16 matmuls."""
    cases = ["debug-ac-full", "debug-fsdp2", "debug-tp2", "debug-bf16-ac-selective"]
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
    """The 1B flavor with 8 sequences of 8192 tokens per GPU and no AC does not fit an H100: the dry run says so, once,
    and which fields help."""
    with pytest.raises(ConfigError) as raised:
        dry_run_cli(["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--model.flavor", "1B",
                     "--training.seq_len", "8192", "--training.local_batch_size", "8",
                     "--training.mixed_precision_param", "bfloat16", "--estimate.gpu", "H100"], 8, ranks=[0])
    message = str(raised.value)
    assert message.startswith("Config error: Rank 0 of 8 would need") and "more than the 74.5 GiB of an H100" in message
    assert "--activation_checkpoint.mode" in message


def test_cli_rejects_a_rank_outside_the_job() -> None:
    assert main(["--world_size", "8", "--rank", "8", "--job.config_file",
                 str(ROOT / "configs" / "llama3_8b.toml")]) == 2


def fake_cuda(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="cuda", dtype=dtype)


def test_cuda_rules_refuse_what_a_gpu_refuses() -> None:
    """torch's fake tensors let a CPU 0-dim tensor into torch.stack beside a CUDA one (clipping's failure on every
    GPU, issue 33); the dry run's rules refuse it as CUDA does, and let through what CUDA takes: copies, CPU scalars
    of elementwise ops and of fill_, CPU index tensors."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        scalar, vector, index = torch.zeros(()), torch.zeros(3), torch.zeros(2, dtype=torch.long)
        gpu_scalar, gpu = fake_cuda(), fake_cuda(3)
        refused = {
            "stack of a CPU and a CUDA scalar": (aten.stack.default, ([scalar, gpu_scalar],), {}),
            "cat with a CPU vector": (aten.cat.default, ([vector, gpu],), {}),
            "add of a CPU vector": (aten.add.Tensor, (gpu, vector), {}),
            "a CPU scalar written from a CUDA tensor": (aten.add_.Tensor, (scalar, gpu_scalar), {}),
        }
        allowed = {
            "a copy to the GPU": (aten._to_copy.default, (vector,), {"device": torch.device("cuda")}),
            "a CPU scalar operand": (aten.mul.Tensor, (gpu, scalar), {}),
            "fill_ with a CPU scalar": (aten.fill_.Tensor, (gpu, scalar), {}),
            "CPU indices": (aten.index.Tensor, (gpu, [index]), {}),
        }
        for name, (func, args, kwargs) in refused.items():
            assert cuda_refusal(func, args, kwargs) is not None, name
        for name, (func, args, kwargs) in allowed.items():
            assert cuda_refusal(func, args, kwargs) is None, name


def test_sdpa_kernel_choice_follows_cuda() -> None:
    """The kernel a simulated GPU's SDPA runs, by torch's CUDA rule: flash for 16-bit causal attention (grouped kv
    heads read in place), memory-efficient for a mask or float32, and the math fallback, which holds every score,
    for a mask with grouped kv heads: the case the model avoids by expanding them on CUDA (SDPAAttention)."""
    with FakeTensorMode():
        q, k = fake_cuda(1, 8, 64, 64, dtype=torch.bfloat16), fake_cuda(1, 2, 64, 64, dtype=torch.bfloat16)
        mask = torch.ones(1, 1, 64, 64, dtype=torch.bool, device="cuda")
        assert sdpa_backend(q, k, k, None, enable_gqa=True) == SDPBackend.FLASH_ATTENTION
        assert sdpa_backend(q, q, q, mask, enable_gqa=False) == SDPBackend.EFFICIENT_ATTENTION
        assert sdpa_backend(q.float(), q.float(), q.float(), None, enable_gqa=False) == SDPBackend.EFFICIENT_ATTENTION
        assert sdpa_backend(q, k, k, mask, enable_gqa=True) == SDPBackend.MATH


def test_the_simulated_gpu_runs_the_fused_attention_kernels() -> None:
    """The debug model's block-causal attention in bf16 on the simulated GPU: the mask sends SDPA to the
    memory-efficient kernel, with the kv heads expanded (the model's CUDA branch); without that branch the math
    fallback would run, whose matmuls the report would not count as attention."""
    flags = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--training.mixed_precision_param",
             "bfloat16"]
    result = run_dry_run(load_job_config([*flags, "--job.dry_run"], 1), 1, rank=0)
    assert sum(op.attention for op in result.ops) == 2 * LLAMA3_FLAVORS["debugmodel"].n_layers


@pytest.mark.parametrize("config, world_size, flags", [
    ("debug_model.toml", 1, ["--training.enable_cpu_offload"]),
    ("qwen3_debug_moe.toml", 2, ["--training.enable_cpu_offload"]),
], ids=["offload-one-gpu", "expert-parallel-offload"])
def test_cpu_offload_dry_runs_on_the_simulated_gpu(config: str, world_size: int, flags: list[str]) -> None:
    """CPU offload on the simulated GPU: on one GPU over a one-rank FSDP mesh, and with expert parallel, whose
    experts' shards go to host memory with the rest (before, their gradients' norm stayed on the GPU and clipping
    stacked it with the host's, which a GPU refuses). The offloaded bytes are host memory."""
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / config), *flags, "--job.dry_run"], world_size)
    result = run_dry_run(cfg, world_size, rank=0)
    assert result.memory.host > 0
    assert result.memory.by_category["gradients"] == result.memory.by_category["optimizer state"] == 0


@pytest.mark.parametrize("gpu, converter, padded_rows", [("H100", "float8", 2112), ("B200", "mx", 2176)])
def test_experts_fsdp_inside_checkpointed_blocks_dry_run_on_the_simulated_gpu(gpu: str, converter: str,
                                                                              padded_rows: int) -> None:
    """Qwen3-MoE with expert FSDP (EP 2 of 4 data-parallel ranks) in blocks that keep attention under compile (full
    AC with a selective-checkpoint context): on CUDA the experts' FSDP unit, first of the recompute, opens one more
    profiler range than in forward, and torch 2.13's selective checkpointing refused the backward (issue 33, found by
    the simulated GPU; the CPU build took the same path without that range).

    With every MoE layer's experts in low precision where torch has their kernels, float8 rowwise on a simulated H100
    and MXFP8 on a simulated B200 (dense linears in bf16): every expert matmul is a native torch._scaled_grouped_mm,
    whose meta checks (operand layouts, scale shapes, offsets) a GPU applies, counted at the float8 peak. Each rank's
    experts get an even share of the routed tokens, 4 x 256 x top 2 = 2048 rows, which the converter pads to whole
    blocks of 16 (float8) or 32 (MX) per expert: an upper bound of 2048 + 4 local experts x 15 (or 31) rows, rounded
    up, 2112 and 2176. Each layer runs 12 grouped matmuls (3 forward, 3 recomputed, 3 grad_input, 3 grad_weight) of
    2 x rows x dim x hidden FLOPs."""
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / "qwen3_debug_moe.toml"),
                           "--activation_checkpoint.mode", "full", "--training.compile",
                           "--training.mixed_precision_param", "bfloat16", "--estimate.gpu", gpu,
                           "--model.converters", converter, "--float8.recipe_name", "rowwise",
                           f"--{converter}.filter_fqns", "output", "attention", "--job.dry_run"], 4)
    result = run_dry_run(cfg, 4, rank=0)
    assert result.memory.total > 0
    dim = hidden = 256
    expected = 12 * 2 * dim * hidden * 6 * padded_rows
    assert sum(op.flops for op in result.ops if op.precision == "fp8") == expected


def test_blockwise_float8_linears_run_natively_on_the_simulated_hopper() -> None:
    """--float8.recipe_name blockwise on a simulated H100: every converted linear's three matmuls are
    F.scaled_mm calls with 1 x 128 and 128 x 128 scales, whose meta checks (row-major and column-major operands,
    column-major scales, the weight's scales padded to 4 blocks) a GPU applies, counted at the float8 peak: 42 linears
    (the 2256-row output is skipped: not a multiple of 128) x 3 matmuls x 2 x 2048 tokens x in x out."""
    cfg = load_job_config(["--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
                           "--training.mixed_precision_param", "bfloat16", "--model.converters", "float8",
                           "--float8.recipe_name", "blockwise", "--job.dry_run"], 1)
    result = run_dry_run(cfg, 1, rank=0)
    args = LLAMA3_FLAVORS["debugmodel"]
    kv = args.n_kv_heads * args.dim // args.n_heads
    hidden = ffn_hidden_dim(args)
    per_layer = args.dim * (2 * args.dim + 2 * kv) + 3 * args.dim * hidden
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    assert sum(op.flops for op in result.ops if op.precision == "fp8") == 3 * 2 * tokens * per_layer * args.n_layers


def test_pipelined_experts_fsdp_inside_recording_checkpoints_dry_runs_on_the_simulated_gpu() -> None:
    """DeepSeek-V3's 671B layout in miniature on 8 simulated H100s: PP 2, EP 2, the experts FSDP-sharded over 2
    inside blocks that compile and keep attention under full AC (a selective-checkpoint context, which records each
    block's ops). The last pipeline rank's second micro-batch gathered its experts in the recompute and not in its
    forward while they were resharded after every forward: torch 2.13 refused the backward there
    (fsdp.split_with_sizes_copy "not found in storage"); the experts now stay gathered between micro-batches
    (titan/parallel/fsdp.py reshard_experts_after_forward)."""
    flags = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.local_batch_size", "2",
             "--training.seq_len", "64", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
             "--activation_checkpoint.mode", "full", "--training.compile", "--training.mixed_precision_param",
             "bfloat16", "--job.dry_run"]
    result = run_dry_run(load_job_config(flags, 8), 8, rank=7)
    assert result.memory.total > 0


def test_nvfp4_matmuls_count_both_elements_of_each_byte() -> None:
    """torch.nn.functional.scaled_mm's op, which NVFP4 linears call natively: float4_e2m1fn_x2 packs two elements a
    byte, so a (M, K / 2) left operand contracts K, and the op is timed at the FP4 peak."""
    packed = torch.empty(64, 128, dtype=torch.float4_e2m1fn_x2)  # (M, K / 2), K = 256
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    assert op_flops(SCALED_MM_V2, (packed,), {}, out) == 2 * 64 * 32 * 256
    assert precision_class(packed) == "fp4"
