"""The global window stream: windows of seq_len + 1 token ids drawn from one or several token stores, in one order
for the whole job, that any rank can index into without reading the windows before it.

One source (titan/data/store.py) is cut into windows of seq_len + 1 tokens that do not overlap: window j is
tokens[j * (seq_len + 1) : (j + 1) * (seq_len + 1)], so documents are packed back to back as they were stored and a
window may hold the end of one and the start of the next. The last num_tokens % (seq_len + 1) tokens of a source
are in no window. An epoch visits every window once: in store order with --training.shuffle off, else in a
permutation drawn from (--training.seed, the epoch, the store's content hash), a different one each epoch. The
permutation is a keyed bijection computed per index (a 4-round Feistel network on the bits of the window index,
cycle-walked into range), so finding the n-th window of a source is a constant-time computation at any epoch.

Window i of the stream comes from one source, drawn by weight as a pure function of (--training.seed, i): the i-th
output of splitmix64 seeded with the seed, as a fraction in [0, 1), picks the source whose share of the cumulative
weights it falls in. --training.dataset alone is a stream of one source.

The state is the index of the next window and the number of windows drawn from each source so far (with each
store's content hash and the sequence length, to check a resume against): plain values, the same on every rank and
independent of the layout, so a resumed run on any data-parallel degree continues exactly.
"""

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from titan.config.errors import ConfigError
from titan.data.store import TokenStore
from titan.metrics.log import logger

MASK64 = (1 << 64) - 1
STATE_VERSION = 2
"""Version 1 was the position of an on-the-fly packer (an epoch, document and token offset per source); it cannot
be mapped onto a store's windows."""
EXCLUDE_DATA = ("add --checkpoint.exclude_from_loading dataloader to keep the model and optimizer and start the data "
                "from its beginning")


