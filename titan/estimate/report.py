"""The dry run's per-rank report: memory at the step's peak by category, the model's size and FLOPs, the collective
volume per mesh dimension, and the roofline step time, tokens/s and MFU on a named GPU. Whether the peak fits in
that GPU's memory is the one verdict; everything about time is labelled an estimate."""

from collections import defaultdict

from titan.config.errors import ConfigError
from titan.config.job import Estimate
from titan.estimate.data_cost import data_report_lines
from titan.estimate.roofline import GPUS, Network, StepEstimate, collective_seconds, compute_seconds, estimate_step
from titan.estimate.simulate import DryRunResult
from titan.estimate.trace import CATEGORIES
from titan.metrics.log import logger

GIB = 2**30


def network_for(est: Estimate) -> Network:
    nvlink = est.nvlink_bandwidth_gbs * 1e9 if est.nvlink_bandwidth_gbs is not None else None
    return Network(gpus_per_node=est.gpus_per_node, inter_node_bandwidth=est.inter_node_bandwidth_gbs * 1e9,
                   intra_node_bandwidth=nvlink)


def step_estimate(result: DryRunResult, est: Estimate) -> StepEstimate:
    return estimate_step(result.ops, result.collectives, GPUS[est.gpu], network_for(est), result.bubble_fraction,
                         result.tokens_per_gpu, result.flops_per_token)


def collective_rows(result: DryRunResult, est: Estimate) -> list[str]:
    """One line per (mesh dimension, kind): GiB this rank sends or receives per step, calls, group, link, time."""
    gpu, network = GPUS[est.gpu], network_for(est)
    totals: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, 0.0, ()])
    for collective in result.collectives:
        row = totals[(collective.dim, collective.kind)]
        row[0] += collective.bytes
        row[1] += 1
        row[2] += collective_seconds(collective, gpu, network)
        row[3] = collective.ranks
    lines = [f"  {'mesh dim':<12} {'collective':<15} {'GiB/step':>10} {'calls':>6} {'group':>6}  {'link':<10} "
             f"{'time (ms)':>9}"]
    for (dim, kind), (nbytes, calls, seconds, ranks) in sorted(totals.items()):
        nodes = {rank // est.gpus_per_node for rank in ranks}
        link = "NVLink" if len(nodes) <= 1 else "network"
        lines.append(f"  {dim:<12} {kind:<15} {nbytes / GIB:>10.3f} {calls:>6} {len(ranks):>6}  {link:<10} "
                     f"{1e3 * seconds:>9.1f}")
    return lines


def active_params_note(result: DryRunResult) -> str:
    """" (3,353,032,704 active per token)" for a mixture of experts; empty for a dense model."""
    if result.num_active_params == result.num_params:
        return ""
    return f" ({result.num_active_params:,} active per token)"


def update_line(result: DryRunResult, est: Estimate, step_s: float) -> str:
    """What the optimizer update costs this rank: its matmul FLOPs (Muon's Newton-Schulz), its roofline compute time,
    the bytes and time of its collectives (Muon's gathers and scatters, on the critical path), and their share of the
    step."""
    gpu, network = GPUS[est.gpu], network_for(est)
    flops = sum(op.flops for op in result.update_ops)
    compute = compute_seconds(result.update_ops, gpu)
    moved = sum(collective.bytes for collective in result.update_collectives)
    communication = sum(collective_seconds(collective, gpu, network) for collective in result.update_collectives)
    share = 100 * (compute + communication) / step_s
    return (f"  optimizer update ({result.optimizer}): {flops / 1e12:.3g} TFLOPs of matmuls, {compute:.3f} s "
            f"compute; its collectives {moved / GIB:.3f} GiB, {communication:.3f} s: {share:.1f}% of the step")


def format_report(result: DryRunResult, est: Estimate) -> str:
    gpu = GPUS[est.gpu]
    memory = result.memory
    step = step_estimate(result, est)
    share = 100 * result.local_params / result.num_params
    lines = [
        f"Dry run of rank {result.rank} of {result.world_size} ({result.layout}); this rank runs {result.stages}.",
        f"Model: {result.num_params:,} parameters{active_params_note(result)}, {result.flops_per_token / 1e9:.3g} "
        f"GFLOPs per token (6N + attention, the MFU convention, N the active parameters); this rank holds "
        f"{result.local_params:,} ({share:.2f}%).",
        "Memory at the step's peak, tensor bytes on this rank (GiB), eager code (compile off):",
        *(f"  {name:<28} {memory.by_category[name] / GIB:>8.2f}" for name in CATEGORIES),
        f"  {'total':<28} {memory.total / GIB:>8.2f}  of {gpu.hbm_bytes / GIB:.1f} GiB on an {gpu.name} "
        f"({100 * memory.total / gpu.hbm_bytes:.0f}%)",
        *([f"  host memory (CPU offload)    {memory.host / GIB:>8.2f}  sharded parameters, their gradients and the "
           f"optimizer state, per rank"] if memory.host else []),
        f"Collectives per step on this rank ({est.gpus_per_node} GPUs per node):",
        *collective_rows(result, est),
        f"Step time on {gpu.name} (a roofline estimate, not a measurement; it ranks layouts):",
        f"  compute {step.compute_s:.3f} s + pipeline bubble {step.bubble_s:.3f} s + exposed communication "
        f"{sum(step.exposed_comm_s.values()):.3f} s = {step.step_s:.3f} s per step",
        f"  {result.tokens_per_gpu:,} tokens per GPU per step: {step.tokens_per_s:,.0f} tokens/s per GPU, MFU "
        f"{step.mfu_pct:.1f}%",
        update_line(result, est, step.step_s),
        *data_report_lines(result.data, step.step_s),
    ]
    return "\n".join(lines)


def check_fits(result: DryRunResult, est: Estimate) -> None:
    """A predicted peak above the GPU's memory is a config error: the job would stop with out-of-memory."""
    gpu = GPUS[est.gpu]
    if result.memory.total > gpu.hbm_bytes:
        raise ConfigError(
            f"Rank {result.rank} of {result.world_size} would need {result.memory.total / GIB:.1f} GiB at its peak, "
            f"more than the {gpu.hbm_bytes / GIB:.1f} GiB of an {gpu.name} (--estimate.gpu). Try "
            f"--activation_checkpoint.mode full, a smaller --training.local_batch_size, or more ranks for FSDP "
            f"(--parallelism.data_parallel_shard_degree) or TP (--parallelism.tensor_parallel_degree).")


def warn_slow_data(result: DryRunResult, est: Estimate) -> None:
    """Data slower than the step starves the GPU whatever the prefetch: worth a warning, not an error (the roofline
    step is an estimate)."""
    step_s = step_estimate(result, est).step_s
    if not result.data.keeps_up(step_s):
        logger.warning(f"Rank {result.rank}'s loader would need {result.data.seconds_per_step:.3f} s per step for "
                       f"its batches, longer than the estimated {step_s:.3f} s step: the GPUs would wait for data. "
                       f"Use a faster disk for the token stores or a larger --training.local_batch_size per step.")
