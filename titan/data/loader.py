"""Data loaders: this data-parallel rank's share of each global batch, for training (endless, prefetched, resumable
through state_dict()) and for validation (one pass, the same every evaluation).

A global batch is the next local_batch_size x dp_degree windows of the global stream (titan/data/stream.py), and
data-parallel rank r takes windows [r x local_batch_size, (r + 1) x local_batch_size) of it. So a run with D ranks
of batch B trains on the samples of one process with batch B x D (or with batch B and D accumulation steps), and
a checkpoint resumes on any data-parallel degree. Each rank reads only its own windows from the memory-mapped token
stores, so its data cost per step does not grow with the data-parallel degree.

Training batches come through a torchdata.nodes pipeline: a background thread prepares the next batches (and pins
them on CUDA) while the current step runs. Each batch carries the stream's state after it, and the loader's state
is that of the last batch handed to the trainer: batches prefetched but not trained on are trained on after a
resume.
"""

from collections.abc import Iterator
from typing import Any

import torch
from torchdata.nodes import BaseNode, PinMemory, Prefetcher

from titan.config.errors import ConfigError
from titan.config.job import Chat, Training, Validation
from titan.config.mixture import MixtureEntry, parse_mixture_entry
from titan.config.paths import resolve_path
from titan.data.cache import cache_dir, cached_store
from titan.data.chat_template import load_chat_template
from titan.data.conversations import ConversationEncoder, ConversationSource, check_roles_method
from titan.data.dataset import build_document_source, hub_dataset_problem
from titan.data.micro_batch import Batch, as_batch
from titan.data.packing import build_source_windows
from titan.data.store import StoreSource, TokenStore, open_store, source_changes
from titan.data.stream import SourceWindows, Windows, WindowStream
from titan.data.tokenizer import Tokenizer

PREFETCH_BATCHES = 2
"""Batches prepared ahead of the step that trains on them."""

