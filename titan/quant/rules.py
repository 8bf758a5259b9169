"""The low-precision converters' config rules (titan/config/rule.py says what a rule is): which converters exist and
combine, what their filters name, and the GPUs whose kernels each recipe needs, so that an unsupported run is an
error before step 1 that points at the emulated mode, never a kernel's assertion."""

import math

import torch
from torch import nn

from titan.config.job import MX, NVFP4, Float8, Model, Parallelism, Training
from titan.config.rule import flavor_args, has_experts, needs_in_range, unmatched_patterns
from titan.hardware import Accelerator, cpu_scaled_mm_takes_rowwise_scales
from titan.models.common.moe import GroupedExperts
from titan.models.families import module_fqns

AVAILABLE_CONVERTERS: tuple[str, ...] = ("float8", "mx", "nvfp4")
"""Model converters this build provides."""
# The GPUs whose kernels torch 2.11, 2.12 and 2.13 ship for each low-precision matmul (the same in all three, read
# from their CUDA builds: the device checks and the architectures each kernel is compiled for; torch's own test suite
# gates these tests alike, torch/testing/_internal/common_cuda.py).
FLOAT8_MIN_CAPABILITY = (8, 9)
"""torch._scaled_mm in float8 (the linears, tensorwise and rowwise): 8.9 and newer (Ada, Hopper, Blackwell)."""
MX_MIN_CAPABILITY = (10, 0)
"""torch._scaled_mm with block scales (MX and NVFP4 linears, cuBLAS's block-scaled GEMMs): Blackwell, 10.0 and newer."""
BLOCKWISE_MAJORS = (9,)
"""torch.nn.functional.scaled_mm with 1 x 128 and 128 x 128 float8 scales (blockwise float8's linears): Hopper alone
(its CUDA code checks major == 9, and cuBLASLt 12.9 or newer)."""
FLOAT8_GROUPED_MAJORS = (9,)
"""torch._scaled_grouped_mm in float8 (the experts): its rowwise kernel is built for Hopper alone. The op's own check
also lets 10.x through, which then has no kernel for it (PLATFORM_SUPPORTS_FP8_GROUPED_GEMM: SM90 and not SM100)."""
MX_GROUPED_MAJORS = (10,)
"""torch._scaled_grouped_mm with MXFP8 block scales (the experts): its kernel is built for 10.0 and 10.3 (B200,
GB200, B300) alone; Blackwell's other parts (12.x) fail the op's check and Hopper passes it with no kernel."""


def check_converters(model: Model) -> str | None:
    unknown = [c for c in model.converters if c not in AVAILABLE_CONVERTERS]
    if not unknown:
        return None
    return (f"--model.converters has unknown converter(s) {', '.join(map(repr, unknown))}. Available: "
            f"{', '.join(AVAILABLE_CONVERTERS)}.")


def check_converter_filters(model: Model, float8: Float8, mx: MX, nvfp4: NVFP4) -> list[str]:
    """A filter entry that matches no layer keeps nothing out, so the layer it was meant to protect (after a typo
    or a rename) would silently train in low precision; an experts entry that matches no experts converts nothing."""
    sections = {"float8": float8, "mx": mx, "nvfp4": nvfp4}
    used = [name for name in sections if name in model.converters]
    if not used or flavor_args(model) is None:
        return []
    # Module names don't depend on the vocab or sequence length.
    linears = module_fqns(model.name, model.flavor, nn.Linear)
    experts = module_fqns(model.name, model.flavor, GroupedExperts)
    problems = [problem for name in used
                for problem in unmatched_patterns(f"--{name}.filter_fqns",
                                                  [(entry, entry) for entry in sections[name].filter_fqns], linears,
                                                  "linear layer", model.flavor, "keep nothing in high precision")]
    if experts:  # a dense flavor has no experts to name (and the default entry, "experts", names none of its layers)
        problems += [problem for name in used if name != "nvfp4"  # NVFP4 keeps the experts in high precision
                     for problem in unmatched_patterns(f"--{name}.moe_fqns_prototype",
                                                       [(entry, entry) for entry in sections[name].moe_fqns_prototype],
                                                       experts, "experts module", model.flavor,
                                                       "leave every expert in high precision")]
    return problems


def check_nvfp4(model: Model) -> str | None:
    """NVFP4 takes every eligible linear: no filter splits layers between it and float8 or mx."""
    others = [name for name in ("float8", "mx") if name in model.converters]
    if "nvfp4" not in model.converters or not others:
        return None
    return (f"--model.converters nvfp4 does not combine with {' and '.join(others)} in one run. Use nvfp4 alone for "
            f"the dense linears, or {' or '.join(others)} for the linears and the experts.")


