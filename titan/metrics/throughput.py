"""Peak FLOP/s per known accelerator, the TFLOPs/MFU formula, and memory readings."""

import re
import resource
import sys
import time
from dataclasses import dataclass

import torch

# Dense bf16 tensor-core peak per device (no sparsity), by model name: the vendors' datasheets, whose tables give
# the sparse figure for NVIDIA's Hopper and Blackwell parts, halved here.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100": 989e12,  # H100 SXM5 datasheet: 1,979 TFLOPS sparse
    "H100 PCIe": 756e12,  # H100 datasheet, PCIe column: 1,513 sparse
    "H100 NVL": 835e12,  # H100 datasheet, NVL column: 1,671 sparse
    "H200": 989e12,  # H200 SXM datasheet: 1,979 sparse
    "GH200": 989e12,  # GH200 Grace Hopper datasheet: 1,979 sparse
    "H20": 148e12,  # H20 product brief: 148 dense
    "B200": 2250e12,  # HGX B200 datasheet: 4.5 PFLOPS sparse per GPU
    "B100": 1750e12,  # HGX B100 datasheet: 3.5 PFLOPS sparse per GPU
    "GB200": 2500e12,  # GB200 NVL72 datasheet: 10 PFLOPS sparse per superchip of 2 GPUs
    "A100": 312e12,  # A100 datasheet (SXM and PCIe): 312 dense
    "A800": 312e12,  # A800 datasheet: 312 dense
    "L40S": 362e12,  # L40S datasheet: 362.05 dense (733 sparse)
    "L40": 181e12,  # L40 datasheet: 181.05 dense (362.1 sparse)
    "L4": 121e12,  # L4 datasheet: 121 dense (242 sparse)
    "A10G": 70e12,  # AWS's EC2 G5 documentation: 70 TFLOPS bf16 per A10G
    "MI300X": 1307e12,  # AMD Instinct MI300X datasheet: 1,307.4 dense
    "MI325X": 1307e12,  # AMD Instinct MI325X datasheet: 1,307.4 dense
    "MI250X": 383e12,  # AMD Instinct MI250X datasheet: 383 dense
}


def name_words(name: str) -> list[str]:
    """A device name's words, case-folded: torch writes them apart with spaces or dashes ("NVIDIA A100-SXM4-80GB")."""
    return re.split(r"[\s-]+", name.strip().casefold())


def peak_flops_for_name(name: str) -> float | None:
    """Peak bf16 FLOP/s of the device torch.cuda.get_device_name() calls `name`, or None when no table entry names it.
    An entry matches as whole words, and the longest matching entry wins ("H100 PCIe" over "H100"), so a model
    number is never matched inside a longer one ("B200" in "GB200", "L4" in "L40")."""
    words = name_words(name)
    matching = [key for key in PEAK_BF16_FLOPS if contains_run(words, name_words(key))]
    if not matching:
        return None
    return PEAK_BF16_FLOPS[max(matching, key=lambda key: len(name_words(key)))]


def contains_run(words: list[str], run: list[str]) -> bool:
    """Whether `run` appears in `words` as consecutive whole words."""
    return any(words[i:i + len(run)] == run for i in range(len(words) - len(run) + 1))


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of `device`, or None where it is not in the table (CPUs, unknown GPUs): MFU is then omitted."""
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def achieved_tflops(flops_per_token: int, tokens_per_second: float) -> float:
    """Model TFLOP/s per device from the training FLOPs per token and the per-device token rate."""
    return flops_per_token * tokens_per_second / 1e12


def mfu_percent(flops_per_token: int, tokens_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in percent of the device's peak, or None when the peak is unknown."""
    if peak is None:
        return None
    return 100.0 * flops_per_token * tokens_per_second / peak


def memory_gib(device: torch.device) -> float:
    """Peak memory since the last reset: CUDA max allocated for a GPU, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def reserved_gib(device: torch.device) -> float | None:
    """Peak CUDA memory reserved by the caching allocator (None on CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window, so each logged value is the peak since the previous log."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


Mark = float | torch.cuda.Event
"""When a step's work ended: the host clock on CPU, where the work is done once it is queued; a timing event queued
behind the work on a GPU, where the host runs ahead of it."""


def mark_now(device: torch.device) -> Mark:
    """A mark behind everything queued so far on `device`."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from mark `start` to mark `end` (waiting for `end`'s work on a GPU, which is done by the time a
    step's loss has been read: its mark is queued right behind the loss's copy)."""
    if isinstance(end, torch.cuda.Event):
        end.synchronize()
        return start.elapsed_time(end) / 1000  # milliseconds
    return end - start


@dataclass(frozen=True)
class QueuedStepWork:
    """A step's tokens on this device, its data wait, and the mark behind its work."""

    tokens: float
    data_wait_seconds: float
    end: Mark


class ThroughputMeter:
    """Tokens, time and data wait of the steps between two logged steps on this device.

    Each step's time runs from the end of the step before it to the end of its own work on the device, marked when
    its update is queued. The host reads a step's loss a step later, or at once before a save, an evaluation and
    at the last step; the marks do not depend on when that happens, so each logged step gets its own time. Time
    spent outside training steps (evaluations, saves) is excluded."""

    def __init__(self, flops_per_token: int, device: torch.device, total_steps: int) -> None:
        self.flops_per_token = flops_per_token
        self.device = device
        self.peak = peak_flops(device)
        self.total_steps = total_steps
        self.start()

    def start(self) -> None:
        """Open a window now: before the first step of a run, and after a rollback (whose reload is not training).
        Steps queued before are forgotten."""
        self.window_start: Mark = mark_now(self.device)
        self.queued: dict[int, QueuedStepWork] = {}
        self.excluded_seconds = 0.0

    def step_queued(self, step: int, tokens: float, data_wait_seconds: float) -> None:
        """Step `step`'s work (its tokens on this device, after waiting `data_wait_seconds` for its batches) is
        queued on the device: mark its end."""
        self.queued[step] = QueuedStepWork(tokens, data_wait_seconds, mark_now(self.device))

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of work that is not training (an evaluation, a save), done since the last step was
        queued, out of the next window's rates."""
        self.excluded_seconds += seconds

    def window(self, step: int) -> dict[str, float | None]:
        """Rates over the steps queued since the last window, up to `step`, whose loss has been read (tps, tflops,
        mfu_pct, mem_gib, mem_reserved_gib, data_wait_pct, eta_s, step_s: seconds per step); `step` ends the
        window and starts the next."""
        steps = sorted(s for s in self.queued if s <= step)
        assert steps and steps[-1] == step, f"step {step} is not queued (queued: {sorted(self.queued)})"
        work = [self.queued.pop(s) for s in steps]
        end = work[-1].end
        elapsed = max(seconds_between(self.window_start, end) - self.excluded_seconds, 1e-9)
        tps = sum(w.tokens for w in work) / elapsed
        seconds_per_step = elapsed / len(work)
        rates = {
            "tps": tps,
            "tflops": achieved_tflops(self.flops_per_token, tps),
            "mfu_pct": mfu_percent(self.flops_per_token, tps, self.peak),
            "mem_gib": memory_gib(self.device),
            "mem_reserved_gib": reserved_gib(self.device),
            "data_wait_pct": 100.0 * sum(w.data_wait_seconds for w in work) / elapsed,
            "eta_s": seconds_per_step * (self.total_steps - step),
            "step_s": seconds_per_step,
        }
        reset_peak_memory(self.device)
        self.window_start, self.excluded_seconds = end, 0.0
        return rates