def splitmix64(seed: int, index: int) -> int:
    """The `index`-th output (from 0) of Steele, Lea and Flood's SplitMix64 generator seeded with `seed`: a counter
    hash, so any draw is computed without the ones before it."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64_array(seed: int, indices: np.ndarray) -> np.ndarray:
    """splitmix64(seed, i) for every i of `indices` at once (uint64 arithmetic wraps modulo 2**64, as the
    generator's does)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed & MASK64) + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


FEISTEL_ROUNDS = 4


def permuted_index(index: int, size: int, key: int) -> int:
    """Position `index` of a keyed pseudo-random permutation of range(size). A Feistel network permutes the
    2**(2h) values of two h-bit halves (2**(2h) is at most 4 x size); values that land outside range(size) are
    permuted again until one lands inside (cycle walking), which keeps it a permutation of range(size)."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    value = index
    while True:
        left, right = value >> half, value & mask
        for round_index in range(FEISTEL_ROUNDS):
            left, right = right, left ^ (splitmix64(key, (round_index << half) | right) & mask)
        value = (left << half) | right
        if value < size:
            return value


@dataclass(frozen=True)
class Windows:
    """Windows of seq_len + 1 tokens (rows), and for each token whether it is a target that trains (its prediction
    from the tokens before it carries the loss) and whether it is the last token of its document."""

    tokens: np.ndarray
    """int64 (rows, seq_len + 1)."""
    trains: np.ndarray
    """bool, the same shape: every token of a document; an assistant's tokens of a conversation (--chat.train_on)."""
    ends: np.ndarray
    """bool, the same shape."""

    @staticmethod
    def stack(rows: list["Windows"]) -> "Windows":
        """Single windows (1-D arrays), one per row."""
        return Windows(np.stack([row.tokens for row in rows]), np.stack([row.trains for row in rows]),
                       np.stack([row.ends for row in rows]))


@dataclass
class SourceWindows:
    """One source's windows, epoch after epoch: a store of documents cut into windows back to back."""

    store: TokenStore
    seq_len: int
    name: str
    """The source's name in logs and checkpoints ("shipped", "jsonl:data/code.jsonl")."""
    origin: str
    """The flag and value it comes from, for error messages."""
    seed: int
    shuffle: bool
    seq_len_flag: str = "--training.seq_len"

    def __post_init__(self) -> None:
        self.window_len = self.seq_len + 1
        if self.store.meta["num_documents"] == 0:
            raise ConfigError(f"{self.origin} has no documents with text. Point it at non-empty data.")
        self.per_epoch = self.count_windows()
        if self.per_epoch == 0:
            raise ConfigError(f"{self.origin} has only {self.store.num_tokens} tokens per epoch, but one sequence "
                              f"needs {self.seq_len_flag} {self.seq_len} + 1 = {self.window_len}. Lower "
                              f"{self.seq_len_flag} or add more data.")
        self._content_key = int(self.store.content_hash[:16], 16)

    def count_windows(self) -> int:
        return self.store.num_tokens // self.window_len

    def window_at(self, drawn: int) -> tuple[int, int]:
        """(epoch, index in the store) of the window this source gives after `drawn` windows."""
        epoch, step = divmod(drawn, self.per_epoch)
        if not self.shuffle:
            return epoch, step
        return epoch, permuted_index(step, self.per_epoch, splitmix64(self.seed ^ self._content_key, epoch))

    def window(self, drawn: int) -> Windows:
        """The window this source gives after `drawn` windows (1-D arrays)."""
        _, index = self.window_at(drawn)
        return self.read_window(index)

    def read_window(self, index: int) -> Windows:
        """Window `index` of the store: tokens [index x window_len, (index + 1) x window_len), all targets."""
        start = index * self.window_len
        tokens = self.store.tokens[start : start + self.window_len].astype(np.int64)
        return Windows(tokens, np.ones(self.window_len, dtype=bool), document_ends(self.store.documents, start,
                                                                                   self.window_len))


def document_ends(documents: np.ndarray, start: int, length: int) -> np.ndarray:
    """Which of the tokens [start, start + length) of a store end their document (`documents`: its offsets)."""
    ends = np.zeros(length, dtype=bool)
    # Offsets start + 1 ... start + length: token offset - 1 ends a document.
    first = np.searchsorted(documents, start + 1, side="left")
    last = np.searchsorted(documents, start + length, side="right")
    ends[documents[first:last] - start - 1] = True
    return ends


class WindowStream:
    """Windows from `sources` (each with its weight), drawn by `seed`."""

    def __init__(self, sources: list[tuple[SourceWindows, float]], seed: int) -> None:
        self.sources = [source for source, _ in sources]
        total = sum(weight for _, weight in sources)
        # Upper bounds of each source's share of [0, 1); the last is 1 exactly, whatever the rounding.
        self.bounds = [bound / total for bound in itertools.accumulate(weight for _, weight in sources)][:-1] + [1.0]
        self.seed = seed
        self.seq_len = self.sources[0].seq_len
        self.window_index = 0
        self.drawn = [0] * len(self.sources)

    def source_ids(self, first: int, count: int) -> np.ndarray:
        """The source index of windows first, ..., first + count - 1 of the stream."""
        if len(self.sources) == 1:
            return np.zeros(count, dtype=np.int64)
        draws = splitmix64_array(self.seed, np.arange(first, first + count, dtype=np.uint64))
        fractions = (draws >> np.uint64(11)).astype(np.float64) / 2.0**53  # 53 random bits: exact in a float
        return np.searchsorted(np.asarray(self.bounds), fractions, side="right")

    def source_of(self, window_index: int) -> SourceWindows:
        """The source that window `window_index` of the stream is drawn from."""
        return self.sources[int(self.source_ids(window_index, 1)[0])]

    def take(self, count: int, first: int = 0, length: int | None = None) -> Windows:
        """Windows [first, first + length) of the next `count` windows of the stream (default: all of them), as
        `length` rows; the stream then moves past all `count`. Reads only the windows returned: a data-parallel
        rank's share of a global batch costs the same at any degree."""
        length = count - first if length is None else length
        num_sources = len(self.sources)
        if num_sources == 1:
            ids = None
            drawn = [self.drawn[0] + first]  # windows of the source before this rank's first
            taken = [count]
        else:
            ids = self.source_ids(self.window_index, count)
            drawn = [d + int(b) for d, b in zip(self.drawn, np.bincount(ids[:first], minlength=num_sources))]
            taken = np.bincount(ids, minlength=num_sources).tolist()
        rows = []
        for row in range(length):
            source = 0 if ids is None else int(ids[first + row])
            rows.append(self.sources[source].window(drawn[source]))
            drawn[source] += 1
        for index, source in enumerate(self.sources):
            self.log_epochs(source, self.drawn[index], taken[index])
            self.drawn[index] += taken[index]
        self.window_index += count
        return Windows.stack(rows)

    @staticmethod
    def log_epochs(source: SourceWindows, drawn: int, taken: int) -> None:
        """Say which epochs of `source` start among its windows drawn..drawn + taken - 1: one line per batch, however
        many epochs a batch spans (a small source at a large data-parallel degree)."""
        first, end = -(-drawn // source.per_epoch), -(-(drawn + taken) // source.per_epoch)
        if end - first == 1:
            logger.info(f"Data: source {source.name} starts epoch {first}")
        elif end - first > 1:
            logger.info(f"Data: source {source.name} starts epochs {first} to {end - 1} in one batch")

    def counters(self, state: dict[str, Any] | None) -> tuple[int, list[int]]:
        """(next window index, windows drawn per source) of `state` (a state_dict()), or of now for None."""
        if state is None:
            return self.window_index, self.drawn
        return state["window_index"], [state["drawn"][source.name] for source in self.sources]

    def position(self, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Where the next window comes from (after `state`, default now), as plain JSON-able values for anomaly
        records: its index in the stream, its source, and the epoch and window index in that source's store."""
        window_index, drawn = self.counters(state)
        index = int(self.source_ids(window_index, 1)[0])
        epoch, window = self.sources[index].window_at(drawn[index])
        return {"window_index": window_index, "source": self.sources[index].name, "epoch": epoch, "window": window}

    def tokens_per_source(self, state: dict[str, Any] | None = None) -> dict[str, int]:
        """Input tokens drawn from each source since the run's first step (up to `state`, default now), over all
        data-parallel ranks."""
        _, drawn = self.counters(state)
        return {source.name: count * self.seq_len for source, count in zip(self.sources, drawn)}

    def copy(self) -> "WindowStream":
        """A stream over the same sources with counters of its own, from this one's position."""
        other = copy.copy(self)
        other.drawn = list(self.drawn)
        return other

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "window_index": self.window_index,
                "drawn": {source.name: drawn for source, drawn in zip(self.sources, self.drawn)},
                "content": {source.name: source.store.content_hash for source in self.sources},
                "seq_len": self.seq_len}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position. Raises a ConfigError when the saved position cannot continue on this
        data: another format, other sources, other contents or another sequence length."""
        if state_dict.get("version") != STATE_VERSION:
            raise ConfigError(f"The checkpoint's data position was saved by an earlier Titan, which tokenized and "
                              f"packed on the fly; token stores cannot continue it exactly. To resume anyway, "
                              f"{EXCLUDE_DATA}.")
        drawn, content = state_dict["drawn"], state_dict["content"]
        names = [source.name for source in self.sources]
        if len(drawn) == len(self.sources) == 1:
            # One source under another name (the data moved to a new path): its position is still the only one.
            drawn, content = {names[0]: next(iter(drawn.values()))}, {names[0]: next(iter(content.values()))}
        if sorted(drawn) != sorted(names):
            raise ConfigError(f"The checkpoint's data position is for the source(s) {', '.join(sorted(drawn))}, but "
                              f"this run reads {', '.join(sorted(names))}. Resume with the data it was saved with, or "
                              f"{EXCLUDE_DATA}.")
        changed = [source.name for source in self.sources if content[source.name] != source.store.content_hash]
        if changed:
            raise ConfigError(f"The data of {', '.join(changed)} changed since the checkpoint was saved (its tokens' "
                              f"content hash differs: other files, another split or another tokenizer). Resume with "
                              f"the data it was saved with, or {EXCLUDE_DATA}.")
        if state_dict["seq_len"] != self.seq_len:
            raise ConfigError(f"The checkpoint's data position counts windows of --training.seq_len "
                              f"{state_dict['seq_len']}, this run's are {self.seq_len}. Resume with the same "
                              f"--training.seq_len, or {EXCLUDE_DATA}.")
        self.window_index = state_dict["window_index"]
        self.drawn = [drawn[name] for name in names]
