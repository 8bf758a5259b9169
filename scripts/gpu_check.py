"""One command that proves a GPU (issue 33): run it first whenever a GPU machine is lent.

    python3 scripts/gpu_check.py                        # the proof: 4.9 minutes on one H100 (2026-11-27)
    python3 scripts/gpu_check.py --perf                 # the 1B job against torchtitan, eager and compiled
    python3 scripts/gpu_check.py --levers               # the 1B job with each of scripts/levers.py's changes off
    python3 scripts/gpu_check.py --only flex fsdp       # some checks, by key (--help lists them)
    python3 scripts/gpu_check.py --apply-section FILE   # paste a device run's gpu_check.md into docs/performance.md

It runs on one CUDA GPU what CPU CI cannot: the tests that skip without CUDA, FlexAttention's compiled kernels,
torch._grouped_mm, blockwise float8's native matmuls, the bf16-state optimizer's compiled update, FSDP and CPU
offload over one rank with a skipped NaN step, the trainer against a bare loop on the jobs of docs/performance.md,
the 1B model's MFU, and torchtitan 0.3.0 on the same 1B job (--proof, the default); --perf and --levers are issue
51's throughput rows, each a call of its own within a lent machine's minutes (SELECTIONS). It prints one line per
check with its seconds, writes one table (device, torch, date, one row per check, failures marked) between the
selection's gpu_check markers of docs/performance.md and into <log dir>/gpu_check.md, keeps every command's output
in <log dir>/gpu_check.log, and exits 1 when any check failed.

The lent machine has no network: scripts/gpu_wheels.sh downloads, here, the wheels it lacks into .whl/. A session
then runs DEVICE_COMMAND (below, and in docs/performance.md), one line, with the device tool's `run` and carry
[".whl"], and here `python3 scripts/gpu_check.py --apply-section <files_at>/gpu_check.md`. Each check gets at most its
own limit and whatever is left of --budget-s (a session's whole GPU time is 15 minutes); a check not started in
time fails as "not run". tests/test_gpu_check.py runs the pieces that need no GPU on the CPU.
"""

import argparse
import ast
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
import triton
from torch import Tensor, nn
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_roofline import median_ms  # noqa: E402
from levers import LEVERS  # noqa: E402
from titan.data.dataset import SHIPPED_CORPUS  # noqa: E402
from titan.data.hf_tokenizer import write_hf_tokenizer  # noqa: E402
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer  # noqa: E402
from titan.models.common.attention import (  # noqa: E402
    FlexAttention,
    SDPAAttention,
    build_block_mask,
    build_dense_mask,
)
from titan.models.common.moe import READ_COUNTS, HighPrecisionMatmuls, grouped_mm_supported, swiglu_expert  # noqa: E402
from titan.quant.float8.blockwise import Float8BlockwiseLinear  # noqa: E402
from titan.train.bf16_state import adam_update, compiled_adam_update, rounding_keys  # noqa: E402

DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                  "/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; "
                  "PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --log-dir $OUT")
"""The device tool's `run` command (carry [".whl"]): install the carried wheels, then every check; $OUT comes back."""
DOC = ROOT / "docs" / "performance.md"


def markers(selection: str = "proof") -> tuple[str, str]:
    """The begin and end markers of a selection's table in docs/performance.md: each selection (SELECTIONS) keeps its
    own, so that a --perf run does not replace the proof's table."""
    name = "gpu_check" if selection == "proof" else f"gpu_check {selection}"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers()
SECTION_FILE, LOG_FILE = "gpu_check.md", "gpu_check.log"

CUDA_ONLY_TESTS = [
    "tests/test_train.py::test_the_step_loop_never_synchronizes_a_cuda_device",
    "tests/test_cp.py::test_torch_path_on_cuda_matches_full",  # every rotate method
    "tests/test_float8_casts.py::test_triton_kernels_match_torch_path_cuda",
    "tests/test_mx_numerics.py::test_triton_quantize_matches_torch_path_cuda",
    "tests/test_swiglu.py::test_triton_kernels_match_float64_cuda",
    "tests/test_attention.py::test_flex_sinks_and_window_gradients_equal_the_sink_column_cuda",
    # Runs on GPUs before Blackwell (the H100 and H200), where it checks that native MX is refused.
    "tests/test_mx.py::test_mx_needs_blackwell_or_emulate",
    # CPU runs it too; on a GPU the meter times steps by CUDA events while the host runs ahead of the device.
    "tests/test_train.py::test_each_logged_step_time_matches_a_wall_clock",
]
"""The tests a CPU run skips, by node id. Every test marked skipif(not torch.cuda.is_available()) must be listed:
check_cuda_only_tests fails on one that is not (cuda_only_tests_in), and on a listed id that no longer exists."""

ANOMALY_PROBE = ROOT / "tests" / "harness" / "anomaly_probe.py"
DEBUG_JOB = ["--job.config_file", "configs/debug_model.toml"]
NAN_STEP, NAN_RUN_STEPS = 3, 6
LOSS_ATOL = 1e-4
"""Losses of the FSDP and offload runs against the one-GPU run, fp32, losses near 8: offload's CPU Adam and the GPU's
atomic adds (attention's backward) round differently, far below a step's change of the loss (about 0.05)."""

TITAN_1B_JOB = ["--model.flavor", "1B", "--training.local_batch_size", "2", "--training.seq_len", "8192",
                "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective",
                "--model.attn_backend", "flex"]
