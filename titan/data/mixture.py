"""The global window stream: the packed windows of one or several weighted sources, in one order for the whole job.

Window i of the stream comes from one source, drawn by weight as a pure function of (--training.seed, i): the i-th
output of splitmix64 seeded with the seed, as a fraction in [0, 1), picks the source whose share of the cumulative
weights it falls in. Each source has its own packer over its own documents, which starts a new epoch when it runs
out. --training.dataset alone is a stream of one source, so both follow the same code.

The state is the index of the next window, every source's position and the tokens drawn from each source: the same
on every rank and independent of the layout, so a resumed run (on any data-parallel degree) continues exactly.
"""

import bisect
import itertools
from typing import Any

from titan.config.errors import ConfigError
from titan.data.dataset import PackedWindows, Position

MASK64 = (1 << 64) - 1


def splitmix64(seed: int, index: int) -> int:
    """The `index`-th output (from 0) of Steele, Lea and Flood's SplitMix64 generator seeded with `seed`: a counter
    hash, so any draw is computed without the ones before it."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class MixedWindows:
    """Windows of seq_len + 1 token ids from `sources` (each with its weight), drawn by `seed`."""

    def __init__(self, sources: list[tuple[PackedWindows, float]], seed: int) -> None:
        self.sources = [source for source, _ in sources]
        total = sum(weight for _, weight in sources)
        # Upper bounds of each source's share of [0, 1); the last is 1 exactly, whatever the rounding.
        self.bounds = [bound / total for bound in itertools.accumulate(weight for _, weight in sources)][:-1] + [1.0]
        self.seed = seed
        self.seq_len = sources[0][0].seq_len
        self.window_index = 0
        self.tokens = {source.name: 0 for source in self.sources}

    def source_of(self, window_index: int) -> PackedWindows:
        """The source that window `window_index` of the stream is drawn from."""
        if len(self.sources) == 1:
            return self.sources[0]
        fraction = (splitmix64(self.seed, window_index) >> 11) / 2**53  # 53 random bits: exact in a float
        return self.sources[bisect.bisect_right(self.bounds, fraction)]

    def take(self, count: int) -> list[list[int]]:
        """The next `count` windows of the stream."""
        windows = []
        for _ in range(count):
            source = self.source_of(self.window_index)
            windows.append(source.next_window())
            self.window_index += 1
            self.tokens[source.name] += self.seq_len
        return windows

    def position(self) -> dict[str, Any]:
        """Where the next window starts, as plain JSON-able values (for anomaly records): its index in the stream,
        its source, and the epoch, document and token offset in that source."""
        source = self.source_of(self.window_index)
        return {"window_index": self.window_index, "source": source.name, **source.position._asdict()}

    def tokens_per_source(self) -> dict[str, int]:
        """Input tokens drawn from each source since the run's first step, over all data-parallel ranks (restored on
        resume)."""
        return dict(self.tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"window_index": self.window_index, "tokens": dict(self.tokens),
                "sources": {source.name: source.position._asdict() for source in self.sources}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        positions, tokens = state_dict["sources"], state_dict["tokens"]
        if len(positions) == len(self.sources) == 1:
            # One source under another name (the data moved to a new path): its position is still the only one.
            name = self.sources[0].name
            positions, tokens = {name: next(iter(positions.values()))}, {name: next(iter(tokens.values()))}
        if sorted(positions) != sorted(self.tokens):
            raise ConfigError(f"The checkpoint's data position is for the source(s) {', '.join(sorted(positions))}, "
                              f"but this run reads {', '.join(sorted(self.tokens))}. Resume with the data it was saved "
                              f"with, or add --checkpoint.exclude_from_loading dataloader to start this data from "
                              f"its beginning.")
        self.window_index = state_dict["window_index"]
        self.tokens = dict(tokens)
        for source in self.sources:
            source.restart_at(Position(**positions[source.name]))
