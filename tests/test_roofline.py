"""Roofline step-time model: per-op roofline, ring collective times, overlap and MFU arithmetic, worked by hand."""

import typing
from dataclasses import replace

import pytest

from titan.config.job import Estimate
from titan.estimate.roofline import (
    GPUS,
    Collective,
    Network,
    OpCost,
    collective_seconds,
    compute_seconds,
    estimate_step,
)
from titan.metrics.throughput import PEAK_BF16_FLOPS

# The datasheet H100, every kernel at its peak: round numbers for the arithmetic below.
H100 = replace(GPUS["H100"], matmul_efficiency=1.0, attention_efficiency=1.0, hbm_efficiency=1.0)
NODE = Network()


# NVIDIA's datasheets (SXM parts), copied here by hand rather than from the code: dense (not sparse) tensor-core
# TFLOP/s for BF16, FP8 and TF32 (the sheets state sparse figures, twice these), HBM in GB and TB/s. H100 and H200:
# the H100/H200 Tensor Core GPU datasheets (1,979 / 3,958 / 989 TFLOPS sparse); B200: the DGX B200 datasheet, per
# GPU (72 PFLOPS FP8 training for 8 GPUs, sparse; 1,440 GB and 64 TB/s for 8); its dense FP4, 9 PFLOPS, from the
# B200 datasheet (18 sparse). Hopper has no FP4 tensor cores.
DATASHEETS = {
    "H100": {"bf16": 989.5e12, "fp8": 1979e12, "fp4": 0.0, "tf32": 494.5e12, "hbm": 80e9, "hbm_bandwidth": 3.35e12},
    "H200": {"bf16": 989.5e12, "fp8": 1979e12, "fp4": 0.0, "tf32": 494.5e12, "hbm": 141e9, "hbm_bandwidth": 4.8e12},
    "B200": {"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "tf32": 1125e12, "hbm": 180e9, "hbm_bandwidth": 8e12},
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_gpu_specs_match_the_datasheets(name: str) -> None:
    """Rounded as the sheets round them (989.4 vs 989): within 0.1%."""
    sheet, gpu = DATASHEETS[name], GPUS[name]
    assert gpu.peak_bf16_flops == pytest.approx(sheet["bf16"], rel=1e-3)
    assert gpu.peak_fp8_flops == pytest.approx(sheet["fp8"], rel=1e-3)
    assert gpu.peak_fp4_flops == pytest.approx(sheet["fp4"], rel=1e-3)
    assert gpu.peak_tf32_flops == pytest.approx(sheet["tf32"], rel=1e-3)
    assert (gpu.hbm_bytes, gpu.hbm_bandwidth) == (sheet["hbm"], sheet["hbm_bandwidth"])
    # MFU's peak (metrics/throughput.py, looked up by device name) is the roofline's peak.
    assert dict(PEAK_BF16_FLOPS)[name] == gpu.peak_bf16_flops


def test_gpu_table_covers_the_estimate_choices() -> None:
    """Every --estimate.gpu choice has a spec and a datasheet row, and nothing else does."""
    choices = set(typing.get_args(typing.get_type_hints(Estimate)["gpu"]))
    assert set(GPUS) == choices == set(DATASHEETS)


def test_op_roofline() -> None:
    matmul = OpCost(flops=1e12, bytes=1000, precision="bf16")
    assert compute_seconds([matmul], H100) == pytest.approx(1e12 / 989e12)
    copy = OpCost(flops=0.0, bytes=3_350_000_000, precision="bf16")
    assert compute_seconds([copy], H100) == pytest.approx(1e-3)
    assert compute_seconds([matmul, copy], H100) == pytest.approx(1e12 / 989e12 + 1e-3)
    fp8 = compute_seconds([OpCost(1e12, 1000, "fp8")], H100)
    fp32 = compute_seconds([OpCost(1e12, 1000, "fp32")], H100)
    assert fp8 == pytest.approx(compute_seconds([matmul], H100) / 2)
    assert fp32 == pytest.approx(compute_seconds([matmul], H100) * 2)
    with pytest.raises(ValueError, match="OpCost.precision"):
        compute_seconds([OpCost(1.0, 1, "int8")], H100)
    with pytest.raises(ValueError, match="with a peak on H100"):  # an H100 has no FP4 matmuls to time
        compute_seconds([OpCost(1.0, 1, "fp4")], H100)
    assert compute_seconds([OpCost(1e12, 1000, "fp4")], GPUS["B200"]) == pytest.approx(1e12 / (9000e12 * 0.675))


def test_achieved_ceilings_scale_each_kind_of_op() -> None:
    """Matmuls run at matmul_efficiency of the peak, fused attention at attention_efficiency, memory-bound ops at
    hbm_efficiency of the bandwidth; the shipped specs carry the shares measured on an H100 (all below 1)."""
    achieved = replace(H100, matmul_efficiency=0.5, attention_efficiency=0.25, hbm_efficiency=0.8)
    assert compute_seconds([OpCost(1e12, 1000, "bf16")], achieved) == pytest.approx(2e12 / 989e12)
    assert compute_seconds([OpCost(1e12, 1000, "bf16", attention=True)], achieved) == pytest.approx(4e12 / 989e12)
    assert compute_seconds([OpCost(0.0, 3_350_000_000, "bf16")], achieved) == pytest.approx(1e-3 / 0.8)
    for gpu in GPUS.values():
        assert 0 < gpu.attention_efficiency < gpu.matmul_efficiency < gpu.hbm_efficiency < 1


def test_ring_collectives() -> None:
    size = 8_000_000_000
    gather = Collective("dp_shard", "all_gather", size, tuple(range(8)))
    assert collective_seconds(gather, H100, NODE) == pytest.approx(7 / 8 * size / 450e9)
    two_nodes = Network(gpus_per_node=4)
    assert collective_seconds(gather, H100, two_nodes) == pytest.approx(7 / 8 * size / 50e9)
    reduce = Collective("dp_shard", "all_reduce", size, tuple(range(8)))
    assert collective_seconds(reduce, H100, NODE) == pytest.approx(2 * collective_seconds(gather, H100, NODE))
    assert collective_seconds(Collective("tp", "all_reduce", size, (3,)), H100, NODE) == 0.0
    send = Collective("pp", "send", size, (0, 8))
    recv = Collective("pp", "recv", size, (0, 8))
    assert collective_seconds(send, H100, NODE) == pytest.approx(size / 50e9)
    assert collective_seconds(recv, H100, NODE) == 0.0
    custom = Network(intra_node_bandwidth=100e9)
    assert collective_seconds(gather, H100, custom) == pytest.approx(7 / 8 * size / 100e9)
    with pytest.raises(ValueError, match="Collective.kind"):
        collective_seconds(Collective("tp", "all_gather_into", size, (0, 1)), H100, NODE)


def _gather_taking(seconds: float, dim: str) -> Collective:
    """An all-gather over 2 ranks on one node lasting `seconds` (ring factor 1/2 at 450 GB/s)."""
    return Collective(dim, "all_gather", round(seconds * 2 * 450e9), (0, 1))


def test_overlap_and_bubble() -> None:
    ops = [OpCost(flops=989e12, bytes=0, precision="bf16")]  # exactly 1 s on an H100
    args = dict(gpu=H100, network=NODE, tokens_per_gpu=1.0, model_flops_per_token=1.0)
    hidden = estimate_step(ops, [_gather_taking(0.6, "dp_shard")], bubble_fraction=0.0, **args)
    assert hidden.comm_s["dp_shard"] == pytest.approx(0.6)
    assert hidden.exposed_comm_s["dp_shard"] == 0.0
    assert hidden.step_s == pytest.approx(1.0)
    # FSDP 1.2 s + PP 0.3 s overlap 1 s of compute: 0.5 s exposed, shared 4:1.
    over = estimate_step(ops, [_gather_taking(1.2, "fsdp"), _gather_taking(0.3, "pp")], bubble_fraction=0.0, **args)
    assert over.exposed_comm_s["fsdp"] == pytest.approx(0.4)
    assert over.exposed_comm_s["pp"] == pytest.approx(0.1)
    assert over.step_s == pytest.approx(1.5)
    tp = estimate_step(ops, [_gather_taking(0.2, "tp"), _gather_taking(0.1, "cp")], bubble_fraction=0.0, **args)
    assert tp.exposed_comm_s == pytest.approx({"tp": 0.2, "cp": 0.1})
    assert tp.step_s == pytest.approx(1.3)
    # Expert parallel's all-to-all blocks the experts' next matmul, also where its group is dp_shard's (EP 8 on 8
    # ranks): the dim's FSDP all-gather stays hidden, its all-to-all does not.
    exchange = Collective("dp_shard", "all_to_all", round(0.3 * 2 * 450e9), (0, 1))
    ep = estimate_step(ops, [_gather_taking(0.6, "dp_shard"), exchange], bubble_fraction=0.0, **args)
    assert ep.comm_s["dp_shard"] == pytest.approx(0.9) and ep.exposed_comm_s["dp_shard"] == pytest.approx(0.3)
    assert ep.step_s == pytest.approx(1.3)
    # The experts' FSDP all-gathers are prefetched as the blocks' are.
    experts = estimate_step(ops, [_gather_taking(0.6, "efsdp")], bubble_fraction=0.0, **args)
    assert experts.exposed_comm_s["efsdp"] == 0.0
    bubble = estimate_step(ops, [], bubble_fraction=0.2, **args)
    assert bubble.bubble_s == pytest.approx(0.25)
    assert bubble.step_s == pytest.approx(1.25)
    with pytest.raises(ValueError, match="bubble_fraction"):
        estimate_step(ops, [], bubble_fraction=1.0, **args)


def test_tokens_and_mfu() -> None:
    # 4 s of bf16 matmul + 1 s of exposed TP: step 5 s, 8192 tokens -> 1638.4 tokens/s;
    # 6e11 FLOPs/token * 1638.4 / 989e12 = 99.39 %.
    ops = [OpCost(flops=4 * 989e12, bytes=0, precision="bf16")]
    est = estimate_step(ops, [_gather_taking(1.0, "tp")], H100, NODE, bubble_fraction=0.0,
                        tokens_per_gpu=8192.0, model_flops_per_token=6e11)
    assert est.step_s == pytest.approx(5.0)
    assert est.tokens_per_s == pytest.approx(1638.4)
    assert est.mfu_pct == pytest.approx(100 * 6e11 * 1638.4 / 989e12)