def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` on `device`, copied without waiting where it is in pinned memory."""
    inputs, labels, document_ends = batch
    return (inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True),
            document_ends.to(device, non_blocking=True))


class RankBatches(BaseNode):
    """torchdata node: this rank's batches (inputs, labels, document ends) of consecutive global batches, each with
    the stream's state after it."""

    def __init__(self, stream: WindowStream, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        super().__init__()
        self.stream = stream
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Start from `initial_state`; None keeps the stream where it is (the loader sets it before a new pass)."""
        super().reset(initial_state)
        if initial_state is not None:
            self.stream.load_state_dict(initial_state)

    def next(self) -> tuple[Batch, dict[str, Any]]:
        windows = self.stream.take(self.local_batch_size * self.dp_degree, self.dp_rank * self.local_batch_size,
                                   self.local_batch_size)
        return as_batch(windows), self.stream.state_dict()

    def get_state(self) -> dict[str, Any]:
        return self.stream.state_dict()


class DataParallelLoader:
    """Endless batches of shape (local_batch_size, seq_len): this rank's windows of each global batch of `stream`,
    PREFETCH_BATCHES ahead in a background thread and, with `pin_memory`, in pinned memory."""

    def __init__(self, stream: WindowStream, local_batch_size: int, dp_rank: int, dp_degree: int,
                 pin_memory: bool = False) -> None:
        self.stream = stream
        """At the loaded position; each iterator advances a copy of its own."""
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.pin_memory = pin_memory
        self._consumed = stream.state_dict()
        self.prefetching: WindowStream | None = None
        """The latest iterator's stream, which its background thread advances ahead of the batches handed out."""
        self._iterator: Iterator[Batch] | None = None

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the last one handed out (or the loaded state) on. A new iterator starts after the last batch
        any iterator handed out, and stops the previous iterator's thread (close)."""
        self.close()
        stream = self.stream.copy()
        stream.load_state_dict(self._consumed)
        self.prefetching = stream
        node: BaseNode = RankBatches(stream, self.local_batch_size, self.dp_rank, self.dp_degree)
        if self.pin_memory:
            node = PinMemory(node)
        self._iterator = self._batches(Prefetcher(node, prefetch_factor=PREFETCH_BATCHES))
        return self._iterator

    def _batches(self, prefetcher: Prefetcher) -> Iterator[Batch]:
        # The node itself, not a torchdata Loader around it: a Loader and its iterator refer to each other, so only
        # the garbage collector would free them, and with them the thread. The states travel with the batches.
        prefetcher.reset()
        for batch, state in prefetcher:
            self._consumed = state
            yield batch

    def close(self) -> None:
        """Stop the latest iterator's background thread: closing the generator drops the last reference to its
        Prefetcher, whose finalizer joins the thread. Without it the thread lives on, idle, in a process that goes
        on after training (tests, notebooks)."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: the same on every rank and for every layout."""
        return dict(self._consumed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from `state_dict` at the next iter(). Raises a ConfigError if it does not fit this data."""
        self.stream.load_state_dict(state_dict)  # checks it now, in the caller's thread
        self._consumed = self.stream.state_dict()

    def position(self) -> dict[str, Any]:
        """Where the next batch to hand out starts (for anomaly records); see WindowStream.position."""
        return self.stream.position(self._consumed)

    def tokens_per_source(self) -> dict[str, int]:
        """Input tokens handed out from each source since the run's first step, over all data-parallel ranks."""
        return self.stream.tokens_per_source(self._consumed)


def training_entries(training: Training) -> list[tuple[MixtureEntry, str, str]]:
    """Each source of the training data as (entry, dataset flag, path flag), the flags for error messages."""
    if training.mixture:
        return [(parse_mixture_entry(text), "--training.mixture", "--training.mixture") for text in training.mixture]
    single = MixtureEntry(training.dataset, training.dataset_path, weight=1.0)
    return [(single, "--training.dataset", "--training.dataset_path")]


def source_store(dataset: str, dataset_path: str | None, tokenizer: Tokenizer, cache: str, dataset_flag: str,
                 path_flag: str, chat: Chat, held_out: bool = False, prepare: bool = True
                 ) -> tuple[TokenStore | None, str]:
    """The token store of a source and the flag and value it comes from (for error messages): a prepared store as
    it is, any other source's from the cache, tokenized on first use (with `prepare`; else None when it is not
    there yet). Conversations (chat) are rendered by the template of `chat`."""
    if dataset == "prepared":
        assert dataset_path is not None, "titan/data/rules.py requires a dataset path here"
        store = open_store(resolve_path(dataset_path), tokenizer)
        check_roles_method(store)
        changed = source_changes(store.meta)
        if changed:
            raise ConfigError(f"Token store {store.path}: its source changed since it was prepared "
                              f"({', '.join(changed)}). Prepare it again with `python -m titan.data.prepare`, or "
                              f"restore the source.")
        return store, f"{path_flag} {dataset_path!r}"
    if dataset == "hf" and not resolve_path(str(dataset_path)).is_dir():
        raise ConfigError(hub_dataset_problem(dataset_flag, path_flag, str(dataset_path)))
    source: StoreSource
    if dataset == "chat":
        assert dataset_path is not None, "titan/data/rules.py requires a dataset path here"
        source = build_conversation_source(dataset_path, path_flag, tokenizer, chat)
    else:
        source = build_document_source(dataset, dataset_path, dataset_flag, path_flag, held_out=held_out)
    return cached_store(source, tokenizer, cache_dir(cache), prepare), source.origin


def build_conversation_source(dataset_path: str, path_flag: str, tokenizer: Tokenizer, chat: Chat
                              ) -> ConversationSource:
    """The conversations at `dataset_path`, rendered by --chat.template_path's template (or the tokenizer's)."""
    encoder = ConversationEncoder(load_chat_template(chat.template_path, tokenizer), tokenizer, chat.messages_field)
    return ConversationSource(dataset_path, path_flag, encoder)


def build_stream(tokenizer: Tokenizer, training: Training, chat: Chat = Chat(), prepare: bool = True
                 ) -> WindowStream | None:
    """The global window stream of --training.dataset, or of the sources of --training.mixture drawn with
    --training.seed. Without `prepare`, None when a source's store is not made yet."""
    sources = []
    for entry, dataset_flag, path_flag in training_entries(training):
        store, origin = source_store(entry.dataset, entry.path, tokenizer, training.dataset_cache_dir, dataset_flag,
                                     path_flag, chat, prepare=prepare)
        if store is None:
            return None
        sources.append((build_source_windows(store, training.seq_len, entry.source, origin, training.seed,
                                             training.shuffle, chat.train_on), entry.weight))
    return WindowStream(sources, training.seed)


def build_dataloader(tokenizer: Tokenizer, training: Training, dp_rank: int, dp_degree: int,
                     pin_memory: bool = False, chat: Chat = Chat()) -> DataParallelLoader:
    """The training loader of data-parallel rank `dp_rank` of `dp_degree`."""
    stream = build_stream(tokenizer, training, chat)
    assert stream is not None, "build_stream prepares every store it needs"
    return DataParallelLoader(stream, training.local_batch_size, dp_rank, dp_degree, pin_memory)


class ValidationBatches:
    """One pass over the validation set per iteration, from its first window every time, in store order: this
    rank's share of each complete global batch, at most `max_batches` of them (-1: all). Every rank yields the same
    number of batches, so none waits in a collective for a batch another rank does not have."""

    def __init__(self, windows: SourceWindows, local_batch_size: int, max_batches: int, dp_rank: int,
                 dp_degree: int) -> None:
        self.windows = windows
        self.local_batch_size = local_batch_size
        self.seq_len = windows.seq_len
        self.max_batches = max_batches
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

    def num_batches(self) -> int:
        complete = self.windows.per_epoch // (self.local_batch_size * self.dp_degree)
        return complete if self.max_batches == -1 else min(complete, self.max_batches)

    def __iter__(self) -> Iterator[Batch]:
        global_batch_size = self.local_batch_size * self.dp_degree
        for batch in range(self.num_batches()):
            first = batch * global_batch_size + self.dp_rank * self.local_batch_size
            yield as_batch(Windows.stack([self.windows.window(first + row) for row in range(self.local_batch_size)]))


def build_validation_batches(tokenizer: Tokenizer, validation: Validation, training: Training, dp_rank: int,
                             dp_degree: int, chat: Chat = Chat()) -> ValidationBatches:
    """The validation batches of --validation.dataset (shipped: the shipped corpus's held-out documents). None for
    --validation.local_batch_size or seq_len means training's value. Raises a ConfigError if the set does not fill
    one global batch."""
    local_batch_size = validation.local_batch_size or training.local_batch_size
    seq_len = validation.seq_len or training.seq_len
    store, origin = source_store(validation.dataset, validation.dataset_path, tokenizer, training.dataset_cache_dir,
                                 "--validation.dataset", "--validation.dataset_path", chat, held_out=True)
    seq_len_flag = "--validation.seq_len" if validation.seq_len else "--training.seq_len"
    windows = build_source_windows(store, seq_len, origin, origin, training.seed, False, chat.train_on, seq_len_flag)
    batches = ValidationBatches(windows, local_batch_size, validation.steps, dp_rank, dp_degree)
    check_one_global_batch(batches, validation, origin)
    return batches


def check_one_global_batch(batches: ValidationBatches, validation: Validation, origin: str) -> None:
    """A validation set must fill one global batch, or every evaluation would average over nothing."""
    global_batch_size = batches.local_batch_size * batches.dp_degree
    num_windows = batches.windows.per_epoch
    if num_windows >= global_batch_size:
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
