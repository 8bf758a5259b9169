"""Train a byte-level BPE tokenizer (Llama 3 pre-tokenization) and write it in tiktoken format: offline tooling
for scripts/train_tokenizer.py, kept out of the titan package that training imports.

Text is split by LLAMA3_SPLIT_PATTERN and each distinct chunk is counted once, so the merge loop runs over the
table of unique chunks, not the corpus. Pair counts are kept up to date incrementally: a merge only revisits
the chunks that contain the merged pair. Ranks 0..255 are the single bytes; rank 256 + k is the k-th merge.
"""

import base64
import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from titan.config.errors import ConfigError
from titan.data.tokenizer import LLAMA3_SPLIT_PATTERN

Pair = tuple[int, int]

_SPLIT = regex.compile(LLAMA3_SPLIT_PATTERN)


def count_chunks(texts: Iterable[str]) -> Counter[bytes]:
    """How often each pre-tokenized chunk occurs, as UTF-8 bytes."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(_SPLIT.findall(text))
    return Counter({chunk.encode("utf-8"): count for chunk, count in counts.items()})


def train_bpe(texts: Iterable[str], num_ranks: int) -> dict[bytes, int]:
    """Mergeable ranks (token bytes -> rank) of a BPE vocabulary of exactly `num_ranks` tokens.

    Each step merges the most frequent adjacent pair; ties go to the pair of lowest ids, so the result
    depends only on the text. A pair whose bytes are already a token (reached by another split) is merged
    into that token without using a rank, since tiktoken keys tokens by their bytes."""
    if num_ranks < 256:
        raise ConfigError(f"--vocab-size leaves {num_ranks} ranks, fewer than the 256 single bytes need. Use "
                          f"--vocab-size 258 or more (256 bytes, BOS and EOS).")
    chunk_counts = count_chunks(texts)
    words = [list(chunk) for chunk in chunk_counts]  # each chunk as token ids, starting from its bytes
    freqs = list(chunk_counts.values())
    token_bytes = [bytes([b]) for b in range(256)]
    token_ids = {token: i for i, token in enumerate(token_bytes)}
    pair_counts: defaultdict[Pair, int] = defaultdict(int)
    pair_words: defaultdict[Pair, set[int]] = defaultdict(set)
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[w]
            pair_words[pair].add(w)
    # Max-heap by count via negation; entries go stale as counts change and are checked when popped.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    while len(token_bytes) < num_ranks:
        pair = pop_most_frequent(heap, pair_counts)
        if pair is None:
            raise ConfigError(f"the --input text has too few distinct byte pairs for {num_ranks} ranks: training "
                              f"stopped at {len(token_bytes)}. Give more text or a smaller --vocab-size.")
        merged = token_bytes[pair[0]] + token_bytes[pair[1]]
        if merged not in token_ids:
            token_ids[merged] = len(token_bytes)
            token_bytes.append(merged)
        changed = apply_merge(pair, token_ids[merged], words, freqs, pair_counts, pair_words)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
    return {token: rank for rank, token in enumerate(token_bytes)}


def pop_most_frequent(heap: list[tuple[int, Pair]], pair_counts: dict[Pair, int]) -> Pair | None:
    """The pair with the highest current count (lowest ids on ties), or None when no pair is left."""
    while heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair) == -negative_count:
            return pair
    return None


def apply_merge(pair: Pair, new_id: int, words: list[list[int]], freqs: list[int],
                pair_counts: defaultdict[Pair, int], pair_words: defaultdict[Pair, set[int]]) -> set[Pair]:
    """Replace `pair` by `new_id` in every word holding it, left to right as tiktoken does, and update the
    pair counts. Returns the pairs whose counts changed."""
    changed: set[Pair] = set()
    for w in pair_words.pop(pair):
        word = words[w]
        merged = merge_word(word, pair, new_id)
        if len(merged) == len(word):
            continue  # pair_words is only ever added to, so it can list words that no longer hold the pair
        for p in zip(word, word[1:]):
            pair_counts[p] -= freqs[w]
            changed.add(p)
        for p in zip(merged, merged[1:]):
            pair_counts[p] += freqs[w]
            pair_words[p].add(w)
            changed.add(p)
        words[w] = merged
    return changed


def merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    merged = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def write_tiktoken(ranks: dict[bytes, int], path: Path) -> None:
    """One `base64(token) rank` line per token in rank order: what tiktoken.load.load_tiktoken_bpe reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in sorted(ranks.items(),
                                                                                          key=lambda kv: kv[1])]
    path.write_bytes(b"\n".join(lines) + b"\n")
