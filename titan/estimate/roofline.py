"""Roofline step time, tokens/s and MFU of one rank, from the ops and collectives a fake-tensor dry run recorded.

This is an estimate for ranking parallel layouts, not a promise of measured numbers. The model:

- Compute: each op takes max(flops / achieved FLOP/s, bytes / achieved HBM bandwidth), so large matmuls are
  compute-bound and elementwise, norm and softmax ops memory-bound; the op times add up (one stream, no concurrent
  kernels). Achieved means the datasheet peak times the share that a training step's kernels reach on that GPU
  (GPUSpec's *_efficiency fields, measured by scripts/bench_roofline.py on an H100): cuBLAS matmuls, fused attention
  and eager elementwise kernels each have their own. Kernel launch overheads are ignored, and so is fusion: every op
  pays its own HBM round trip, as in eager mode (torch.compile fuses some away, so compiled runs beat the estimate).
- Collectives: ring algorithms, the NCCL-tests bus-bandwidth model. For a group of n ranks and bandwidth B,
  all_gather, reduce_scatter and all_to_all take (n-1)/n * bytes / B, all_reduce 2(n-1)/n * bytes / B, broadcast
  and send bytes / B; a send/recv pair is counted once, on the send (recv takes 0); barrier takes 0. B is the
  intra-node (NVLink) bandwidth when all ranks of the group share a node, else the inter-node bandwidth, the slowest
  link of a ring that crosses nodes. There is no latency term, so small messages are under-estimated.
- Overlap: FSDP/HSDP collectives (every dim whose name starts with "dp", "fsdp", and the experts' own FSDP "efsdp",
  whose units FSDP2 prefetches as it does the blocks') and pipeline send/recv ("pp")
  run on their own streams behind compute: together they are exposed only by max(0, their sum - compute_s), which is
  shared among their dims in proportion to their comm time. TP and CP collectives sit on the critical path (the
  next matmul needs their output), and so do "loss" and any other dim: fully exposed. So does every all-to-all,
  whatever dim it is labelled with: expert parallel's token exchange feeds the experts' next matmul, and where EP's
  ranks are all of dp_shard's the group (and its label) is dp_shard's.
- Pipeline bubble: a rank idles a share f of the step (titan/parallel/stages.py ideal_bubble_fraction), so
  bubble_s = compute_s * f / (1 - f).
- step_s = compute_s + bubble_s + sum(exposed comm); tokens/s and MFU follow titan/metrics/throughput.py.
"""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from titan.metrics.throughput import PEAK_BF16_FLOPS, mfu_percent


@dataclass(frozen=True)
class OpCost:
    flops: float
    """FLOPs of the op on this rank (0 for non-matmul ops)."""
    bytes: int
    """Bytes of the op's tensor inputs plus outputs on this rank."""
    precision: str
    """Dtype class of a matmul's inputs: "bf16" (fp16 counts the same), "fp32", "fp8" (MX included) or "fp4"."""
    attention: bool = False
    """A fused attention kernel, whose FLOPs run at GPUSpec.attention_efficiency rather than the matmuls' share."""
    name: str = ""
    """The op's name (aten's, or a custom op's), for listings of what a step runs."""


@dataclass(frozen=True)
class Collective:
    dim: str
    """Mesh dimension label: "dp_shard", "dp_replicate", "fsdp" (dp_shard x cp), "dp", "tp", "cp", "pp", "loss"."""
    kind: str
    """"all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send", "recv" or "barrier"."""
    bytes: int
    """Payload: all_gather the gathered output, reduce_scatter the full input, all_to_all the input, else the tensor."""
    ranks: tuple[int, ...]
    """Global ranks of the group, in group order."""


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_bf16_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    peak_fp8_flops: float
    peak_fp4_flops: float
    """Dense FP4 (NVFP4) tensor-core FLOP/s; 0 where the GPU has no FP4 matmuls (Hopper)."""
    peak_tf32_flops: float
    """What fp32 matmuls get: TF32 tensor cores, as torch uses with high matmul precision."""
    hbm_bytes: float
    """Memory capacity in bytes (decimal GB, as datasheets state it)."""
    hbm_bandwidth: float
    """Bytes/s."""
    nvlink_bandwidth: float
    """Bytes/s per GPU, one direction."""
    matmul_efficiency: float
    """Share of the matmul peaks that a training step's cuBLAS matmuls reach."""
    attention_efficiency: float
    """Share of the bf16 peak that fused causal attention, forward and backward, reaches (FLOPs as trace.py counts
    them: the causal half)."""
    hbm_efficiency: float
    """Share of the HBM bandwidth that eager elementwise kernels reach."""