"""docs/performance.md's 1B training job (shipped tokenizer, eager, selective per-op AC, block-causal) with
FlexAttention, the kernel for block-causal masks on GPUs; scripts/torchtitan_llama3_1b.py is the same job."""
TORCHTITAN_MATCHED_FLAGS = ["--parallelism.force_fsdp", "--training.loss_chunk_size", "0"]
"""On top of TITAN_1B_JOB, the job scripts/torchtitan_llama3_1b.py gives torchtitan (its docstring says why)."""
TITAN_RECOMMENDED_1B = ["--compile.enable", "--activation_checkpoint.mode", "none"]
"""On top of TITAN_1B_JOB, the 1B job as Titan recommends running it on one 80 GB card: compiled (blocks and loss),
and without activation checkpointing, which the dry run fits in memory at this batch (docs/performance.md); kernel
options of FlexAttention are left at torch's defaults until a GPU session tunes them."""
RUN_1B_STEPS, RUN_1B_LOG_FREQ = 20, 5
"""Throughput is the median over the logged windows after step RUN_1B_LOG_FREQ (compilation, allocator warm-up)."""

OVERHEAD_JOBS = {
    "debug": ["--repeats", "5"],
    "100M": ["--repeats", "3", "--", "--model.flavor", "100M", "--training.seq_len", "2048",
             "--training.mixed_precision_param", "bfloat16"],
    "1B": ["--repeats", "3", "--steps", "5", "--", "--model.flavor", "1B", "--training.local_batch_size", "2",
           "--training.seq_len", "4096", "--training.mixed_precision_param", "bfloat16",
           "--activation_checkpoint.mode", "selective"],
}
"""`scripts/benchmark.py overhead`'s flags for docs/performance.md's trainer-overhead jobs, with fewer rounds than its
table."""

TORCHTITAN_NOT_MATCHED = [
    "torchtitan 0.3.0 follows torch's nightly builds. On torch 2.11 scripts/torchtitan_llama3_1b.py supplies "
    "torch.distributed.fsdp.DataParallelMeshDims (a stand-in that partial_dtensor never builds) and "
    "torch.distributed.set_timeout (torch's _set_pg_timeout), and drops create_block_mask's "
    "separate_full_blocks=True (what torch 2.11 always does)",
    "torchtitan runs --parallelism.spmd_backend partial_dtensor: its default, spmd_types, passes fully_shard an "
    "argument that torch 2.11 lacks",
    "torchtitan's FlexAttention is compiled without its max_autotune and coordinate-descent tuning, as Titan compiles "
    "its own (minutes of autotuning would not fit the check)",
    "both runs compute the whole batch's logits at once (Titan: --training.loss_chunk_size 0): torchtitan's chunked "
    "loss failed in backward under torch 2.11's FSDP (on the CPU; torch 2.13 ran it)",
    "the optimizer's numbers, not its work: torchtitan's AdamW decays every parameter and shortens its 200 warmup "
    "steps to the run's 20; Titan leaves norms and the embedding undecayed and warms up over 200",
    "torchtitan fuses wq/wk/wv into one matmul",
    "torchtitan reads and tokenizes batches in the training thread (num_workers 0), Titan in a prefetching thread",
    "torchtitan's documents are its tokenizer's BOS/EOS runs and Titan's end at each EOS: the same corpus and "
    "tokenizer, so block-causal masks of the same density, not the same bits",
]
"""What differs between the Titan and torchtitan runs of the 1B job, printed under the table."""


class CheckFailed(Exception):
    """A finding that fails a check: its message is the check's row in the table."""


@dataclass
class Result:
    key: str
    title: str
    ok: bool
    seconds: float
    details: str


@dataclass
class Session:
    """What the checks of one run share: a scratch folder, the log, the deadline and the values later checks read."""

    scratch: Path
    log: TextIO
    deadline: float
    measured: dict[str, float] = field(default_factory=dict)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, commands: dict[str, list[str]], limit_s: float, env: dict[str, str] | None = None) -> dict[str, str]:
        """Run the commands (name -> argv) side by side from the repo root and return each one's output, all of which
        goes into the log. A command that fails, or outlives min(limit_s, the time left), fails the check."""
        end = time.monotonic() + min(limit_s, self.deadline - time.monotonic())
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    "TITAN_CACHE_DIR": str(self.scratch / "titan_cache"), **(env or {})}
        processes = {name: subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True) for name, argv in commands.items()}
        outputs, problems = {}, []
        for name, process in processes.items():
            try:
                outputs[name] = process.communicate(timeout=max(end - time.monotonic(), 0.1))[0]
                if process.returncode != 0:
                    problems.append(f"{name}: exit {process.returncode}: {last_error_line(outputs[name])}")
            except subprocess.TimeoutExpired:
                process.kill()
                outputs[name] = process.communicate()[0]
                problems.append(f"{name}: still running at its time limit, killed")
            self.log.write(f"\n$ {' '.join(commands[name])}\n{outputs[name]}\n")
        self.log.flush()
        if problems:
            raise CheckFailed("; ".join(problems))
        return outputs


def last_error_line(output: str) -> str:
    """The line of a failed command's output that says why: its last non-empty line (a traceback's exception)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def python(*args: str | Path) -> list[str]:
    """argv of this Python running `args`: the interpreter that holds torch on the lent machine."""
    return [sys.executable, *map(str, args)]


# 1. The tests that skip without CUDA.

def cuda_only_tests_in(tests_dir: Path) -> list[str]:
    """Node ids of the test functions in tests_dir/test_*.py marked skipif(not torch.cuda.is_available()...)."""
    found = []
    for path in sorted(tests_dir.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    "skipif(not torch.cuda.is_available()" in ast.unparse(decorator).replace("\n", "")
                    for decorator in node.decorator_list):
                found.append(f"{path.relative_to(tests_dir.parent)}::{node.name}")
    return found


def collected_node_ids(node_ids: list[str]) -> list[str]:
    """Every test pytest collects from the files of `node_ids` (parametrized ones with their [id])."""
    files = sorted({node_id.split("::")[0] for node_id in node_ids})
    result = subprocess.run(python("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files),
                            cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise CheckFailed(f"pytest could not collect {' '.join(files)}: {last_error_line(result.stdout)}")
    return [line for line in result.stdout.splitlines() if "::" in line]


def missing_node_ids(node_ids: list[str], collected: list[str]) -> list[str]:
    """The ids of `node_ids` that name no collected test (a test or all its parametrizations)."""
    return [node_id for node_id in node_ids
            if not any(test == node_id or test.startswith(node_id + "[") for test in collected)]


def junit_outcomes(report: Path) -> dict[str, str]:
    """Test name -> passed, failed, error or skipped (with its message) from pytest's JUnit XML report."""
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcomes[name] = "passed" if problem is None else f"{problem.tag}: {problem.get('message', '')[:200]}"
    return outcomes


