"""Conversations packed whole into windows: a chat store's windows (titan/data/conversations.py).

A document store is cut into windows back to back (titan/data/stream.py), so a document may start in one window and
end in the next: harmless for pretraining, wrong for a conversation, whose answers would then train without the
question before them. So a chat store's conversations are packed whole, in store order: each window takes the next
conversations while they fit in seq_len + 1 tokens, and the rest of it is padding (id 0: a document of its own that
never trains). A conversation longer than a window is truncated to one window of its own; one whose kept part has no
token that trains under --chat.train_on is dropped. Both are counted, and logged once when the source opens.

Which tokens train follows from the store's roles under --chat.train_on (titan/data/micro_batch.py trained_tokens),
for the packing's counts as for each window's targets. The packing is computed from the store's document offsets when
the source opens (once per process, a pass over the conversations), so it is the same on every rank and for every
layout; shuffling, mixtures and resume then work on its windows as on a document store's.
"""

from dataclasses import dataclass

import numpy as np

from titan.config.errors import ConfigError
from titan.data.micro_batch import trained_tokens
from titan.data.store import TokenStore
from titan.data.stream import SourceWindows, Windows
from titan.metrics.log import logger

PAD_ID = 0
"""The token that fills a window after its last conversation. Its value is never read: padding is a document of its
own (no conversation attends to it) and never a target."""


@dataclass
class ConversationWindows(SourceWindows):
    """A chat store's windows: its conversations packed whole (module docstring)."""

    train_on: str = "assistant"

    def count_windows(self) -> int:
        self.pack()
        return len(self.bounds) - 1

    def pack(self) -> None:
        """Lay the conversations out into windows: self.kept holds the conversations kept, in order, and window w
        holds kept[bounds[w]:bounds[w + 1]]. Logs what the packing kept and how many of its targets train."""
        documents = self.store.documents
        lengths = np.diff(documents)
        trains = trained_tokens(self.store.roles, self.train_on)
        # A conversation's first token is never a target: it starts a window or follows another conversation's end.
        num_targets = int(trains.sum()) - int(trains[documents[:-1]].sum())
        truncated = np.flatnonzero(lengths > self.window_len)
        keep = np.ones(len(lengths), dtype=bool)
        for conversation in truncated:
            start, end = int(documents[conversation]), int(documents[conversation + 1])
            kept_targets = int(trains[start + 1 : start + self.window_len].sum())
            keep[conversation] = kept_targets > 0
            num_targets -= int(trains[start + 1 : end].sum()) - kept_targets
        self.kept = np.flatnonzero(keep)
        if len(self.kept) == 0:
            # The first target that trains, in the conversation that reaches one soonest: a window must hold it.
            first_trained = min((int(trained[0]) + 1 for c in truncated
                                 if len(trained := np.flatnonzero(trains[documents[c] + 1 : documents[c + 1]]))),
                                default=self.seq_len)
            raise ConfigError(f"{self.origin}: every conversation is longer than {self.seq_len_flag} {self.seq_len} "
                              f"+ 1 tokens and has nothing to train on in its first window under --chat.train_on "
                              f"{self.train_on}, so all {len(lengths):,} would be dropped and the run would train on "
                              f"padding. Raise {self.seq_len_flag}: the soonest trained token of any conversation is "
                              f"its token {first_trained}, so try {self.seq_len_flag} "
                              f"{-(-first_trained // 64) * 64} or more.")
        bounds = [0]
        fill = 0
        for position, length in enumerate(np.minimum(lengths[self.kept], self.window_len).tolist()):
            if fill + length > self.window_len:
                bounds.append(position)
                fill = 0
            fill += length
        bounds.append(len(self.kept))
        self.bounds = np.asarray(bounds, dtype=np.int64)
        num_windows = len(bounds) - 1
        logger.info(f"Data: {self.origin} packs {len(self.kept):,} conversation(s) into {num_windows:,} window(s) of "
                    f"{self.seq_len_flag} {self.seq_len} + 1 tokens: {len(truncated):,} truncated to one window, "
                    f"{len(lengths) - len(self.kept):,} dropped for length (nothing left to train on under "
                    f"--chat.train_on {self.train_on}); {num_targets / (num_windows * self.seq_len):.1%} of the "
                    f"targets train")

    def read_window(self, index: int) -> Windows:
        """Window `index`: its conversations back to back, then padding."""
        tokens = np.full(self.window_len, PAD_ID, dtype=np.int64)
        trains = np.zeros(self.window_len, dtype=bool)
        ends = np.zeros(self.window_len, dtype=bool)
        position = 0
        for conversation in self.kept[self.bounds[index] : self.bounds[index + 1]]:
            start = int(self.store.documents[conversation])
            length = min(int(self.store.documents[conversation + 1]) - start, self.window_len)
            tokens[position : position + length] = self.store.tokens[start : start + length]
            trains[position : position + length] = trained_tokens(self.store.roles[start : start + length],
                                                                  self.train_on)
            ends[position + length - 1] = True
            position += length
        return Windows(tokens, trains, ends)


def build_source_windows(store: TokenStore, seq_len: int, name: str, origin: str, seed: int, shuffle: bool,
                         train_on: str, seq_len_flag: str = "--training.seq_len") -> SourceWindows:
    """A store's windows: conversations packed whole for a chat store, documents back to back otherwise."""
    if store.roles is None:
        return SourceWindows(store, seq_len, name, origin, seed, shuffle, seq_len_flag)
    return ConversationWindows(store, seq_len, name, origin, seed, shuffle, seq_len_flag, train_on)
