"""Data loaders: this data-parallel rank's share of each global batch, for training (endless, resumable through
state_dict()) and for validation (one pass, the same every evaluation).

A global batch is the next local_batch_size x dp_degree windows of the global stream (titan/data/mixture.py), and
data-parallel rank r takes windows [r x local_batch_size, (r + 1) x local_batch_size) of it. So a run with D ranks
of batch B trains on the samples of one process with batch B x D (or with batch B and D accumulation steps), and
a checkpoint resumes on any data-parallel degree. The price: every rank tokenizes the whole stream to find its
windows, in the training loop. Packing with the shipped tokenizer runs at about 3.5M tokens/s on one CPU core, so
at T tokens/s per GPU the data takes dp_degree x T / 3.5M of each step (1.4% at dp 8 and 6k tokens/s per GPU).
"""

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from titan.config.errors import ConfigError
from titan.config.job import Training, Validation
from titan.config.mixture import MixtureEntry, parse_mixture_entry
from titan.data.dataset import START, PackedWindows, build_document_source
from titan.data.mixture import MixedWindows
from titan.data.tokenizer import Tokenizer


def rank_batch(global_batch: list[list[int]], dp_rank: int,
               local_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `dp_rank`'s (inputs, labels) of a global batch of windows of seq_len + 1 ids: its
    `local_batch_size` windows, both int64 of shape (local_batch_size, seq_len)."""
    first = dp_rank * local_batch_size
    windows = global_batch[first : first + local_batch_size]
    batch = torch.tensor(windows, dtype=torch.long)  # (local_batch_size, seq_len + 1)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class DataParallelLoader:
    """Endless (inputs, labels) batches of shape (local_batch_size, seq_len): this rank's windows of each global
    batch of `dataset`, the global stream, which every rank reads in full."""

    def __init__(self, dataset: MixedWindows, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the stream's current position; the position lives in `dataset`, so an iterator made before
        load_state_dict() continues from the loaded position."""
        while True:
            yield rank_batch(self.dataset.take(self.local_batch_size * self.dp_degree), self.dp_rank,
                             self.local_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """The global stream's position, the same on every rank and for every layout."""
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)


def training_entries(training: Training) -> list[tuple[MixtureEntry, str, str]]:
    """Each source of the training data as (entry, dataset flag, path flag), the flags for error messages."""
    if training.mixture:
        return [(parse_mixture_entry(text), "--training.mixture", "--training.mixture") for text in training.mixture]
    single = MixtureEntry(training.dataset, training.dataset_path, weight=1.0)
    return [(single, "--training.dataset", "--training.dataset_path")]


def build_dataloader(tokenizer: Tokenizer, training: Training, dp_rank: int, dp_degree: int) -> DataParallelLoader:
    """The training loader of data-parallel rank `dp_rank` of `dp_degree`: --training.dataset, or the sources of
    --training.mixture drawn with --training.seed."""
    sources = [(PackedWindows(build_document_source(entry.dataset, entry.path, dataset_flag, path_flag), tokenizer,
                              training.seq_len, entry.source), entry.weight)
               for entry, dataset_flag, path_flag in training_entries(training)]
    return DataParallelLoader(MixedWindows(sources, training.seed), training.local_batch_size, dp_rank, dp_degree)


class ValidationBatches:
    """One pass over the validation set per iteration, from its first document every time: this rank's share of
    each complete global batch, at most `max_batches` of them (-1: all). Every rank yields the same number of
    batches, so none waits in a collective for a batch another rank does not have."""

    def __init__(self, windows: PackedWindows, local_batch_size: int, max_batches: int, dp_rank: int,
                 dp_degree: int) -> None:
        self.windows = windows
        self.local_batch_size = local_batch_size
        self.seq_len = windows.seq_len
        self.max_batches = max_batches
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

    def global_batches(self) -> Iterator[list[list[int]]]:
        """The complete global batches of one pass, each a list of local_batch_size x dp_degree windows."""
        self.windows.restart_at(START)
        stream = self.windows.windows(loop=False)
        global_batch_size = self.local_batch_size * self.dp_degree
        for _ in itertools.count() if self.max_batches == -1 else range(self.max_batches):
            windows = list(itertools.islice(stream, global_batch_size))
            if len(windows) < global_batch_size:
                return
            yield windows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for windows in self.global_batches():
            yield rank_batch(windows, self.dp_rank, self.local_batch_size)


def build_validation_batches(tokenizer: Tokenizer, validation: Validation, training: Training, dp_rank: int,
                             dp_degree: int) -> ValidationBatches:
    """The validation batches of --validation.dataset (shipped: the shipped corpus's held-out documents). None for
    --validation.local_batch_size or seq_len means training's value. Raises a ConfigError if the set does not fill
    one global batch."""
    local_batch_size = validation.local_batch_size or training.local_batch_size
    seq_len = validation.seq_len or training.seq_len
    source = build_document_source(validation.dataset, validation.dataset_path, "--validation.dataset",
                                   "--validation.dataset_path", held_out=True)
    batches = ValidationBatches(PackedWindows(source, tokenizer, seq_len, source.origin), local_batch_size,
                                validation.steps, dp_rank, dp_degree)
    check_one_global_batch(batches, validation, source.origin)
    return batches


def check_one_global_batch(batches: ValidationBatches, validation: Validation, origin: str) -> None:
    """A validation set must fill one global batch, or every evaluation would average over nothing."""
    global_batch_size = batches.local_batch_size * batches.dp_degree
    batches.windows.restart_at(START)
    num_windows = sum(1 for _ in itertools.islice(batches.windows.windows(loop=False), global_batch_size))
    if num_windows == global_batch_size:
        return
    # None fields took training's values: name the flag the value came from.
    section = "validation" if validation.local_batch_size else "training"
    batch_flag = f"--{section}.local_batch_size {batches.local_batch_size}"
    seq_len_flag = f"--{'validation' if validation.seq_len else 'training'}.seq_len {batches.seq_len}"
    fix = (f"Try --validation.local_batch_size {num_windows // batches.dp_degree}, lower --validation.seq_len"
           if num_windows >= batches.dp_degree else "Lower --validation.seq_len")
    raise ConfigError(f"{origin} gives {num_windows} window(s) of {seq_len_flag} + 1 tokens, fewer than one global "
                      f"batch of {batch_flag} x data-parallel degree {batches.dp_degree} = {global_batch_size}. "
                      f"{fix}, or use a larger validation set (--validation.dataset_path).")
