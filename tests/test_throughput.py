"""Peak FLOP/s by device name (the MFU denominator), checked with the names torch.cuda.get_device_name() reports."""

import time

import pytest
import torch

from titan.hardware import SIMULATED_GPUS
from titan.metrics import throughput
from titan.metrics.throughput import PEAK_BF16_FLOPS, ThroughputMeter, peak_flops_for_name


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


class RecordedEvent:
    """torch.cuda.Event's timing API on the host clock: record() stamps the time, elapsed_time() gives
    milliseconds, and it must be synchronized before it is read, as a CUDA event must have completed."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs enable_timing=True"
        self.at: float | None = None
        self.synchronized = False

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: "RecordedEvent") -> float:
        assert end.synchronized, "a CUDA event's time is read before it completed"
        return 1000 * (end.at - self.at)


def test_the_meter_times_cuda_steps_by_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU each step's end is a timing event queued behind its work (the CPU tests run the host-clock path):
    the meter records one per step, waits for it before reading, and turns its milliseconds into seconds. The
    steps' times here come from the events alone: an evaluation's time, excluded, and a late loss read do not
    count."""
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    monkeypatch.setattr(throughput, "peak_flops", lambda device: 989e12)
    monkeypatch.setattr(throughput, "memory_gib", lambda device: 1.0)
    monkeypatch.setattr(throughput, "reserved_gib", lambda device: 2.0)
    monkeypatch.setattr(throughput, "reset_peak_memory", lambda device: None)
    meter = ThroughputMeter(flops_per_token=1_000_000, device=torch.device("cuda", 0), total_steps=10)
    meter.start()
    time.sleep(0.2)
    meter.step_queued(1, tokens=1000, data_wait_seconds=0.02)
    time.sleep(0.1)  # an evaluation after step 1
    meter.exclude(0.1)
    time.sleep(0.2)
    meter.step_queued(2, tokens=1000, data_wait_seconds=0.0)
    time.sleep(0.3)  # the host reads step 2's loss late: not step 2's time
    rates = meter.window(2)
    assert rates["step_s"] == pytest.approx(0.2, rel=0.1)
    assert rates["tps"] == pytest.approx(2000 / 0.4, rel=0.1)
    assert rates["data_wait_pct"] == pytest.approx(100 * 0.02 / 0.4, rel=0.1)
    assert rates["mfu_pct"] == pytest.approx(100 * 1e6 * rates["tps"] / 989e12)
    assert rates["eta_s"] == pytest.approx(8 * rates["step_s"])
