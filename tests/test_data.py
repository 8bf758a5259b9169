"""Tokenizer, BPE trainer, document sources, the held-out split, packing, the global order across data-parallel
ranks, mixtures, validation batches, resumable loading and every data error path."""

import base64
import copy
import dataclasses
import gzip
import itertools
import json
import logging
import pickle
import random
import runpy
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

import pytest
import tiktoken.load
import torch

from bpe_train import train_bpe, write_tiktoken
from titan.config.errors import ConfigError
from titan.config.job import Training, Validation
from titan.data.dataset import (
    HELD_OUT_EVERY,
    SHIPPED_CORPUS,
    DocumentSource,
    build_document_source,
    is_held_out,
    read_jsonl_documents,
    read_text_documents,
)
from titan.data.loader import (
    PREFETCH_BATCHES,
    Batch,
    DataParallelLoader,
    build_dataloader,
    build_stream,
    build_validation_batches,
)
from titan.data.stream import WindowStream, permuted_index
from titan.data.tokenizer import (
    LLAMA3_SPLIT_PATTERN,
    SHIPPED_TOKENIZER,
    Tokenizer,
    build_tokenizer,
    special_tokens_for,
)

from harness.documents import write_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(read_jsonl_documents(SHIPPED_CORPUS, origin="test"))


def stream_of(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """The BOS + tokens + EOS stream that packing cuts into windows."""
    return [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]


def training_source(dataset: str, path: Path | str | None = None) -> DocumentSource:
    return build_document_source(dataset, None if path is None else str(path), "--training.dataset",
                                 "--training.dataset_path")


def token_stream(windows: Iterable[Iterable[int]]) -> list[int]:
    """The tokens that consecutive windows cover."""
    return [int(t) for window in windows for t in window]


def jsonl_training(tmp_path: Path, texts: list[str], **fields: int | bool) -> Training:
    return Training(dataset="jsonl", dataset_path=str(write_jsonl(tmp_path / "d.jsonl", texts)), **fields)


def in_order(training: Training) -> Training:
    return dataclasses.replace(training, shuffle=False)


def take_batches(loader: Iterable[Batch], count: int) -> list[Batch]:
    return list(itertools.islice(loader, count))


def concatenated(per_rank: list[list[Batch]]) -> list[Batch]:
    """The global batches that data-parallel ranks' batches make up, rank 0's sequences first."""
    return [tuple(torch.cat(parts) for parts in zip(*batches)) for batches in zip(*per_rank)]


def assert_same_batches(got: list[Batch], want: list[Batch]) -> None:
    """Equal batches (inputs, labels and document ends), as many as expected: a resumed loader that yields fewer, or
    nothing, fails."""
    assert len(got) == len(want), (len(got), len(want))
    for index, (got_batch, want_batch) in enumerate(zip(got, want, strict=True)):
        assert all(torch.equal(g, w) for g, w in zip(got_batch, want_batch, strict=True)), index


# Tokenizer


def test_shipped_tokenizer_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 2256
    assert (tokenizer.bos_id, tokenizer.eos_id) == (2254, 2255)
    ids = tokenizer.encode("hello world", bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.encode("hello world", bos=False, eos=False) == ids[1:-1]
    assert max(ids[1:-1]) < tokenizer.bos_id


def test_shipped_tokenizer_reads_like_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is in the format tiktoken's own loader reads (an empty cache dir turns its path cache off)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    ranks = tiktoken.load.load_tiktoken_bpe(str(ROOT / SHIPPED_TOKENIZER))
    assert sorted(ranks.values()) == list(range(2254))
    assert all(ranks[bytes([b])] == b for b in range(256))


def test_round_trip_on_corpus(tokenizer: Tokenizer, corpus: list[str]) -> None:
    for text in corpus[::20]:
        ids = tokenizer.encode(text, bos=False, eos=False)
        assert tokenizer.decode(ids) == text
        assert len(ids) < len(text.encode("utf-8")) / 2  # trained on this text, so it compresses it


def random_unicode(length: int) -> str:
    rng = random.Random(0)
    code_points = [rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x110000)])
                   for _ in range(length)]
    return "".join(map(chr, code_points))


@pytest.mark.parametrize("text", [
    "", " ", "\n\n\r\n\t", "\x00\x01\x7f", "naïve café 日本語 🦙🔥 e\u0301 \u200b", "<|begin_of_text|><|end_of_text|>",
    random_unicode(3000), "a" * 60_000, " " * 60_000 + "x", ("word " * 100_000) + "z" * 30_000,
], ids=["empty", "space", "newlines", "controls", "mixed", "special-strings", "random", "long-run",
        "long-space", "over-400k"])