def check_float8_all_gather(float8: Float8, parallelism: Parallelism, training: Training) -> list[str]:
    problems = []
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        problems.append(f"--float8.enable_fsdp_float8_all_gather only works with --float8.recipe_name tensorwise "
                        f"(got {float8.recipe_name!r}). Switch to tensorwise or turn off the all-gather.")
    if float8.enable_fsdp_float8_all_gather and parallelism.tensor_parallel_degree > 1:
        problems.append(f"--float8.enable_fsdp_float8_all_gather does not combine with --parallelism."
                        f"tensor_parallel_degree {parallelism.tensor_parallel_degree} yet (TP re-wraps the "
                        f"weights before FSDP sees them). Turn one of them off.")
    if float8.enable_fsdp_float8_all_gather and training.enable_cpu_offload:
        # On CUDA, FSDP pins each offloaded shard: a copy, which drops the all-gather's weight wrapper
        # (torch 2.13's FSDPParam.reset_sharded_param), so the all-gather would silently run in high precision.
        problems.append("--float8.enable_fsdp_float8_all_gather does not combine with --training.enable_cpu_offload "
                        "(FSDP's copy of the offloaded shards into pinned memory drops the float8 all-gather). Turn "
                        "one of them off.")
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        problems.append("--float8.precompute_float8_dynamic_scale_for_fsdp needs "
                        "--float8.enable_fsdp_float8_all_gather (it precomputes the all-gather's scales). Add it or "
                        "drop the precompute flag.")
    return problems


def check_float8_hardware(model: Model, float8: Float8, accelerator: Accelerator) -> str | None:
    if "float8" not in model.converters or float8.emulate:
        return None
    if float8.recipe_name == "blockwise":
        return blockwise_problem(accelerator)
    if not accelerator.is_cuda:
        if float8.recipe_name == "tensorwise" or cpu_scaled_mm_takes_rowwise_scales():
            return None
        return (f"--float8.recipe_name {float8.recipe_name} multiplies with rowwise scales, which this torch's "
                f"({torch.__version__}) CPU torch._scaled_mm lacks (torch 2.13's has them); "
                f"{accelerator.describe()}. Add --float8.emulate to run the same quantization with high-precision "
                f"matmuls, or use --float8.recipe_name tensorwise.")
    if accelerator.capability >= FLOAT8_MIN_CAPABILITY:
        return None
    return (f"--model.converters float8 needs a GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{accelerator.describe()}. Add --float8.emulate to run the same quantization with high-precision "
            f"matmuls.")


def blockwise_problem(accelerator: Accelerator) -> str | None:
    """The problem with blockwise float8's native linears on `accelerator`, or None on Hopper: torch's blockwise
    scaled_mm (cuBLASLt's DeepSeek-style kernels) checks for compute capability 9.x, and the CPU has none."""
    if accelerator.is_cuda and accelerator.capability[0] in BLOCKWISE_MAJORS:
        return None
    blackwell = (" On Blackwell, --model.converters mx (MXFP8, blocks of 32) is the native block-scaled recipe."
                 if accelerator.is_cuda and accelerator.capability >= MX_MIN_CAPABILITY else "")
    or_simulate = ", or dry-run with --estimate.gpu H100" if accelerator.simulated else ""
    return (f"--float8.recipe_name blockwise runs natively only on NVIDIA Hopper GPUs (compute capability 9.x: H100, "
            f"H200), the only ones torch 2.11 to 2.13 build its blockwise float8 matmuls for; "
            f"{accelerator.describe()}.{blackwell} Add --float8.emulate to run the same blockwise quantization with "
            f"high-precision matmuls{or_simulate}.")


def check_float8_blockwise_options(model: Model, float8: Float8) -> str | None:
    """auto_filter_small_kdims skips layers by torchao's measured speed-up thresholds, which exist for tensorwise
    and rowwise only."""
    if "float8" not in model.converters or float8.recipe_name != "blockwise" or not float8.auto_filter_small_kdims:
        return None
    return ("--float8.auto_filter_small_kdims has no size thresholds for --float8.recipe_name blockwise (torchao "
            "publishes them for tensorwise and rowwise); drop it, and keep small layers in high precision with "
            "--float8.filter_fqns.")


def converts_experts(model: Model, converter: str, section: Float8 | MX) -> bool:
    """Whether `converter` (float8 or mx, natively, with its config `section`) takes experts: a mixture-of-experts
    flavor and experts named."""
    return (converter in model.converters and not section.emulate and bool(section.moe_fqns_prototype)
            and has_experts(flavor_args(model)))