# Measured on an H100 80GB HBM3 (SXM), torch 2.11.0+cu130, by `python scripts/bench_roofline.py` (docs/scale.md):
# matmuls of the 1B and 8B blocks at 16,384 tokens reached 0.652 and 0.698 of the bf16 peak, causal attention
# forward + backward 0.405 (head dim 64) and 0.500 (head dim 128), elementwise kernels over 1 GiB 0.874 of the HBM
# bandwidth. Taken as the same shares of the H200's and B200's datasheet figures: an assumption, not a measurement.
MATMUL_EFFICIENCY = 0.675
ATTENTION_EFFICIENCY = 0.45
HBM_EFFICIENCY = 0.87


def _gpu(name: str, hbm_bytes: float, hbm_bandwidth: float, nvlink_bandwidth: float, has_fp4: bool) -> GPUSpec:
    """Spec with the bf16 peak from metrics/throughput.py (one place for it); fp8 is 2x dense bf16 on Hopper and
    Blackwell, dense FP4 4x on Blackwell (B200: 9 PFLOP/s dense FP4, 4.5 FP8, 2.25 bf16; datasheets), and TF32 half
    of bf16."""
    bf16 = dict(PEAK_BF16_FLOPS)[name]
    return GPUSpec(name, bf16, 2 * bf16, 4 * bf16 if has_fp4 else 0.0, bf16 / 2, hbm_bytes, hbm_bandwidth,
                   nvlink_bandwidth, MATMUL_EFFICIENCY, ATTENTION_EFFICIENCY, HBM_EFFICIENCY)


# Memory and link figures from NVIDIA's datasheets (SXM parts). torch reports ~79.1 GiB usable on an 80 GB H100.
# B200: 180 GB, as DGX B200 lists 1,440 GB for 8 GPUs. NVLink 4 moves 900 GB/s both ways (450 each), NVLink 5 1.8 TB/s.
GPUS: dict[str, GPUSpec] = {
    "H100": _gpu("H100", hbm_bytes=80e9, hbm_bandwidth=3.35e12, nvlink_bandwidth=450e9, has_fp4=False),
    "H200": _gpu("H200", hbm_bytes=141e9, hbm_bandwidth=4.8e12, nvlink_bandwidth=450e9, has_fp4=False),
    "B200": _gpu("B200", hbm_bytes=180e9, hbm_bandwidth=8e12, nvlink_bandwidth=900e9, has_fp4=True),
}


@dataclass(frozen=True)
class Network:
    gpus_per_node: int = 8
    """GPUs that share one NVLink domain."""
    inter_node_bandwidth: float = 50e9
    """Bytes/s per GPU, one direction: one 400 Gb/s NDR InfiniBand NIC per GPU."""
    intra_node_bandwidth: float | None = None
    """Bytes/s per GPU, one direction, inside a node; None takes the GPU's NVLink bandwidth."""


def _peak(precision: str, gpu: GPUSpec) -> float:
    peaks = {"bf16": gpu.peak_bf16_flops, "fp16": gpu.peak_bf16_flops, "fp8": gpu.peak_fp8_flops,
             "fp4": gpu.peak_fp4_flops, "fp32": gpu.peak_tf32_flops}
    if precision not in peaks or not peaks[precision]:
        raise ValueError(f"OpCost.precision {precision!r} is not one of {sorted(peaks)} with a peak on {gpu.name}. "
                         f"Record the dtype class of the matmul's inputs.")
    return peaks[precision]


def op_seconds(op: OpCost, gpu: GPUSpec) -> float:
    """Roofline time of one op at `gpu`'s achieved ceilings: bound by its FLOPs or by its HBM traffic."""
    efficiency = gpu.attention_efficiency if op.attention else gpu.matmul_efficiency
    return max(op.flops / (_peak(op.precision, gpu) * efficiency), op.bytes / (gpu.hbm_bandwidth * gpu.hbm_efficiency))