def test_round_trip_on_any_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids  # special strings are plain text


def test_llama3_file_gets_llama3_special_ids(tmp_path: Path) -> None:
    """A 128000-rank file is Llama 3's tokenizer.model: its special ids must be Meta's."""
    three_byte = (bytes([0, a, b]) for a in range(256) for b in range(256))
    tokens = [bytes([b]) for b in range(256)] + [bytes(p) for p in itertools.product(range(256), repeat=2)]
    tokens += list(itertools.islice(three_byte, 128_000 - len(tokens)))
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    llama = build_tokenizer(str(path))
    assert (llama.bos_id, llama.eos_id, llama.vocab_size) == (128000, 128001, 128256)
    special = special_tokens_for(128_000)
    assert special["<|start_header_id|>"] == 128006
    assert special["<|end_header_id|>"] == 128007
    assert special["<|eot_id|>"] == 128009
    assert special["<|python_tag|>"] == 128010
    assert special["<|reserved_special_token_246|>"] == 128255  # reserved ids as numbered in Meta's llama3.1 code
    assert max(llama.encode("<|eot_id|>", bos=False, eos=False)) < 128000
    assert special_tokens_for(2254) == {"<|begin_of_text|>": 2254, "<|end_of_text|>": 2255}


def test_relative_tokenizer_path_tries_cwd_then_project_root(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer(SHIPPED_TOKENIZER).vocab_size == 2256  # from the project root
    write_tiktoken(train_bpe(["abc abd abe"], num_ranks=258), tmp_path / SHIPPED_TOKENIZER)
    assert build_tokenizer(SHIPPED_TOKENIZER).vocab_size == 260  # the working directory wins


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b'{"model": {"type": "BPE"}}\n', "Titan reads byte-level BPE tokenizer.json files"),  # JSON: tokenizer.json
    (b"not base64 0\n", "not a tiktoken file: line 1"),
    (b"AA== 0\nAQ== 1 2\n", "line 2 has extra fields"),
    (b"AA== 0\nAA== 1\n", "listed twice"),
    (b"AA== 0\nAQ== 5\n", "not exactly 0..1"),
    (b"AA== 0\nAQ== 1\n", "256 single bytes"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not a tiktoken file"),
])
def test_corrupt_tokenizer_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"--model\.tokenizer_path") as err:
        build_tokenizer(str(path))
    assert message in str(err.value)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--model\.tokenizer_path .*missing\.tiktoken.* is not a file"):
        build_tokenizer(str(tmp_path / "missing.tiktoken"))


# BPE trainer


def test_train_bpe_size_round_trip_and_determinism(corpus: list[str]) -> None:
    texts = corpus[:40]
    ranks = train_bpe(texts, num_ranks=600)
    assert len(ranks) == 600 and sorted(ranks.values()) == list(range(600))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert train_bpe(texts, num_ranks=600) == ranks
    trained = Tokenizer(ranks, name="test")
    assert trained.vocab_size == 602
    for text in texts[:5]:
        assert trained.decode(trained.encode(text, bos=False, eos=False)) == text


def test_tiktoken_reproduces_every_merge(corpus: list[str]) -> None:
    """Each learned token, encoded alone by tiktoken, is that one token: the merge order and tiktoken's
    lowest-rank-first BPE agree. (Tokens that are partial UTF-8, or that the regex would split, can't be
    given as text alone and are skipped.)"""
    import regex

    ranks = train_bpe(corpus[:40], num_ranks=600)
    trained = Tokenizer(ranks, name="test")
    checked = 0
    for token, rank in ranks.items():
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(token) > 1 and regex.findall(LLAMA3_SPLIT_PATTERN, text) == [text]:
            assert trained.encode(text, bos=False, eos=False) == [rank], text
            checked += 1
    assert checked > 300


def test_shipped_tokenizer_is_reproducible(corpus: list[str]) -> None:
    """scripts/train_tokenizer.py --vocab-size 2256 on the shipped corpus gives the shipped file."""
    with open(ROOT / SHIPPED_TOKENIZER, "rb") as file:
        shipped = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in file)}
    assert train_bpe(corpus, num_ranks=2254) == shipped


def test_train_tokenizer_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corpus: list[str]) -> None:
    text_file = tmp_path / "a.txt"
    text_file.write_text("\n\n".join(corpus[40:50]))
    jsonl_file = write_jsonl(tmp_path / "b.jsonl", corpus[50:60])
    output = tmp_path / "out" / "tok.tiktoken"
    argv = ["train_tokenizer.py", "--vocab-size", "500", "--input", str(text_file), str(jsonl_file),
            "--output", str(output)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "train_tokenizer.py"), run_name="__main__")
    assert exit_.value.code == 0
    assert len(output.read_bytes().splitlines()) == 498
    assert build_tokenizer(str(output)).vocab_size == 500