def check_float8_experts_hardware(model: Model, float8: Float8, accelerator: Accelerator) -> str | None:
    """Float8 experts multiply with torch._scaled_grouped_mm, whose float8 kernel runs on Hopper alone, and which has
    none for the CPU (the dense float8 linears' torch._scaled_mm runs from Ada on, and on the CPU)."""
    if not converts_experts(model, "float8", float8) or float8.recipe_name == "blockwise":
        return None  # blockwise experts run their emulated form everywhere (titan/quant/float8/blockwise_grouped.py)
    if accelerator.is_cuda and accelerator.capability[0] in FLOAT8_GROUPED_MAJORS:
        return None
    blackwell = (" On this Blackwell GPU, convert the experts with --model.converters mx (MXFP8 grouped matmuls) "
                 "instead." if accelerator.is_cuda and accelerator.capability[0] in MX_GROUPED_MAJORS else "")
    return (f"--model.converters float8 converts the experts of --model.flavor {model.flavor} (--float8."
            f"moe_fqns_prototype {' '.join(float8.moe_fqns_prototype)}) to float8 grouped matmuls, which torch 2.11 "
            f"to 2.13 run natively only on NVIDIA Hopper GPUs (compute capability 9.x: H100, H200); "
            f"{accelerator.describe()}.{blackwell} Add --float8.emulate to run the same quantization with "
            f"high-precision matmuls, or pass --float8.moe_fqns_prototype with no value to keep the experts in high "
            f"precision.")


@needs_in_range("training.local_batch_size", "training.seq_len", "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_microbatch_size", "parallelism.context_parallel_degree",
                "parallelism.tensor_parallel_degree")
def check_float8_tokens(model: Model, float8: Float8, training: Training, parallelism: Parallelism,
                        accelerator: Accelerator) -> str | None:
    """CUDA's float8 matmuls need each dim divisible by 16. The weight-gradient matmul (grad_output^T @ input)
    contracts over the tokens of one backward: under PP a pipeline micro-batch's, under CP this rank's 1/cp share
    of each sequence. CPU's _scaled_mm takes any size."""
    if ("float8" not in model.converters or float8.emulate or not accelerator.is_cuda
            or float8.recipe_name == "blockwise"):  # blockwise pads grad_weight's tokens to its 128-row tiles
        return None
    par = parallelism
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    if par.pipeline_parallel_degree > 1:
        batch_flag, batch = "--parallelism.pipeline_parallel_microbatch_size", par.pipeline_parallel_microbatch_size
    else:
        batch_flag, batch = "--training.local_batch_size", training.local_batch_size
    tokens = batch * training.seq_len // cp
    if tokens % 16 == 0:
        return None
    per_rank = f" / --parallelism.context_parallel_degree {cp}" if cp > 1 else ""
    # Lengths that give a multiple of 16 tokens and that context parallel (2 x cp chunks) and the sequence-parallel
    # split of each rank's share by tp still divide.
    step = math.lcm(cp * 16 // math.gcd(16, batch), 2 * cp if cp > 1 else 1, cp * tp)
    return (f"{batch_flag} {batch} x --training.seq_len {training.seq_len}{per_rank} = {tokens} tokens reach each "
            f"float8 weight-gradient matmul, which contracts over them, and CUDA's float8 matmuls need a multiple of "
            f"16. Try --training.seq_len {max(step, training.seq_len // step * step)}, or --float8.emulate.")


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


def check_nvfp4_hardware(model: Model, nvfp4: NVFP4, accelerator: Accelerator) -> str | None:
    if "nvfp4" not in model.converters or nvfp4.emulate:
        return None
    return blackwell_problem("nvfp4", "NVFP4", accelerator)


def check_mx_hardware(model: Model, mx: MX, accelerator: Accelerator) -> str | None:
    """MX linears run on every Blackwell GPU; MX experts (torch._scaled_grouped_mm) on data-center Blackwell alone."""
    if "mx" not in model.converters or mx.emulate:
        return None
    problem = blackwell_problem("mx", "MX", accelerator)
    if problem is not None or not converts_experts(model, "mx", mx):
        return problem
    if accelerator.capability[0] in MX_GROUPED_MAJORS:
        return None
    return (f"--model.converters mx converts the experts of --model.flavor {model.flavor} (--mx.moe_fqns_prototype "
            f"{' '.join(mx.moe_fqns_prototype)}) to MXFP8 grouped matmuls, which torch 2.11 to 2.13 run natively "
            f"only on GPUs of compute capability 10.x (B200, GB200, B300); {accelerator.describe()}. Add --mx.emulate "
            f"to run the same quantization with high-precision matmuls, or pass --mx.moe_fqns_prototype with no value "
            f"to keep the experts in high precision (the linears still convert).")
