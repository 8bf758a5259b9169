"""The data side of a dry run: what one training step's batches cost the simulated rank's loader, measured on the
read path it would run (titan/data/loader.py RankBatches), next to the step time the roofline predicts.

Measured on the job's own token stores when they are on this machine (made already: a dry run tokenizes nothing),
else on a sample store of random tokens of the job's sequence length, which times the same code on data in memory.
"""

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan.config.errors import ConfigError
from titan.config.job import Chat, Training
from titan.config.paths import resolve_path
from titan.data.loader import PREFETCH_BATCHES, RankBatches, build_stream
from titan.data.store import TokenStore
from titan.data.stream import SourceWindows, WindowStream
from titan.data.tokenizer import build_tokenizer

TIMED_STEPS = 10


@dataclass(frozen=True)
class DataCost:
    seconds_per_step: float
    """The loader's work for one step of this rank: its micro-batches of every accumulation step."""
    measured_on: str
    """The job's stores, or why a sample stood in for them."""
    micro_batches: int
    local_batch_size: int
    seq_len: int

    def keeps_up(self, step_s: float) -> bool:
        """Whether prefetching in the background hides the data: it needs less time per step than the step."""
        return self.seconds_per_step < step_s


def sample_stream(training: Training, num_windows: int) -> WindowStream:
    """A stream over an in-memory store of `num_windows` windows of random token ids."""
    window_len = training.seq_len + 1
    tokens = np.random.default_rng(0).integers(0, 2**16, size=num_windows * window_len, dtype=np.uint32)
    store = TokenStore(Path("<sample>"), tokens, np.array([0, len(tokens)], dtype=np.int64),
                       {"num_documents": 1, "content_hash": "0" * 64})
    windows = SourceWindows(store, training.seq_len, "sample", "sample", training.seed, training.shuffle)
    return WindowStream([(windows, 1.0)], training.seed)


def job_stream(training: Training, chat: Chat, tokenizer_path: str) -> tuple[WindowStream | None, str]:
    """The job's own stream when its tokenizer and every store are here, else None and why not."""
    if not resolve_path(tokenizer_path).is_file():
        return None, "a sample store: the tokenizer is not on this machine"
    try:
        stream = build_stream(build_tokenizer(tokenizer_path), training, chat, prepare=False)
    except ConfigError as err:  # a store or source missing here, or made for other data
        return None, f"a sample store: the job's data is not usable here ({str(err)[:120]}...)"
    if stream is None:
        return None, "a sample store: the job's data is not tokenized on this machine yet"
    return stream, "the job's token stores"


def measure_data_cost(training: Training, tokenizer_path: str, dp_rank: int, dp_degree: int,
                      micro_batches: int, chat: Chat = Chat()) -> DataCost:
    """The median time of TIMED_STEPS steps' batches of data-parallel rank `dp_rank` of `dp_degree`, after one
    untimed step."""
    stream, measured_on = job_stream(training, chat, tokenizer_path)
    if stream is None:
        stream = sample_stream(training, 4 * training.local_batch_size * dp_degree)
    batches = RankBatches(stream, training.local_batch_size, dp_rank, dp_degree)
    times = []
    for step in range(TIMED_STEPS + 1):
        start = time.perf_counter()
        for _ in range(micro_batches):
            batches.next()
        if step:
            times.append(time.perf_counter() - start)
    return DataCost(statistics.median(times), measured_on, micro_batches, training.local_batch_size, training.seq_len)


def data_report_lines(cost: DataCost, step_s: float) -> list[str]:
    keeps_up = "keeps up" if cost.keeps_up(step_s) else "does NOT keep up: batches would arrive slower than steps"
    return [
        f"Data per step on this rank ({cost.micro_batches} x {cost.local_batch_size} x {cost.seq_len} tokens, "
        f"measured on {cost.measured_on}):",
        f"  {1e3 * cost.seconds_per_step:.3f} ms in the loader's background thread ({PREFETCH_BATCHES} batches "
        f"prefetched), {100 * cost.seconds_per_step / step_s:.3f}% of the {step_s:.3f} s step: {keeps_up}",
    ]
