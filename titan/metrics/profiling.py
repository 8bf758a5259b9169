"""torch.profiler traces and CUDA memory snapshots every N steps, off by default."""

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

from titan.config.job import Profiling
from titan.metrics.log import logger

# CUDA allocator events kept for a memory snapshot; enough for several steps of a large model.
MEMORY_HISTORY_MAX_ENTRIES = 100_000


@contextlib.contextmanager
def maybe_profile(cfg: Profiling, dump_folder: Path, rank: int) -> Iterator[torch.profiler.profile | None]:
    """A profiler whose .step() the loop calls once per step, recording one step in every profile_freq;
    None when profiling is off."""
    if not cfg.enable_profiling:
        yield None
        return
    trace_folder = dump_folder / cfg.save_traces_folder

    def save_trace(prof: torch.profiler.profile) -> None:
        step_folder = trace_folder / f"iteration_{prof.step_num}"
        step_folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(step_folder / f"rank{rank}_trace.json"))
        logger.info(f"Saved profiler trace to {step_folder}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # wait + warmup + active = profile_freq, so the active step is every profile_freq-th step.
    warmup = 1 if cfg.profile_freq > 1 else 0
    schedule = torch.profiler.schedule(wait=cfg.profile_freq - warmup - 1, warmup=warmup, active=1)
    logger.info(f"Profiling one step in every {cfg.profile_freq}; traces go to {trace_folder}")
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=save_trace) as prof:
        yield prof


class MemorySnapshotter:
    """Records CUDA allocator history and dumps it every profile_freq steps (view at pytorch.org/memory_viz)."""

    def __init__(self, cfg: Profiling, dump_folder: Path, rank: int) -> None:
        self.freq = cfg.profile_freq
        self.folder = dump_folder / cfg.save_memory_snapshot_folder
        self.rank = rank
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)

    def step(self, step: int) -> None:
        if step % self.freq != 0:
            return
        step_folder = self.folder / f"iteration_{step}"
        step_folder.mkdir(parents=True, exist_ok=True)
        with open(step_folder / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"Saved CUDA memory snapshot to {step_folder}")


def build_memory_snapshotter(cfg: Profiling, dump_folder: Path, rank: int) -> MemorySnapshotter | None:
    """A snapshotter when --profiling.enable_memory_snapshot is on (validation has checked CUDA), else None."""
    return MemorySnapshotter(cfg, dump_folder, rank) if cfg.enable_memory_snapshot else None