def check_cuda_only_tests(session: Session) -> str:
    """Every listed test runs on the GPU and passes: a skip counts as a failure, since the point is to run them."""
    unlisted = sorted(set(cuda_only_tests_in(ROOT / "tests")) - set(CUDA_ONLY_TESTS))
    missing = missing_node_ids(CUDA_ONLY_TESTS, collected_node_ids(CUDA_ONLY_TESTS))
    if unlisted or missing:
        raise CheckFailed(f"CUDA_ONLY_TESTS in scripts/gpu_check.py is out of date: add {unlisted}, drop or rename "
                          f"{missing}")
    report = session.scratch / "pytest.xml"
    failure = None
    try:
        session.run({"pytest": python("-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                                      *CUDA_ONLY_TESTS)}, limit_s=150)
    except CheckFailed as error:  # a failed test: its own outcome, below, says more than pytest's exit status
        failure = error
    outcomes = junit_outcomes(report) if report.exists() else {}
    not_passed = [f"{name} {outcome}" for name, outcome in outcomes.items() if outcome != "passed"]
    if failure or not_passed or not outcomes:
        raise CheckFailed("; ".join(not_passed) or str(failure or "no test ran"))
    return f"{len(outcomes)} passed: {', '.join(sorted(outcomes))}"


# 2. and 3. Kernels, each against the path it replaces, both against an fp32 golden.

def within_bf16_error(name: str, got: Tensor, reference: Tensor, golden: Tensor) -> float:
    """The ratio of got's largest error against the fp32 `golden` to what is allowed: twice the error of
    `reference` (the bf16 path `got` replaces, run on the same inputs) plus one bf16 rounding (2^-8) of golden's
    largest value. Two bf16 kernels accumulate in different orders, so neither is the other's truth; the golden
    is. Raises CheckFailed over 1."""
    got_error = (got.float() - golden).abs().max().item()
    allowed = 2 * (reference.float() - golden).abs().max().item() + golden.abs().max().item() * 2**-8
    if got_error > allowed:
        raise CheckFailed(f"{name}: largest error against fp32 {got_error:.2e}, allowed {allowed:.2e} (twice the "
                          f"replaced path's bf16 error plus one bf16 rounding)")
    return got_error / allowed


def outputs_and_grads(function: Callable[..., Tensor], inputs: list[Tensor], grad_output: Tensor,
                      dtype: torch.dtype) -> list[Tensor]:
    """function's output on `inputs` cast to dtype (as leaves), and the inputs' gradients for grad_output."""
    leaves = [tensor.detach().to(dtype).requires_grad_() for tensor in inputs]
    output = function(*leaves)
    output.backward(grad_output.to(dtype))
    return [output.detach(), *(leaf.grad for leaf in leaves)]


def document_ids_of(lengths: list[list[int]], device: torch.device) -> Tensor:
    """(bs, seq) document ids of rows made of documents of the given lengths."""
    rows = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    return torch.stack(rows).to(device)


def flex_against_sdpa(device: torch.device) -> str:
    """FlexAttention (the model's kernel module: compiled flex_attention on CUDA) under build_block_mask against
    SDPA under build_dense_mask, forward and backward, bf16, grouped kv heads: 8 blocks of 128 tokens, documents
    crossing block boundaries, so that whole blocks are skipped and partial ones masked."""
    torch.manual_seed(0)
    lengths = [[100, 300, 250, 374], [700, 200, 124]]
    document_ids = document_ids_of(lengths, device)
    bs, seq, heads, kv_heads, head_dim = len(lengths), document_ids.size(1), 8, 2, 64
    block_mask, dense_mask = build_block_mask(document_ids, seq, device), build_dense_mask(document_ids)
    causal_sparsity = build_block_mask(None, seq, device).sparsity()
    if not block_mask.sparsity() > causal_sparsity:
        raise CheckFailed(f"the block mask skips {block_mask.sparsity():.1f}% of blocks, no more than causal's "
                          f"{causal_sparsity:.1f}%: documents are not skipped")
    inputs = [torch.randn(bs, n, seq, head_dim, device=device) for n in (heads, kv_heads, kv_heads)]
    grad_output = torch.randn(bs, heads, seq, head_dim, device=device)
    flex = outputs_and_grads(lambda q, k, v: FlexAttention()(q, k, v, block_mask), inputs, grad_output, torch.bfloat16)
    sdpa = outputs_and_grads(lambda q, k, v: SDPAAttention()(q, k, v, dense_mask), inputs, grad_output, torch.bfloat16)
    with sdpa_kernel(SDPBackend.MATH):  # the golden in plain fp32 matmuls, not a fused kernel's
        golden = outputs_and_grads(lambda q, k, v: SDPAAttention()(q, k, v, dense_mask), inputs, grad_output,
                                   torch.float32)
    ratios = [within_bf16_error(name, *tensors) for name, *tensors in zip(("output", "dq", "dk", "dv"), flex, sdpa,
                                                                             golden)]
    return (f"output, dq, dk, dv within {max(ratios):.2f} of the bf16 tolerance; {block_mask.sparsity():.0f}% of "
            f"blocks skipped (causal: {causal_sparsity:.0f}%)")


def expert_loop(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """The experts one matmul each, as moe.py runs them where torch._grouped_mm does not."""
    return torch.cat([F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                      for e, rows in enumerate(x.split(counts.tolist()))])


def grouped_mm_against_loop(device: torch.device) -> str:
    """Titan's grouped SwiGLU experts (torch._grouped_mm) against one matmul per expert, forward and backward, bf16,
    with the uneven blocks a router makes: an expert with no tokens, sizes that are no multiple of 16."""
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 17, 1024, 5, 211, 77, 414], device=device)
    num_experts, dim, hidden = counts.numel(), 256, 512
    x = torch.randn(int(counts.sum()), dim, device=device)
    if not grouped_mm_supported(x.bfloat16()):
        raise CheckFailed(f"torch._grouped_mm does not run here for bf16 (grouped_mm_supported), so the MoE experts "
                          f"would take the loop: {torch.cuda.get_device_name(device)} needs SM90 or newer")
    weights = [torch.randn(num_experts, *shape, device=device) * shape[1] ** -0.5
               for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    grad_output = torch.randn_like(x)
    def grouped_swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        return HighPrecisionMatmuls()(x, counts, {"w1": w1, "w2": w2, "w3": w3}, swiglu_expert, READ_COUNTS)
    grouped = outputs_and_grads(grouped_swiglu, [x, *weights], grad_output, torch.bfloat16)
    loop, golden = (outputs_and_grads(lambda *tensors: expert_loop(tensors[0], counts, *tensors[1:]), [x, *weights],
                                      grad_output, dtype) for dtype in (torch.bfloat16, torch.float32))
    names = ("output", "dx", "dw1", "dw2", "dw3")
    ratios = [within_bf16_error(name, *tensors) for name, *tensors in zip(names, grouped, loop, golden)]
    return f"output and grads within {max(ratios):.2f} of the bf16 tolerance; {num_experts} experts, one empty"


def linear_outputs_and_grads(linear: nn.Module, x: Tensor, grad_output: Tensor) -> list[Tensor]:
    """A linear's output on x, and the gradients of x and of its weight for grad_output (the weight's gradient is
    cleared again, for the next call on a shared weight)."""
    leaf = x.detach().requires_grad_()
    output = linear(leaf)
    output.backward(grad_output)
    grad_weight, linear.weight.grad = linear.weight.grad, None
    return [output.detach(), leaf.grad, grad_weight]


def blockwise_native_against_emulated(device: torch.device) -> str:
    """Blockwise float8's native matmuls (F.scaled_mm with 1 x 128 and 128 x 128 scales: cuBLASLt on Hopper) against
    the same float8 values multiplied in fp32 (--float8.emulate), on an 8B FFN-shaped linear (4096 -> 14336, 4096
    bf16 tokens): the relative error of output, grad_input and grad_weight (the native kernels accumulate per
    128-wide block and write bf16: about 2^-9), and the time of a forward and backward against the bf16 linear."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        raise CheckFailed(f"blockwise float8 runs natively on Hopper (9.x) only; {torch.cuda.get_device_name(device)} "
                          f"is not one (Titan refuses it there: tests/test_float8_blockwise.py)")
    torch.manual_seed(0)
    linears = [Float8BlockwiseLinear(4096, 14336, bias=False, emulate=emulate, device=device, dtype=torch.bfloat16)
               for emulate in (False, True)]
    nn.init.normal_(linears[0].weight, std=4096**-0.5)
    linears[1].weight = linears[0].weight
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    grad_output = torch.randn(4096, 14336, device=device, dtype=torch.bfloat16)
    native, emulated = (linear_outputs_and_grads(linear, x, grad_output) for linear in linears)
    errors = {name: ((got.float() - want.float()).norm() / want.float().norm()).item()
              for name, got, want in zip(("output", "grad_input", "grad_weight"), native, emulated)}
    if max(errors.values()) > 1e-2:
        raise CheckFailed(f"native blockwise float8 apart from its emulation: relative errors {errors}")
    plain = nn.Linear(4096, 14336, bias=False, device=device, dtype=torch.bfloat16)

    def forward_backward(linear: nn.Module) -> Callable[[], None]:
        leaf = x.detach().requires_grad_()
        return lambda: linear(leaf).backward(grad_output)
    native_ms, bf16_ms = median_ms(forward_backward(linears[0])), median_ms(forward_backward(plain))
    listed = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    return (f"relative error against the emulation: {listed}; forward and backward {native_ms:.2f} ms against bf16 "
            f"{bf16_ms:.2f} ms ({bf16_ms / native_ms:.2f}x; eager: the tile casts are unfused torch ops)")


def bf16_moments_apart(got: Tensor, want: Tensor) -> tuple[int, int]:
    """(elements that differ, their largest distance in bf16 steps) between two bf16 tensors: neighbouring bf16
    values of one sign are neighbouring int16 bit patterns; a sign flip counts as very far."""
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return int((steps > 0).sum()), int(steps.max())


def adam_inputs(numel: int, device: torch.device, nan_grads: bool) -> list[Tensor]:
    """weights, grad, exp_avg, exp_avg_sq (bf16), step of one flat shard after 5 steps, the same each call."""
    generator = torch.Generator().manual_seed(0)
    weights, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-2
    if nan_grads:
        grad[::7] = float("nan")  # a skipped step's gradients are often non-finite
    exp_avg = (torch.randn(numel, generator=generator) * 1e-3).bfloat16()
    exp_avg_sq = (torch.rand(numel, generator=generator) * 1e-4).bfloat16()
    return [tensor.to(device) for tensor in (weights, grad, exp_avg, exp_avg_sq, torch.tensor(5.0))]


def adam_step(update: Callable[..., None], numel: int, device: torch.device, apply: bool,
              nan_grads: bool) -> list[Tensor]:
    """weights, exp_avg, exp_avg_sq and step after one `update` of adam_inputs, AdamW with Titan's defaults."""
    weights, grad, exp_avg, exp_avg_sq, step = adam_inputs(numel, device, nan_grads)
    update(weights, grad, exp_avg, exp_avg_sq, step, torch.tensor(apply, device=device), rounding_keys(step + 1, 3),
           lr=torch.full((), 8e-4, device=device), weight_decay=torch.full((), 0.1, device=device), beta1=0.9,
           beta2=0.95, eps=1e-8, decoupled=True)
    return [weights, exp_avg, exp_avg_sq, step]


def bf16_adam_compiled_against_eager(device: torch.device, numel: int = 4_000_037) -> str:
    """titan/train/bf16_state.py's compiled update (one fused kernel) against the same function eager. Weights
    within 1e-6 (inductor fuses and reorders fp32 arithmetic: a few ulps at the weights' scale of 1, 1/800 of an
    update); moments equal or one bf16 step apart in at most 0.1% of elements (a one-ulp fp32 difference can flip a
    stochastic rounding); step counts equal. A skipped step (NaN gradients, apply False) leaves every tensor bit for
    bit as it was, compiled and eager."""
    eager = adam_step(adam_update, numel, device, apply=True, nan_grads=False)
    compiled = adam_step(compiled_adam_update(), numel, device, apply=True, nan_grads=False)
    weight_error = (compiled[0] - eager[0]).abs().max().item()
    moments = [bf16_moments_apart(got, want) for got, want in zip(compiled[1:3], eager[1:3])]
    problems = [f"weights differ by {weight_error:.1e}"] if weight_error > 1e-6 else []
    problems += [f"{name}: {count} elements differ, by up to {steps} bf16 steps" for name, (count, steps)
                 in zip(("exp_avg", "exp_avg_sq"), moments) if steps > 1 or count > numel // 1000]
    problems += ["step counts differ"] if not torch.equal(compiled[3], eager[3]) else []
    before = adam_inputs(numel, device, nan_grads=True)
    for name, update in (("eager", adam_update), ("compiled", compiled_adam_update())):
        skipped = adam_step(update, numel, device, apply=False, nan_grads=True)
        if not all(torch.equal(got, want) for got, want in zip(skipped, [before[0], *before[2:]])):
            problems.append(f"a skipped step with NaN gradients changed the state ({name})")
    if problems:
        raise CheckFailed("; ".join(problems))
    return (f"weights within {weight_error:.1e}, moments differ in {moments[0][0]} and {moments[1][0]} of {numel:,} "
            f"elements by one bf16 step; a NaN step is skipped bit for bit, compiled and eager")


# 4. FSDP and CPU offload over one rank, with a skipped NaN step.

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_records(folder: Path) -> list[dict]:
    """The training steps' records of <folder>/metrics.jsonl (not its evaluations or the job's goodput)."""
    return [record for record in read_jsonl(folder / "metrics.jsonl") if "loss" in record]


def nan_skip_problems(metrics: list[dict], anomalies: list[dict], nan_step: int, steps: int) -> list[str]:
    """What is wrong with a run whose loss was NaN at nan_step under --training.on_nonfinite skip: the skip's record,
    the LR schedule waiting a step, every step logged and the other losses finite."""
    problems = []
    if [(a["step"], a["action"]) for a in anomalies] != [(nan_step, "skip")]:
        problems.append(f"anomalies.jsonl holds {anomalies}, not one skip at step {nan_step}")
    by_step = {record["step"]: record for record in metrics}
    if sorted(by_step) != list(range(1, steps + 1)):
        return [*problems, f"metrics.jsonl has steps {sorted(by_step)}, not 1 to {steps}"]
    if by_step[nan_step + 1]["lr"] != by_step[nan_step]["lr"]:
        problems.append(f"the LR moved on after the skipped step {nan_step}: the update was not skipped")
    if any(not isinstance(r["loss"], float) or r["loss"] != r["loss"] for s, r in by_step.items() if s != nan_step):
        problems.append("a loss other than the injected NaN is not finite")
    return problems


def largest_loss_difference(metrics: list[dict], reference: list[dict], nan_step: int) -> float:
    return max(abs(got["loss"] - want["loss"]) for got, want in zip(metrics, reference) if got["step"] != nan_step)


def check_fsdp_offload_nan_skip(session: Session) -> str:
    """The debug model, fp32, on one GPU, with FSDP over a one-rank mesh and with CPU offload: NaN at step 3
    (tests/harness/anomaly_probe.py), skipped; the FSDP and offload runs match the plain run's losses within
    LOSS_ATOL."""
    variants = {"one GPU": [], "FSDP": ["--parallelism.force_fsdp"], "offload": ["--training.enable_cpu_offload"]}
    flags = [*DEBUG_JOB, "--training.steps", str(NAN_RUN_STEPS), "--metrics.log_freq", "1",
             "--training.mixed_precision_param", "float32", "--training.on_nonfinite", "skip"]
    folders = {name: session.scratch / f"nan_{name.replace(' ', '_')}" for name in variants}
    session.run({name: python(ANOMALY_PROBE, *flags, *extra, "--job.dump_folder", folders[name])
                 for name, extra in variants.items()}, limit_s=150, env={"NAN_STEPS": str(NAN_STEP)})
    runs = {name: (step_records(folder), read_jsonl(folder / "anomalies.jsonl"))
            for name, folder in folders.items()}
    problems = [f"{name}: {problem}" for name, (metrics, anomalies) in runs.items()
                for problem in nan_skip_problems(metrics, anomalies, NAN_STEP, NAN_RUN_STEPS)]
    if problems:
        raise CheckFailed("; ".join(problems))
    differences = {name: largest_loss_difference(runs[name][0], runs["one GPU"][0], NAN_STEP)
                   for name in ("FSDP", "offload")}
    summary = ", ".join(f"{name} {difference:.1e}" for name, difference in differences.items())
    if max(differences.values()) > LOSS_ATOL:
        raise CheckFailed(f"losses differ from the one-GPU run by {summary}, over {LOSS_ATOL:.0e}")
    return f"step {NAN_STEP} skipped in all three; largest loss difference from one GPU: {summary}"


# 5. and 6. Throughput.

def benchmark_summary(output: str) -> str:
    """scripts/benchmark.py's tokens/s and ratio lines, in one line."""
    wanted = ("titan  tokens/s", "bare   tokens/s", "titan/bare ratio")
    lines = [" ".join(line.split()) for line in output.splitlines() if line.startswith(wanted)]
    if len(lines) != len(wanted):
        raise CheckFailed(f"scripts/benchmark.py printed no {' / '.join(wanted)} lines: its output changed")
    return "; ".join(lines).replace(" (tokens/s, median over rounds, and range)", "")


def check_overhead(session: Session, job: str) -> str:
    """Titan's train step against the bare loop, alternating rounds (docs/performance.md, trainer overhead)."""
    flags = ["overhead", *OVERHEAD_JOBS[job]]
    output = session.run({job: python(ROOT / "scripts" / "benchmark.py", *flags)}, limit_s=120)[job]
    return f"{benchmark_summary(output)} (`benchmark.py {' '.join(flags)}`)"


def median_after_warmup(records: list[dict], key: str, warmup_steps: int) -> float:
    """The median of `key` over the logged windows after step warmup_steps."""
    values = [record[key] for record in records if record["step"] > warmup_steps and key in record]
    if not values:
        raise CheckFailed(f"no logged {key} after step {warmup_steps}")
    return statistics.median(values)


def check_titan_1b(session: Session, extra: list[str], name: str, levers_off: tuple[str, ...] = (),
                   limit_s: float = 150) -> str:
    """train.py on TITAN_1B_JOB (+ extra), with `levers_off` (scripts/levers.py) switched off through
    scripts/train_levers_off.py: tokens/s, TFLOP/s and MFU from its metrics.jsonl."""
    folder = session.scratch / name
    entry = [ROOT / "scripts" / "train_levers_off.py", "--off", ",".join(levers_off), "--"] if levers_off else [
        ROOT / "train.py"]
    session.run({name: python(*entry, *TITAN_1B_JOB, *extra, "--training.steps", str(RUN_1B_STEPS),
                              "--metrics.log_freq", str(RUN_1B_LOG_FREQ), "--job.dump_folder", folder)},
                limit_s=limit_s)
    records = step_records(folder)
    tps = median_after_warmup(records, "tps", RUN_1B_LOG_FREQ)
    session.measured[name] = tps
    mfu = median_after_warmup(records, "mfu_pct", RUN_1B_LOG_FREQ)
    tflops = median_after_warmup(records, "tflops", RUN_1B_LOG_FREQ)
    details = (f"{tps:,.0f} tokens/s, {tflops:.0f} TFLOP/s, MFU {mfu:.1f}%, peak "
               f"{max(r['mem_gib'] for r in records):.1f} GiB (steps {RUN_1B_LOG_FREQ + 1}-{RUN_1B_STEPS}; "
               f"`train.py {' '.join(TITAN_1B_JOB + extra)}`" + (f" with {', '.join(levers_off)} off)" if levers_off
                                                                 else ")"))
    on = session.measured.get("titan_1B_fsdp")
    if levers_off and on is not None:
        details += f"; all levers on {on:,.0f}: on/off {on / tps:.3f}"
    return details


def torchtitan_assets(scratch: Path) -> tuple[Path, Path]:
    """Folders holding what torchtitan reads offline: the shipped tokenizer as tokenizer.json (its
    --hf_assets_path) and the shipped corpus as .jsonl (its --dataloader.dataset_path)."""
    tokenizer_folder, data_folder = scratch / "torchtitan_tokenizer", scratch / "torchtitan_data"
    write_hf_tokenizer(build_tokenizer(str(ROOT / SHIPPED_TOKENIZER)), tokenizer_folder)
    data_folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(SHIPPED_CORPUS, "rb") as source, open(data_folder / "shipped.jsonl", "wb") as target:
        shutil.copyfileobj(source, target)
    return tokenizer_folder, data_folder


def torchtitan_records(output: str) -> list[dict]:
    """step, tps and mfu of torchtitan's metric lines ("step: 10  loss: ...  tps: 41,234  tflops: ...  mfu: 37.1%")."""
    records = []
    for line in output.splitlines():
        words = line.replace(":", " ").replace("%", " ").replace(",", "").split()
        if "step" in words and "tps" in words and "mfu" in words:
            value = {key: words[words.index(key) + 1] for key in ("step", "tps", "mfu")}
            records.append({"step": int(value["step"]), "tps": float(value["tps"]), "mfu": float(value["mfu"])})
    return records


def torchtitan_flags(tokenizer_folder: Path, data_folder: Path, dump_folder: Path) -> list[str]:
    """scripts/torchtitan_llama3_1b.py's flags for the run that check_torchtitan_1b times."""
    return ["--hf_assets_path", str(tokenizer_folder), "--dataloader.dataset_path", str(data_folder),
            "--dump_folder", str(dump_folder), "--training.steps", str(RUN_1B_STEPS),
            "--metrics.log_freq", str(RUN_1B_LOG_FREQ), "--parallelism.spmd_backend", "partial_dtensor"]


def check_torchtitan_1b(session: Session, extra: list[str], titan_row: str, limit_s: float = 180) -> str:
    """torchtitan 0.3.0 on the 1B job (scripts/torchtitan_llama3_1b.py, + extra), against Titan's run of it in the
    row `titan_row` (FSDP over one rank, as torchtitan always wraps one GPU): tokens/s and the ratio, Titan's over
    torchtitan's."""
    tokenizer_folder, data_folder = torchtitan_assets(session.scratch)
    # Offline, and one rank's share of what torchrun would set: torchtitan's trainer starts a process group from it.
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(session.scratch / "hf"), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(get_free_port())}
    command = python(ROOT / "scripts" / "torchtitan_llama3_1b.py",
                     *torchtitan_flags(tokenizer_folder, data_folder, session.scratch / "torchtitan"), *extra)
    output = session.run({"torchtitan": command}, limit_s=limit_s, env=env)["torchtitan"]
    records = torchtitan_records(output)
    tps = median_after_warmup(records, "tps", RUN_1B_LOG_FREQ)
    details = f"torchtitan {tps:,.0f} tokens/s, MFU {median_after_warmup(records, 'mfu', RUN_1B_LOG_FREQ):.1f}%"
    if extra:
        details += f" (`{' '.join(extra)}`)"
    titan = session.measured.get(titan_row)
    if titan is None:
        raise CheckFailed(f"{details}; no ratio: Titan's run of the job ({titan_row}) did not run or failed")
    return f"{details}; Titan {titan:,.0f}: titan/torchtitan {titan / tps:.3f} (not matched: see below)"


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    run: Callable[[Session], str]


CHECKS = [
    Check("tests", "CUDA-only tests (pytest)", check_cuda_only_tests),
    Check("flex", "FlexAttention compiled, block-causal, vs SDPA dense mask",
          lambda session: flex_against_sdpa(torch.device("cuda"))),
    Check("grouped_mm", "torch._grouped_mm experts vs per-expert loop",
          lambda session: grouped_mm_against_loop(torch.device("cuda"))),
    Check("blockwise", "blockwise float8 linear, native (Hopper) vs emulated, and its time against bf16",
          lambda session: blockwise_native_against_emulated(torch.device("cuda"))),
    Check("bf16_adam", "bf16-state AdamW, compiled vs eager, and a NaN skip",
          lambda session: bf16_adam_compiled_against_eager(torch.device("cuda"))),
    Check("fsdp", "FSDP and CPU offload over one rank, NaN step skipped", check_fsdp_offload_nan_skip),
    *(Check(f"overhead_{job}", f"titan/bare, {job} job", partial(check_overhead, job=job)) for job in OVERHEAD_JOBS),
    Check("titan_1B", "Titan 1B: tokens/s and MFU", partial(check_titan_1b, extra=[], name="titan_1B")),
    Check("titan_1B_fsdp", "Titan 1B as torchtitan runs it: FSDP over one rank, whole-batch loss",
          partial(check_titan_1b, extra=TORCHTITAN_MATCHED_FLAGS, name="titan_1B_fsdp")),
    Check("torchtitan_1B", "torchtitan 0.3.0, the same 1B job",
          partial(check_torchtitan_1b, extra=[], titan_row="titan_1B_fsdp")),
    Check("titan_1B_fsdp_compiled", "Titan 1B as torchtitan runs it, compiled",
          partial(check_titan_1b, extra=[*TORCHTITAN_MATCHED_FLAGS, "--compile.enable"],
                  name="titan_1B_fsdp_compiled", limit_s=180)),
    Check("torchtitan_1B_compiled", "torchtitan 0.3.0, the same 1B job, compiled (CUDA graphs off)",
          partial(check_torchtitan_1b, extra=["--compile.enable"], titan_row="titan_1B_fsdp_compiled",
                  limit_s=240)),
    Check("titan_1B_recommended", "Titan 1B as Titan recommends it on one card: compiled, no AC",
          partial(check_titan_1b, extra=TITAN_RECOMMENDED_1B, name="titan_1B_recommended", limit_s=180)),
    Check("torchtitan_1B_cuda_graphs", "torchtitan 0.3.0, the 1B job compiled with its CUDA graphs (its default)",
          partial(check_torchtitan_1b, extra=["--compile.enable", "--training.no-disable-cuda-graphs"],
                  titan_row="titan_1B_fsdp_compiled", limit_s=240)),
    *(Check(f"lever_{name}", f"Titan 1B as torchtitan runs it, {name} off ({lever.what})",
            partial(check_titan_1b, extra=TORCHTITAN_MATCHED_FLAGS, name=f"lever_{name}", levers_off=(name,)))
      for name, lever in LEVERS.items()),
]

SELECTIONS = {
    "proof": ["tests", "flex", "grouped_mm", "blockwise", "bf16_adam", "fsdp",
              *(f"overhead_{job}" for job in OVERHEAD_JOBS), "titan_1B", "titan_1B_fsdp", "torchtitan_1B"],
    "perf": ["titan_1B_fsdp", "torchtitan_1B", "titan_1B_fsdp_compiled", "torchtitan_1B_compiled",
             "titan_1B_recommended"],
    "levers": ["titan_1B_fsdp", *(f"lever_{name}" for name in LEVERS), "torchtitan_1B_cuda_graphs"],
}
"""Which checks one call runs (--proof, the default; --perf; --levers), each within a lent machine's 8 minutes
after start-up: the proof of the GPU, then issue 51's throughput rows in its order of priority, then each lever
off (against the matched job with all on, which the selection runs first) and torchtitan's CUDA graphs."""


def run_check(session: Session, check: Check) -> Result:
    """One check, timed; any exception fails it, with its message."""
    start = time.monotonic()
    if start >= session.deadline:
        ok, details = False, "not run: the time budget (--budget-s) was spent"
    else:
        try:
            ok, details = True, check.run(session)
        except CheckFailed as finding:
            ok, details = False, str(finding)
        except Exception as error:  # a check that crashes is a finding too: into the table, and on to the next
            ok, details = False, f"{type(error).__name__}: {error}"
    result = Result(check.key, check.title, ok, time.monotonic() - start, details)
    session.say(f"{'ok  ' if ok else 'FAIL'} {check.key:<16} {result.seconds:6.1f} s  {details}")
    return result


# The table.

def environment_line(total_seconds: float, results: list[Result]) -> str:
    """Device, torch, triton, CUDA and the date: what a reader needs to compare a later run with this one."""
    device = torch.cuda.get_device_name()
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    passed = sum(result.ok for result in results)
    return (f"{date.today().isoformat()}, {device} (compute capability {capability}), torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}: {passed} of {len(results)} checks passed in "
            f"{total_seconds / 60:.1f} minutes.")


def render_section(environment: str, results: list[Result], selection: str = "proof") -> str:
    """The marked section of docs/performance.md for `selection`: the environment, one row per check, and, with a
    torchtitan row, what its job could not match."""
    begin, end = markers(selection)
    rows = [f"| {r.title} | {'ok' if r.ok else '**FAILED**'} | {r.seconds:.0f} | {r.details.replace('|', '/')} |"
            for r in results]
    lines = [begin, environment, "", "| check | result | s | what it found |", "| --- | --- | --- | --- |", *rows]
    if any(result.key.startswith("torchtitan_1B") for result in results):
        lines += ["", "Not matched between the Titan and torchtitan runs of the 1B job:",
                  *(f"- {difference}." for difference in TORCHTITAN_NOT_MATCHED)]
    return "\n".join([*lines, end])


def section_of(text: str, where: str, selection: str = "proof") -> tuple[int, int]:
    """Start of the begin marker and end of the end marker of the selection's one marked section in text."""
    begin_marker, end_marker = markers(selection)
    begin, end = text.find(begin_marker), text.find(end_marker)
    if text.count(begin_marker) != 1 or text.count(end_marker) != 1 or end < begin:
        raise ValueError(f"{where} must hold one {begin_marker} ... {end_marker} section, in that order: restore it "
                         f"from git (docs/performance.md, section 'One command that proves a GPU').")
    return begin, end + len(end_marker)


def replace_section(text: str, section: str, where: str, selection: str = "proof") -> str:
    """text with the selection's marked section replaced by `section` (which holds the markers)."""
    begin, end = section_of(text, where, selection)
    return text[:begin] + section + text[end:]


def selection_of_section(text: str, where: str) -> str:
    """Which selection's table `text` (a device run's gpu_check.md) holds, by its markers."""
    found = [selection for selection in SELECTIONS if markers(selection)[0] in text]
    if len(found) != 1:
        raise ValueError(f"{where} holds no gpu_check table, or several: {found}. Pass the gpu_check.md a run wrote.")
    return found[0]


def apply_section(path: Path) -> None:
    """Paste the marked section of `path` (a device run's gpu_check.md) into docs/performance.md."""
    text = path.read_text()
    selection = selection_of_section(text, str(path))
    begin, end = section_of(text, str(path), selection)
    DOC.write_text(replace_section(DOC.read_text(), text[begin:end], str(DOC), selection))


def run_checks(checks: list[Check], log_dir: Path, budget_s: float, selection: str = "proof") -> bool:
    """Run the checks in order, write the table into the selection's section of docs/performance.md and into
    log_dir; True when all passed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_dir / LOG_FILE, "w") as log, tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        session = Session(Path(scratch), log, deadline=start + budget_s)
        results = [run_check(session, check) for check in checks]
        section = render_section(environment_line(time.monotonic() - start, results), results, selection)
        session.say(section)
    (log_dir / SECTION_FILE).write_text(section + "\n")
    DOC.write_text(replace_section(DOC.read_text(), section, str(DOC), selection))
    return all(result.ok for result in results)


def main() -> None:
    keys = [check.key for check in CHECKS]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=keys, metavar="KEY", help=f"run only these: {' '.join(keys)}")
    selection = parser.add_mutually_exclusive_group()
    selection.add_argument("--proof", dest="selection", action="store_const", const="proof",
                           help="the GPU's proof: tests, kernels, FSDP, overhead, the 1B job against torchtitan "
                                "(the default)")
    selection.add_argument("--perf", dest="selection", action="store_const", const="perf",
                           help="the 1B job against torchtitan eager and compiled, and as Titan recommends it")
    selection.add_argument("--levers", dest="selection", action="store_const", const="levers",
                           help="the 1B job with each of scripts/levers.py's changes off, and torchtitan with CUDA "
                                "graphs")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "outputs" / "gpu_check",
                        help=f"where {LOG_FILE} (every command's output) and {SECTION_FILE} (the table) go")
    parser.add_argument("--budget-s", type=float, default=450,
                        help="seconds for all checks, which leaves the 8 minutes' rest for start-up and the table: a "
                             "command is stopped there, and a check not started by then fails as not run")
    parser.add_argument("--apply-section", type=Path, metavar="FILE",
                        help="paste FILE's gpu_check section (a device run's gpu_check.md) into docs/performance.md")
    args = parser.parse_args()
    if args.apply_section:
        apply_section(args.apply_section)
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU: run it on a lent GPU machine, as its docstring says.")
    selection = args.selection or "proof"  # --only's checks fill the proof's table, as before selections
    wanted = args.only or SELECTIONS[selection]
    checks = [check for check in CHECKS if check.key in wanted]
    sys.exit(0 if run_checks(checks, args.log_dir, args.budget_s, selection) else 1)


if __name__ == "__main__":
    main()