def compute_seconds(ops: Iterable[OpCost], gpu: GPUSpec) -> float:
    """Roofline time of `ops` run one after another on `gpu`."""
    return sum(op_seconds(op, gpu) for op in ops)


# Bytes a ring moves over each GPU's link, as a multiple of the payload, for a group of n > 1 ranks.
_RING_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # the matching send already counts the transfer
    "barrier": lambda n: 0.0,
}


def collective_seconds(collective: Collective, gpu: GPUSpec, network: Network) -> float:
    """Ring time of one collective: NVLink inside a node, the inter-node link once the group spans nodes."""
    if collective.kind not in _RING_FACTOR:
        raise ValueError(f"Collective.kind {collective.kind!r} is not one of {sorted(_RING_FACTOR)}. Map the "
                         f"recorded c10d op to one of them.")
    n = len(collective.ranks)
    if n <= 1:
        return 0.0
    one_node = len({rank // network.gpus_per_node for rank in collective.ranks}) == 1
    intra = network.intra_node_bandwidth if network.intra_node_bandwidth is not None else gpu.nvlink_bandwidth
    bandwidth = intra if one_node else network.inter_node_bandwidth
    return _RING_FACTOR[collective.kind](n) * collective.bytes / bandwidth


def _overlaps_compute(collective: Collective) -> bool:
    """FSDP/HSDP and pipeline traffic runs on side streams behind compute; TP, CP, all-to-alls and the rest block the
    next op."""
    return collective.kind != "all_to_all" and (collective.dim.startswith("dp")
                                                or collective.dim in ("fsdp", "efsdp", "pp"))


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float
    """Roofline time of the ops this rank runs."""
    bubble_s: float
    """Pipeline idle time."""
    comm_s: dict[str, float]
    """Per mesh dim: total collective time."""
    exposed_comm_s: dict[str, float]
    """Per mesh dim: the part not hidden behind compute."""
    step_s: float
    tokens_per_s: float
    """Per GPU."""
    mfu_pct: float
    """Model FLOPs (6N + attention, as given) per second over the GPU's dense bf16 peak."""


def _exposed(timed: list[tuple[Collective, float]], compute_s: float) -> dict[str, float]:
    """Each dim's exposed seconds: the collectives that overlap compute share max(0, their sum - compute_s) by their
    comm time; the others are fully exposed."""
    hidden_total = sum(t for collective, t in timed if _overlaps_compute(collective))
    excess = max(0.0, hidden_total - compute_s)
    exposed: dict[str, float] = defaultdict(float)
    for collective, t in timed:
        exposed[collective.dim] += (t * excess / hidden_total if hidden_total > 0 else 0.0) \
            if _overlaps_compute(collective) else t
    return dict(exposed)


def estimate_step(ops: Iterable[OpCost], collectives: Iterable[Collective], gpu: GPUSpec, network: Network,
                  bubble_fraction: float, tokens_per_gpu: float, model_flops_per_token: float) -> StepEstimate:
    """Step time of one rank from its recorded ops and collectives. `bubble_fraction` is the share of the step the
    rank idles in the pipeline schedule; `tokens_per_gpu` is the global batch's tokens over the world size."""
    if not 0.0 <= bubble_fraction < 1.0:
        raise ValueError(f"bubble_fraction {bubble_fraction} must be in [0, 1). Pass ideal_bubble_fraction(...).")
    compute_s = compute_seconds(ops, gpu)
    if compute_s == 0.0:
        raise ValueError("estimate_step got no op with FLOPs or bytes. Record the step's aten ops before estimating.")
    bubble_s = compute_s * bubble_fraction / (1.0 - bubble_fraction)
    timed = [(collective, collective_seconds(collective, gpu, network)) for collective in collectives]
    comm_s: dict[str, float] = defaultdict(float)
    for collective, t in timed:
        comm_s[collective.dim] += t
    exposed = _exposed(timed, compute_s)
    step_s = compute_s + bubble_s + sum(exposed.values())
    tokens_per_s = tokens_per_gpu / step_s
    mfu_pct = mfu_percent(model_flops_per_token, tokens_per_s, gpu.peak_bf16_flops)
    assert mfu_pct is not None  # None only for an unknown peak
    return StepEstimate(compute_s, bubble_s, dict(comm_s), exposed, step_s, tokens_per_s, mfu_pct)
