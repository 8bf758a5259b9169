"""Peak FLOP/s by device name (the MFU denominator), checked with the names torch.cuda.get_device_name() reports."""

import pytest

from titan.config.hardware import SIMULATED_GPUS
from titan.metrics.throughput import PEAK_BF16_FLOPS, peak_flops_for_name


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H20", 148e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA GB200", 2500e12),  # contains "B200", a different card
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),  # starts with "L4", a different card
    ("NVIDIA L4", 121e12),
    ("AMD Instinct MI300X", 1307e12),
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA H800", None),
])
def test_peak_flops_by_device_name(name: str, peak: float | None) -> None:
    """Each card gets its own entry: a name is matched by whole words, the longest entry first, never by a
    substring of a longer model number."""
    assert peak_flops_for_name(name) == peak


@pytest.mark.parametrize("gpu", sorted(SIMULATED_GPUS))
def test_the_dry_runs_gpus_have_their_roofline_peak(gpu: str) -> None:
    """The name a dry run gives its simulated GPU finds the peak the roofline uses for it."""
    assert peak_flops_for_name(SIMULATED_GPUS[gpu].name) == dict(PEAK_BF16_FLOPS)[gpu]