def test_train_bpe_errors_name_vocab_size() -> None:
    with pytest.raises(ConfigError, match="--vocab-size"):
        train_bpe(["some text"], num_ranks=100)
    with pytest.raises(ConfigError, match="--vocab-size"):
        train_bpe(["ab ab"], num_ranks=300)  # runs out of pairs to merge


# Document sources and the held-out split


def test_text_files_split_on_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("first line\nsecond line\n\n  \n\nnext doc\n\n\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("  indented\n")
    (tmp_path / ".hidden").write_text("never read\n")
    (tmp_path / "a.txt").write_text("only one")
    expected = ["only one", "first line\nsecond line", "next doc", "  indented"]
    assert list(training_source("text", tmp_path).documents()) == expected
    assert list(training_source("text", tmp_path / "*.txt").documents()) == expected[:3]


def test_jsonl_folder_reads_plain_and_gzip(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as file:
        file.write(json.dumps({"text": "three", "id": 3}) + "\n\n")
    (tmp_path / "notes.txt").write_text("not data")
    assert list(training_source("jsonl", tmp_path).documents()) == ["one", "two", "three"]


def test_shipped_corpus_is_small_and_loads(tokenizer: Tokenizer, corpus: list[str]) -> None:
    assert SHIPPED_CORPUS.stat().st_size < 1_000_000  # the committed asset stays small
    assert len(corpus) > 300 and 1_000_000 < sum(len(t.encode("utf-8")) for t in corpus) < 3_000_000
    inputs, labels, _ = next(iter(build_dataloader(tokenizer, Training(), dp_rank=0, dp_degree=1)))
    assert inputs.shape == labels.shape == (Training().local_batch_size, Training().seq_len)
    assert inputs.dtype == labels.dtype == torch.int64


def test_shipped_training_never_reads_held_out_documents(tokenizer: Tokenizer, corpus: list[str]) -> None:
    """Training reads the shipped documents but 1 in 20 (by a CRC-32 of the text), in corpus order, and its store
    holds exactly theirs; --validation.dataset shipped reads exactly the others."""
    training_texts = [t for t in corpus if not is_held_out(t)]
    held_out = [t for t in corpus if zlib.crc32(t.encode("utf-8")) % HELD_OUT_EVERY == 0]
    assert len(corpus) / HELD_OUT_EVERY / 2 < len(held_out) < 2 * len(corpus) / HELD_OUT_EVERY
    assert list(training_source("shipped").documents()) == training_texts
    epoch = stream_of(tokenizer, training_texts)
    stream = build_stream(tokenizer, Training(seq_len=2047))
    assert stream.sources[0].store.tokens.tolist() == epoch
    validation = build_validation_batches(tokenizer, Validation(enable=True), Training(seq_len=63, local_batch_size=2),
                                          0, 1)
    assert validation.windows.store.tokens.tolist() == stream_of(tokenizer, held_out)
    assert validation.windows.origin == "--validation.dataset shipped"
    first_inputs = next(iter(validation))[0]
    assert first_inputs[0].tolist() == stream_of(tokenizer, held_out)[:63]


# Windows, epochs, shuffling, the global order and resuming


def test_windows_are_consecutive_and_labels_shift(tmp_path: Path, tokenizer: Tokenizer, corpus: list[str]) -> None:
    """With --training.shuffle off, windows cut the documents' token stream in order; a document ends at its EOS."""
    texts = corpus[:3]
    seq_len = 64
    stream = stream_of(tokenizer, texts)
    training = in_order(jsonl_training(tmp_path, texts, seq_len=seq_len, local_batch_size=1))
    for k, (inputs, labels, ends) in enumerate(take_batches(build_dataloader(tokenizer, training, 0, 1),
                                                            len(stream) // (seq_len + 1))):
        assert inputs.shape == labels.shape == ends.shape == (1, seq_len) and inputs.dtype == torch.int64
        window = stream[k * (seq_len + 1) : (k + 1) * (seq_len + 1)]
        assert inputs[0].tolist() == window[:-1] and labels[0].tolist() == window[1:]
        assert torch.equal(ends, inputs == tokenizer.eos_id)


def windows_of_epochs(stream: WindowStream, num_epochs: int) -> list[list[list[int]]]:
    per_epoch = stream.sources[0].per_epoch
    return [stream.take(per_epoch).tokens.tolist() for _ in range(num_epochs)]


def test_shuffle_visits_every_window_once_per_epoch_in_a_new_seeded_order(tmp_path: Path,
                                                                         tokenizer: Tokenizer,
                                                                         corpus: list[str]) -> None:
    training = jsonl_training(tmp_path, corpus[:5], seq_len=16)
    in_store_order = windows_of_epochs(build_stream(tokenizer, in_order(training)), 1)[0]
    epochs = windows_of_epochs(build_stream(tokenizer, training), 3)
    assert len(in_store_order) > 100
    for epoch in epochs:
        assert sorted(epoch) == sorted(in_store_order) and epoch != in_store_order
    assert epochs[0] != epochs[1] != epochs[2]
    assert windows_of_epochs(build_stream(tokenizer, training), 3) == epochs
    assert windows_of_epochs(build_stream(tokenizer, dataclasses.replace(training, seed=7)), 1)[0] != epochs[0]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 255, 256, 1000, 4099])
def test_window_permutation_is_a_bijection(size: int) -> None:
    for key in (0, 12345):
        assert sorted(permuted_index(index, size, key) for index in range(size)) == list(range(size))


@pytest.mark.parametrize("dp_degree", [2, 3])
def test_ranks_split_the_batches_of_one_process(tmp_path: Path, tokenizer: Tokenizer, corpus: list[str],
                                                dp_degree: int) -> None:
    """Data-parallel rank r of D with batch B gets sequences [r*B, (r+1)*B) of each batch of one process with batch
    B*D: D ranks train on exactly that process's samples, whatever D."""
    training = jsonl_training(tmp_path, corpus[:6], seq_len=32, local_batch_size=2)
    one_process = build_dataloader(tokenizer, dataclasses.replace(training, local_batch_size=2 * dp_degree), 0, 1)
    per_rank = [take_batches(build_dataloader(tokenizer, training, rank, dp_degree), 8) for rank in range(dp_degree)]
    assert_same_batches(concatenated(per_rank), take_batches(one_process, 8))


def test_a_rank_reads_only_its_own_windows(tmp_path: Path, tokenizer: Tokenizer, corpus: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 700 of 1024 reads its 2 windows of each global batch of 2048, and no other rank's tokens."""
    training = jsonl_training(tmp_path, corpus[:20], seq_len=32, local_batch_size=2)
    stream = build_stream(tokenizer, training)
    read: list[int] = []
    window = type(stream.sources[0]).window
    monkeypatch.setattr(type(stream.sources[0]), "window",
                        lambda self, drawn: read.append(drawn) or window(self, drawn))
    windows = stream.take(2048, 700 * 2, 2)
    assert read == [1400, 1401] and windows.tokens.shape == (2, 33)
    stream.take(2048, 700 * 2, 2)
    assert read[2:] == [2048 + 1400, 2048 + 1401]


def test_stream_loops_over_epochs_and_logs(tmp_path: Path, tokenizer: Tokenizer,
                                           titan_records: list[logging.LogRecord]) -> None:
    texts = ["alpha beta gamma", "delta", "epsilon zeta eta theta"]
    epoch = stream_of(tokenizer, texts)
    stream = build_stream(tokenizer, in_order(jsonl_training(tmp_path, texts, seq_len=4)))
    per_epoch = len(epoch) // 5
    got = token_stream(window for _ in range(4 * per_epoch + 1) for window in stream.take(1).tokens)
    assert got == (epoch[: 5 * per_epoch] * 5)[: len(got)]
    stream.take(3 * per_epoch)
    starts = [r.getMessage() for r in titan_records if "starts epoch" in r.getMessage()]
    source = f"Data: source jsonl:{tmp_path / 'd.jsonl'}"
    assert starts == [f"{source} starts epoch {epoch}" for epoch in range(5)] + [
        f"{source} starts epochs 5 to 7 in one batch"]


# Documents of 3 tokens (BOS, letter, EOS) and windows of 6: every batch of 2 windows ends on a document
# boundary, and batch 5 also ends exactly on an epoch boundary (60 tokens = 4 epochs of 15).
ALIGNED_TEXTS = ["a", "b", "c", "d", "e"]
RAGGED_TEXTS = ["The quick brown fox", "jumps", "over the lazy dog, twice over.", "Fin.", "x" * 40]


@pytest.mark.parametrize("texts, seq_len", [(ALIGNED_TEXTS, 5), (RAGGED_TEXTS, 9)], ids=["aligned", "ragged"])
def test_loader_resumes_exactly_at_every_batch(tmp_path: Path, tokenizer: Tokenizer, texts: list[str],
                                               seq_len: int) -> None:
    """Resuming after k batches (mid-epoch, on an epoch boundary) gives the same next batches, although the
    interrupted loader had prefetched batches past k."""
    training = jsonl_training(tmp_path, texts, seq_len=seq_len, local_batch_size=2)
    num_batches = 10  # several epochs of this data
    reference = take_batches(build_dataloader(tokenizer, training, 0, 1), num_batches)
    for k in range(num_batches):
        interrupted = build_dataloader(tokenizer, training, 0, 1)
        take_batches(interrupted, k)
        resumed = build_dataloader(tokenizer, training, 0, 1)
        resumed.load_state_dict(copy.deepcopy(interrupted.state_dict()))
        assert_same_batches(take_batches(resumed, num_batches - k), reference[k:])


def test_prefetched_batches_are_ready_and_not_yet_consumed(tmp_path: Path, tokenizer: Tokenizer,
                                                           corpus: list[str]) -> None:
    """While the trainer holds batch k, the background thread has prepared the next ones; the state is still
    batch k's, and a new iterator continues right after batch k."""
    training = jsonl_training(tmp_path, corpus[:4], seq_len=16, local_batch_size=2)
    reference = take_batches(build_dataloader(tokenizer, training, 0, 1), 6)
    loader = build_dataloader(tokenizer, training, 0, 1)
    batches = iter(loader)
    assert_same_batches([next(batches), next(batches)], reference[:2])
    deadline = time.monotonic() + 10
    assert loader.prefetching is not None
    while loader.prefetching.window_index < 2 * (2 + PREFETCH_BATCHES) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader.prefetching.window_index == 2 * (2 + PREFETCH_BATCHES)  # prepared ahead, in the background
    assert loader.state_dict()["window_index"] == 4 and loader.position()["window_index"] == 4
    assert_same_batches(take_batches(loader, 4), reference[2:])


def test_loader_threads_stop_with_their_iterator(tmp_path: Path, tokenizer: Tokenizer, corpus: list[str]) -> None:
    """A new iterator stops the previous one's background thread, and close() the last one's: none outlives
    training in a process that goes on (the trainer closes its loader)."""
    training = jsonl_training(tmp_path, corpus[:4], seq_len=16, local_batch_size=2)
    loader = build_dataloader(tokenizer, training, 0, 1)
    # Threads left by earlier tests may end meanwhile, so count the ones started since, not all.
    before = set(threading.enumerate())

    def started_since() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread not in before]

    for _ in range(3):
        next(iter(loader))
        assert len(started_since()) == 1
    loader.close()
    assert started_since() == []
    assert_same_batches(take_batches(loader, 1), take_batches(build_dataloader(tokenizer, training, 0, 1), 4)[3:])


@pytest.mark.parametrize("saved, resumed", [((2, 2), (1, 4)), ((1, 4), (2, 2)), ((2, 2), (4, 1))],
                         ids=["dp2-to-dp1", "dp1-to-dp2", "dp2-to-dp4"])
def test_resume_on_another_data_parallel_degree(tmp_path: Path, tokenizer: Tokenizer, saved: tuple[int, int],
                                                resumed: tuple[int, int]) -> None:
    """The state is the global stream's position, the same on every rank: saved by one layout (dp degree, local
    batch), it continues the same global batches on another."""
    training = jsonl_training(tmp_path, RAGGED_TEXTS, seq_len=9)

    def loaders(dp_degree: int, local_batch_size: int) -> list[DataParallelLoader]:
        per_rank = dataclasses.replace(training, local_batch_size=local_batch_size)
        return [build_dataloader(tokenizer, per_rank, rank, dp_degree) for rank in range(dp_degree)]

    reference = take_batches(loaders(1, 4)[0], 10)
    before = loaders(*saved)
    for loader in before:
        take_batches(loader, 3)
    states = [pickle.dumps(loader.state_dict()) for loader in before]
    assert len(set(states)) == 1
    after = loaders(*resumed)
    for loader in after:
        loader.load_state_dict(pickle.loads(states[0]))
    assert_same_batches(concatenated([take_batches(loader, 7) for loader in after]), reference[3:])


def test_loader_state_survives_torch_save(tmp_path: Path, tokenizer: Tokenizer, corpus: list[str]) -> None:
    training = jsonl_training(tmp_path, corpus[:4], seq_len=128, local_batch_size=4)
    loader = build_dataloader(tokenizer, training, dp_rank=1, dp_degree=2)
    batches = iter(loader)
    for _ in range(7):  # past the end of the first epoch
        next(batches)
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    expected = [next(batches) for _ in range(3)]
    # A single source continues under another name: the data moved to a new path.
    moved = shutil.copy(training.dataset_path, tmp_path / "moved.jsonl")
    resumed = build_dataloader(tokenizer, dataclasses.replace(training, dataset_path=str(moved)), dp_rank=1,
                               dp_degree=2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert resumed.position()["epoch"] >= 1
    assert_same_batches(take_batches(resumed, len(expected)), expected)


def test_resume_on_changed_data_or_an_old_position_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer,
                                                                     corpus: list[str]) -> None:
    training = jsonl_training(tmp_path, corpus[:4], seq_len=32)
    loader = build_dataloader(tokenizer, training, 0, 1)
    take_batches(loader, 2)
    state = loader.state_dict()
    write_jsonl(tmp_path / "d.jsonl", corpus[:3])  # the same path, other contents
    with pytest.raises(ConfigError, match=r"data of jsonl:.*d\.jsonl changed since the checkpoint.*"
                                          r"--checkpoint\.exclude_from_loading dataloader"):
        build_dataloader(tokenizer, training, 0, 1).load_state_dict(state)
    with pytest.raises(ConfigError, match="--training.seq_len 32, this run's are 16"):
        write_jsonl(tmp_path / "d.jsonl", corpus[:4])
        build_dataloader(tokenizer, dataclasses.replace(training, seq_len=16), 0, 1).load_state_dict(state)
    old_packer_state = {"window_index": 3, "tokens": {"shipped": 96},
                        "sources": {"shipped": {"epoch": 0, "document_index": 2, "token_offset": 17}}}
    with pytest.raises(ConfigError, match="earlier Titan.*--checkpoint.exclude_from_loading dataloader"):
        build_dataloader(tokenizer, Training(), 0, 1).load_state_dict(old_packer_state)


# Mixtures


def test_mixture_draws_follow_the_weights(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Window i's source is a pure function of (seed, i): the same in every stream with that seed, other with
    another seed. The windows the stream hands out follow the weights: a chi-square test of each source's count in
    each block of 1,000 windows against its share of the weights, which draws that do follow them fail with
    probability 1e-6 (seed fixed, so the test is deterministic)."""
    code = write_jsonl(tmp_path / "code.jsonl", ["def f(): pass", "def g(x): return x + 1"])
    prose = write_jsonl(tmp_path / "prose.jsonl", ["one two three four five six seven eight nine ten"])
    weights = {"shipped": 1, f"jsonl:{code}": 2, f"jsonl:{prose}": 5}
    training = Training(mixture=[f"{name}={weight}" for name, weight in weights.items()], seq_len=8)

    def source_ids(seed: int) -> list[int]:
        return build_stream(tokenizer, dataclasses.replace(training, seed=seed)).source_ids(0, 4000).tolist()

    assert source_ids(42) == source_ids(42) and source_ids(42) != source_ids(7)
    stream = build_stream(tokenizer, dataclasses.replace(training, seed=42))
    assert [source.name for source in stream.sources] == list(weights)
    num_blocks, block = 8, 1000
    counts = []
    for _ in range(num_blocks):
        before = list(stream.drawn)
        stream.take(block)
        counts.append([after - drawn for after, drawn in zip(stream.drawn, before, strict=True)])
    observed = torch.tensor(counts, dtype=torch.float64)  # (num_blocks, num_sources): windows drawn per source
    expected = block * torch.tensor(list(weights.values()), dtype=torch.float64) / sum(weights.values())
    chi_square = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor(num_blocks * (len(weights) - 1), dtype=torch.float64)
    p_value = torch.special.gammaincc(degrees_of_freedom / 2, chi_square / 2)  # the chi-square distribution's tail
    assert p_value > 1e-6, f"draws per block {counts} do not follow the weights {weights} (p = {p_value:.2e})"


def test_mixture_sources_loop_on_their_own_and_resume(tmp_path: Path, tokenizer: Tokenizer,
                                                      titan_records: list[logging.LogRecord]) -> None:
    """Each source goes through its own windows epoch after epoch (and says when one starts); the tokens drawn from
    each, the position and every later window come back from the state."""
    texts = {"a": ["alpha beta gamma delta", "epsilon"], "b": ["one two three four five six seven eight nine"]}
    names = {key: f"jsonl:{write_jsonl(tmp_path / f'{key}.jsonl', value)}" for key, value in texts.items()}
    training = Training(mixture=[f"{names['a']}=1", f"{names['b']}=2"], seq_len=5, shuffle=False)
    loader = build_dataloader(tokenizer, training, 0, 1)
    stream = loader.stream
    windows = [window for _ in range(23) for window in stream.take(1).tokens.tolist()]
    state = copy.deepcopy(stream.state_dict())
    windows += [window for _ in range(37) for window in stream.take(1).tokens.tolist()]
    drawn = [stream.source_of(index).name for index in range(60)]
    for key, name in names.items():
        own = [window for window, source in zip(windows, drawn) if source == name]
        epoch = stream_of(tokenizer, texts[key])
        assert token_stream(own) == (epoch[: len(epoch) // 6 * 6] * 60)[: 6 * len(own)]
    assert stream.tokens_per_source() == {name: 5 * drawn.count(name) for name in names.values()}
    assert stream.position()["window_index"] == 60 and stream.position()["source"] == stream.source_of(60).name
    logged = {r.getMessage() for r in titan_records}
    assert {f"Data: source {name} starts epoch 2" for name in names.values()} <= logged
    resumed = build_dataloader(tokenizer, training, 0, 1)
    resumed.load_state_dict(state)
    assert resumed.stream.take(37).tokens.tolist() == windows[23:]
    assert resumed.stream.tokens_per_source() == stream.tokens_per_source()
    other_data = build_dataloader(tokenizer, Training(), 0, 1)
    with pytest.raises(ConfigError, match="--checkpoint.exclude_from_loading dataloader"):
        other_data.load_state_dict(state)


# Validation batches


def test_validation_is_one_pass_with_the_same_batches_on_every_rank(tmp_path: Path, tokenizer: Tokenizer,
                                                                   corpus: list[str]) -> None:
    """Every iteration is one pass from the first window, in document order; ranks split each global batch as in
    training, and all yield the same number of batches: the incomplete last global batch is left out.
    --validation.steps caps the batches; unset, local_batch_size and seq_len are training's."""
    texts = corpus[:2]
    validation = Validation(enable=True, dataset="jsonl", dataset_path=str(write_jsonl(tmp_path / "v.jsonl", texts)))
    training = Training(seq_len=31, local_batch_size=3)
    num_windows = len(stream_of(tokenizer, texts)) // 32
    assert num_windows % 6 and num_windows > 12  # a partial global batch at the end
    per_rank = [build_validation_batches(tokenizer, validation, training, rank, 2) for rank in range(2)]
    passes = [list(batches) for batches in per_rank]
    assert len(passes[0]) == len(passes[1]) == num_windows // 6
    assert passes[0][0][0].shape == (3, 31)
    assert passes[0][0][0][0].tolist() == stream_of(tokenizer, texts)[:31]
    assert_same_batches(list(per_rank[1]), passes[1])  # the second pass starts over
    one_process = build_validation_batches(tokenizer, validation, dataclasses.replace(training, local_batch_size=6),
                                           0, 1)
    assert_same_batches(concatenated(passes), list(one_process))
    capped = dataclasses.replace(validation, steps=2, local_batch_size=1, seq_len=16)
    assert [inputs.shape for inputs, *_ in build_validation_batches(tokenizer, capped, training, 0, 2)] == [(1, 16)] * 2


def test_validation_set_smaller_than_one_global_batch(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "v.jsonl", ["a short validation text of a few dozen tokens, " * 2])
    num_windows = len(stream_of(tokenizer, ["a short validation text of a few dozen tokens, " * 2])) // 9
    validation = Validation(enable=True, dataset="jsonl", dataset_path=str(path), seq_len=8)
    with pytest.raises(ConfigError) as err:
        build_validation_batches(tokenizer, validation, Training(local_batch_size=4), 0, 2)
    assert (f"--validation.dataset_path '{path}' gives {num_windows} window(s) of --validation.seq_len 8 + 1 tokens, "
            f"fewer than one global batch of --training.local_batch_size 4 x data-parallel degree 2 = 8. Try "
            f"--validation.local_batch_size {num_windows // 2}") in str(err.value)


# Error paths


def first_batch(tokenizer: Tokenizer, training: Training) -> None:
    next(iter(build_dataloader(tokenizer, training, dp_rank=0, dp_degree=1)))


@pytest.mark.parametrize("dataset, relative", [
    ("text", "missing.txt"), ("jsonl", "missing/*.jsonl"), ("jsonl", "."),
], ids=["missing-path", "glob-matches-nothing", "folder-without-jsonl"])
def test_bad_dataset_path(tmp_path: Path, tokenizer: Tokenizer, dataset: str, relative: str) -> None:
    with pytest.raises(ConfigError, match=r"--training\.dataset_path"):
        first_batch(tokenizer, Training(dataset=dataset, dataset_path=str(tmp_path / relative)))


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"text": broken\n', "line 2 is not valid JSON"),
    ('{"text": "fine"}\n\n{"body": "no text"}\n', 'line 3 has no string "text" field'),
    ('["a list"]\n', 'line 1 has no string "text" field'),
])
def test_corrupt_jsonl_names_file_and_line(tmp_path: Path, tokenizer: Tokenizer, content: str, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"--training\.dataset_path") as err:
        first_batch(tokenizer, Training(dataset="jsonl", dataset_path=str(path), seq_len=8))
    assert str(path) in str(err.value) and message in str(err.value)


def test_corrupt_gzip_and_non_utf8_text(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "data.jsonl.gz").write_bytes(b"this is not gzip")
    with pytest.raises(ConfigError, match=r"--training\.dataset_path .*data\.jsonl\.gz can't be read"):
        first_batch(tokenizer, Training(dataset="jsonl", dataset_path=str(tmp_path / "data.jsonl.gz")))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"--training\.dataset_path .*latin1\.txt is not UTF-8"):
        first_batch(tokenizer, Training(dataset="text", dataset_path=str(tmp_path / "latin1.txt")))


@pytest.mark.parametrize("name, content", [
    ("empty.jsonl", ""), ("blank.txt", "\n \n\n"), ("empty-texts.jsonl", '{"text": ""}\n{"text": ""}\n'),
])
def test_empty_dataset(tmp_path: Path, tokenizer: Tokenizer, name: str, content: str) -> None:
    (tmp_path / name).write_text(content)
    dataset = "text" if name.endswith(".txt") else "jsonl"
    with pytest.raises(ConfigError, match=r"--training\.dataset_path .* has no documents with text"):
        first_batch(tokenizer, Training(dataset=dataset, dataset_path=str(tmp_path / name), seq_len=8))


def test_data_shorter_than_one_window(tmp_path: Path, tokenizer: Tokenizer) -> None:
    texts = ["short", "texts"]
    num_tokens = len(stream_of(tokenizer, texts))
    training = Training(dataset="jsonl", dataset_path=str(write_jsonl(tmp_path / "d.jsonl", texts)), seq_len=64)
    with pytest.raises(ConfigError, match=r"--training\.dataset_path") as err:
        first_batch(tokenizer, training)
    assert f"only {num_tokens} tokens" in str(err.value) and "--training.seq_len 64 + 1 = 65" in str(err.value)


def test_hf_local_folder_is_one_global_stream_and_resumes(tmp_path: Path, tokenizer: Tokenizer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A local Hugging Face dataset is tokenized into a store once and read like local files."""
    pytest.importorskip("datasets", reason="the hf source needs the optional `datasets` package (titan[hf])")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    texts = [f"hf document {i} " + "word " * i for i in range(12)]
    write_jsonl(tmp_path / "train.jsonl", texts)
    training = Training(dataset="hf", dataset_path=str(tmp_path), seq_len=16, local_batch_size=2)
    assert list(training_source("hf", tmp_path).documents()) == texts
    one_process = take_batches(build_dataloader(tokenizer, dataclasses.replace(training, local_batch_size=6), 0, 1), 6)
    per_rank = [take_batches(build_dataloader(tokenizer, training, rank, 3), 6) for rank in range(3)]
    assert_same_batches(concatenated(per_rank), one_process)
    interrupted = build_dataloader(tokenizer, training, 1, 3)
    take_batches(interrupted, 2)
    resumed = build_dataloader(tokenizer, dataclasses.replace(training, local_batch_size=6), 0, 1)
    resumed.load_state_dict(interrupted.state_dict())
    assert_same_batches(take_batches(resumed, 4), one_process[2:])


def test_hf_without_datasets_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    write_jsonl(tmp_path / "train.jsonl", ["text"])
    with pytest.raises(ConfigError, match=r"--training\.dataset hf .*pip install titan\[hf\]"):
        first_batch(tokenizer, Training(dataset="hf", dataset_path=str(tmp_path)))


def test_hf_hub_dataset_is_prepared_on_its_own(tokenizer: Tokenizer) -> None:
    with pytest.raises(ConfigError, match=r"--training\.dataset hf --training\.dataset_path 'some/dataset' is not a "
                                          r"local folder.*python -m titan\.data\.prepare --dataset hf --dataset_path "
                                          r"some/dataset --out STORE"):
        first_batch(tokenizer, Training(dataset="hf", dataset_path="some/dataset"))


def test_text_reader_reports_the_origin_flag(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="--input"):
        list(read_text_documents(tmp_path / "x.txt", origin="--input"))
