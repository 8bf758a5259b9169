"""Token stores: a source's documents tokenized once into memory-mapped numpy arrays, so that training reads
token ids by index and never tokenizes.

A store is a folder of three files:
  tokens.npy     every document as BOS (when the tokenizer has one) + its tokens + EOS, back to back, in the
                 source's document order: uint16 when the vocabulary has at most 65,536 ids, else uint32
  documents.npy  int64 offsets, one per document and one past the last: document d is
                 tokens[documents[d]:documents[d + 1]]
  roles.npy      chat stores only (titan/data/conversations.py): uint8, one per token, 0 where the model reads the
                 token, 1 where an assistant wrote it, 2 in a conversation's last assistant turn
  meta.json      format and version, the tokenizer's fingerprint and vocabulary size, the source (kind, path, split,
                 each file's size, modification time and SHA-256), the counts, and content_hash: a SHA-256 of the
                 source files' hashes, the split and the tokenizer, which names the data in checkpoints
The arrays are standard .npy files: `numpy.load(path, mmap_mode="r")` reads them without Titan.

A store is written under a temporary name in the same folder and renamed into place once complete (meta.json
last), so a folder with the final name is never half-written: a preparation stopped by a full disk, a signal or a
crash leaves at most the temporary folder, .NAME.partial-HOST-PID, which the next preparation of the store on that
host removes once process PID is gone.
"""

import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from titan.config.errors import ConfigError
from titan.data.tokenizer import Tokenizer
from titan.data.tokenizer_json import TokenizerJson
from titan.metrics.log import logger

STORE_FORMAT = "titan-token-store"
STORE_VERSION = 1
TOKENS_FILE, DOCUMENTS_FILE, ROLES_FILE, META_FILE = "tokens.npy", "documents.npy", "roles.npy", "meta.json"
HEADER_BYTES = 128
"""Both arrays are written before their length is known, behind a .npy header padded to this size and filled in
at the end (numpy's own headers are padded to a multiple of 64 bytes; 128 holds any 1-D shape)."""
CHUNK_CHARS = 4_000_000
"""Text per unit of work for the tokenizing processes: large enough that sending it is cheap next to encoding it."""
PARALLEL_FROM_CHARS = 32_000_000
"""Sources smaller than this are tokenized in this process: starting the workers would cost more than it saves."""


def npy_header(dtype: np.dtype, length: int) -> bytes:
    """The .npy (version 1.0) header of a 1-D array of `length` elements of `dtype`, padded to HEADER_BYTES."""
    description = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({length},), }}"
    padded = description.ljust(HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded.encode("latin1")


class NpyWriter:
    """Appends 1-D chunks of one dtype to a .npy file whose length is written when it is closed."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.length = 0
        self._file = open(path, "wb")
        self._file.write(npy_header(self.dtype, 0))

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self.length))
        self._file.close()

    def discard(self) -> None:
        self._file.close()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)  # keyed by the tokenizer object: 128k ranks take ~0.1 s to hash
def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A SHA-256 of everything that decides the tokenizer's ids: the same tokenizer in any file has the same one.
    A tiktoken file's ranks and special tokens decide them (its regex, BOS and EOS are fixed); a tokenizer.json
    also sets the regex, the NFC normalizer, BOS and EOS, and, for rendered chat templates, the whitespace its added
    tokens take in and the offsets it trims (which decide the roles). Those are hashed for tokenizer.json files
    only, so that the fingerprints of tiktoken tokenizers, in existing stores and checkpoints, stay what they were."""
    digest = hashlib.sha256()
    for token, rank in sorted(tokenizer.mergeable_ranks.items(), key=lambda item: item[1]):
        digest.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
    digest.update(json.dumps(tokenizer.special_tokens, sort_keys=True).encode())
    if tokenizer.hf_json is not None:
        rules = {"split_pattern": tokenizer.hf_json.split_pattern, "nfc": tokenizer.hf_json.nfc,
                 "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
        if tokenizer.hf_json.isolating_splits:  # only where there are some: other files' fingerprints stay
            rules["isolating_splits"] = list(tokenizer.hf_json.isolating_splits)
        if tokenizer.hf_json.stripping_tokens:
            rules["stripping_tokens"] = tokenizer.hf_json.stripping_tokens
        if tokenizer.hf_json.trim_offsets is not None:
            rules["trim_offsets"] = {"add_prefix_space": tokenizer.hf_json.trim_offsets.add_prefix_space}
        digest.update(json.dumps(rules, sort_keys=True).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class SourceDescription:
    """What a store was tokenized from, as meta.json records it."""

    kind: str
    """shipped, text, jsonl or hf."""
    path: str | None
    split: str
    """train or held_out for the shipped corpus (titan/data/dataset.py), all for the others."""
    files: tuple[Path, ...]
    """Local files read, in reading order; empty for a dataset streamed from the Hugging Face hub."""
    recipe: dict[str, Any] | None = None
    """How a chat source becomes tokens besides the tokenizer (its template and messages field): part of the
    store's identity. None for documents."""

    def file_stamps(self) -> list[dict[str, Any]]:
        """Each file's resolved path, size and modification time: what tells a changed file without reading it."""
        stamps = []
        for path in self.files:
            stat = path.stat()
            stamps.append({"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return stamps

    def file_records(self) -> list[dict[str, Any]]:
        """file_stamps() with each file's SHA-256, as meta.json records them."""
        return [{**stamp, "sha256": file_sha256(path)} for stamp, path in zip(self.file_stamps(), self.files)]


def content_hash(file_records: list[dict[str, Any]], source: SourceDescription, tokenizer_sha: str) -> str:
    """Names the tokens a store holds: the files' contents (not their paths), the split and the tokenizer. For a
    hub dataset, which has no local files, its name stands for its content."""
    identity = {"files": [record["sha256"] for record in file_records], "split": source.split,
                "tokenizer": tokenizer_sha, "hub": None if source.files else source.path}
    if source.recipe is not None:  # only then: documents' hashes, in existing checkpoints, stay what they were
        identity["recipe"] = source.recipe
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


@dataclass
class TokenStore:
    """An opened store: its two arrays, memory-mapped, and its meta.json."""

    path: Path
    tokens: np.ndarray
    documents: np.ndarray
    meta: dict[str, Any]
    roles: np.ndarray | None = None
    """A chat store's roles.npy; None for documents."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]


def store_error(path: Path, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"Token store {path}: {problem}. {fix}")


REPREPARE = "Delete the folder to tokenize the source again, or prepare it anew with `python -m titan.data.prepare`."


def open_store(path: Path, tokenizer: Tokenizer) -> TokenStore:
    """Open and check the store at `path`: every file present, the arrays as long as meta.json says, and tokenized by
    `tokenizer`. Raises a ConfigError naming the path and what to do otherwise."""
    if not path.is_dir():
        raise store_error(path, "no such folder", "Prepare it with `python -m titan.data.prepare`, or fix the path.")
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise store_error(path, f"{META_FILE} is missing (an incomplete or foreign folder)", REPREPARE) from None
    except (OSError, ValueError) as err:
        raise store_error(path, f"{META_FILE} can't be read ({err})", REPREPARE) from None
    if meta.get("format") != STORE_FORMAT or meta.get("version") != STORE_VERSION:
        raise store_error(path, f"{META_FILE} is not a {STORE_FORMAT} version {STORE_VERSION} (format "
                                f"{meta.get('format')!r}, version {meta.get('version')!r})", REPREPARE)
    tokens = load_array(path / TOKENS_FILE, np.dtype(meta["dtype"]), meta["num_tokens"])
    documents = load_array(path / DOCUMENTS_FILE, np.dtype(np.int64), meta["num_documents"] + 1)
    if documents[0] != 0 or documents[-1] != len(tokens):
        raise store_error(path, f"{DOCUMENTS_FILE} does not span {TOKENS_FILE} (offsets {documents[0]} to "
                                f"{documents[-1]}, {len(tokens)} tokens)", REPREPARE)
    expected = {"sha256": tokenizer_fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size}
    if meta["tokenizer"] != expected:
        raise store_error(path, f"it was tokenized by another tokenizer (vocabulary {meta['tokenizer']['vocab_size']}"
                                f", fingerprint {meta['tokenizer']['sha256'][:12]}) than --model.tokenizer_path's "
                                f"(vocabulary {tokenizer.vocab_size}, fingerprint {expected['sha256'][:12]})",
                          "Use the tokenizer it was prepared with, or prepare the source again with this one.")
    roles = load_array(path / ROLES_FILE, np.dtype(np.uint8), meta["num_tokens"]) if meta.get("roles") else None
    return TokenStore(path, tokens, documents, meta, roles)


def load_array(path: Path, dtype: np.dtype, length: int) -> np.ndarray:
    """The 1-D array at `path`, memory-mapped, checked for its dtype and its `length` before it is mapped (numpy
    would map a truncated file's header and fail later, or read past its end)."""
    if not path.is_file():
        raise store_error(path.parent, f"{path.name} is missing", REPREPARE)
    expected_bytes = HEADER_BYTES + length * dtype.itemsize
    if path.stat().st_size != expected_bytes:
        raise store_error(path.parent, f"{path.name} has {path.stat().st_size} bytes where {length} {dtype} values "
                                       f"take {expected_bytes} (truncated or overwritten)", REPREPARE)
    array = np.load(path, mmap_mode="r")
    if array.dtype != dtype or array.shape != (length,):
        raise store_error(path.parent, f"{path.name} holds {array.dtype} of shape {array.shape}, expected {dtype} of "
                                       f"shape ({length},)", REPREPARE)
    return array


def source_changes(meta: dict[str, Any]) -> list[str]:
    """Source files recorded in `meta` that exist here with other contents than when the store was prepared (files
    not on this machine are not checked: stores travel without their sources). Hashes only files whose size or
    modification time changed."""
    changed = []
    for record in meta["source"]["files"]:
        path = Path(record["path"])
        if not path.is_file():
            continue
        stat = path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (record["size"], record["mtime_ns"]) \
                and file_sha256(path) != record["sha256"]:
            changed.append(str(path))
    return changed


# Tokenizing, in worker processes for large sources

_worker_tokenizer: Tokenizer | None = None


def start_worker(mergeable_ranks: dict[bytes, int], name: str, hf_json: TokenizerJson | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(mergeable_ranks, name, hf_json)


@dataclass(frozen=True)
class EncodedChunk:
    """Consecutive documents of a source, tokenized."""

    tokens: np.ndarray
    lengths: np.ndarray
    """Each document's number of tokens."""
    chars: int
    """Characters read to make them, for progress lines."""
    roles: np.ndarray | None = None
    """Each token's role, for a chat source (ROLES_FILE)."""


class StoreSource(Protocol):
    """What a store is prepared from."""

    origin: str
    """The flag and value it comes from, for error messages."""
    description: SourceDescription
    """What the store records as its source."""

    def encoded(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[EncodedChunk]:
        """Every document, tokenized, in a fixed order, with up to `workers` processes."""
        ...


def encode_in_worker(texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "start_worker runs first in every worker"
    return encode_documents(_worker_tokenizer, texts, dtype)


def encode_documents(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the non-empty `texts` ([BOS] + text + EOS each, concatenated; BOS when the tokenizer has one)
    and each one's length. Empty documents are dropped: BOS + EOS alone would teach nothing."""
    encoded = [tokenizer.encode(text, bos=True, eos=True) for text in texts if text]
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter((token for ids in encoded for token in ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def text_chunks(documents: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    """`documents` in lists of about CHUNK_CHARS characters, each with its character count."""
    chunk: list[str] = []
    chars = 0
    for text in documents:
        chunk.append(text)
        chars += len(text)
        if chars >= CHUNK_CHARS:
            yield chunk, chars
            chunk, chars = [], 0
    if chunk:
        yield chunk, chars


def encoded_chunks(documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, workers: int
                   ) -> Iterator[EncodedChunk]:
    """`documents` tokenized, chunk by chunk in order: in this process until PARALLEL_FROM_CHARS characters have
    gone by, then by `workers` processes, each a few chunks ahead."""
    chunks = text_chunks(documents)
    seen = 0
    for texts, chars in chunks:
        yield EncodedChunk(*encode_documents(tokenizer, texts, dtype), chars)
        seen += chars
        if workers > 1 and seen >= PARALLEL_FROM_CHARS:
            break
    else:
        return
    # Spawned, not forked: the trainer prepares after starting its process groups' threads.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=start_worker,
                             initargs=(tokenizer.mergeable_ranks, "titan", tokenizer.hf_json)) as pool:
        pending: list[tuple[Future, int]] = []
        for texts, chars in chunks:
            pending.append((pool.submit(encode_in_worker, texts, dtype), chars))
            if len(pending) > 2 * workers:
                future, done_chars = pending.pop(0)
                yield EncodedChunk(*future.result(), done_chars)
        for future, done_chars in pending:
            yield EncodedChunk(*future.result(), done_chars)


class Progress:
    """A progress line on a terminal (a log line every 30 s elsewhere) and the summary at the end."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.start = self.last = time.perf_counter()
        self.documents = self.tokens = self.chars = 0
        self.on_terminal = sys.stderr.isatty()

    def add(self, documents: int, tokens: int, chars: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.chars += chars
        now = time.perf_counter()
        if now - self.last < (1.0 if self.on_terminal else 30.0):
            return
        self.last = now
        line = (f"Tokenizing {self.origin}: {self.documents:,} documents, {self.tokens / 1e6:,.1f}M tokens, "
                f"{self.chars / 1e6:,.0f}M characters, {self.tokens / (now - self.start) / 1e6:.2f}M tokens/s")
        if self.on_terminal:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        else:
            logger.info(line)

    def summary(self, path: Path, workers: int) -> dict[str, Any]:
        if self.on_terminal:
            print(file=sys.stderr)
        seconds = time.perf_counter() - self.start
        rate = self.tokens / max(seconds, 1e-9)
        logger.info(f"Data: tokenized {self.origin} into {path}: {self.documents:,} documents, {self.tokens:,} tokens "
                    f"in {seconds:.1f} s ({rate / 1e6:.2f}M tokens/s, {workers} process(es))")
        return {"seconds": round(seconds, 3), "tokens_per_second": round(rate), "processes": workers}


def store_meta(dtype: np.dtype, num_tokens: int, num_documents: int, tokenizer: Tokenizer, source: dict[str, Any],
               content: str, preparation: dict[str, Any]) -> dict[str, Any]:
    """A store's meta.json (the module docstring lists its fields)."""
    return {"format": STORE_FORMAT, "version": STORE_VERSION, "dtype": dtype.name, "num_tokens": num_tokens,
            "num_documents": num_documents,
            "tokenizer": {"sha256": tokenizer_fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size},
            "source": source, "content_hash": content, "preparation": preparation}


def temporary_folder(out: Path) -> Path:
    """Where this process writes the store `out` before renaming it into place. Named by host and PID, so that a
    later preparation can tell a killed process's leftover from a preparation still running, on this host or on
    another one sharing the filesystem."""
    return out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"


def remove_abandoned(out: Path) -> None:
    """Remove the temporary folders that preparations of `out` on this host left when killed: those whose process is
    gone. Other hosts' folders are kept, since their PIDs can't be checked from here, and so are those of live
    processes (another job preparing the same store)."""
    prefix = f".{out.name}.partial-{socket.gethostname()}-"
    for folder in out.parent.iterdir():
        pid = folder.name.removeprefix(prefix)
        if folder.name.startswith(prefix) and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (signal 0 checks without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


def prepare_store(source: StoreSource, tokenizer: Tokenizer, out: Path, workers: int | None = None) -> TokenStore:
    """Tokenize the documents of `source` into a store at `out`, with `workers` processes (default: every core). A
    folder already at `out` is replaced only once the new store is complete."""
    workers = workers or os.cpu_count() or 1
    temporary = temporary_folder(out)
    dtype = token_dtype(tokenizer.vocab_size)
    description = source.description
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(out)
        shutil.rmtree(temporary, ignore_errors=True)  # a killed process's with this PID, now reused by this one
        temporary.mkdir()
        file_records = description.file_records()  # hashed first: a file changed while tokenizing then shows on resume
        tokens = NpyWriter(temporary / TOKENS_FILE, dtype)
        offsets = NpyWriter(temporary / DOCUMENTS_FILE, np.dtype(np.int64))
        offsets.append(np.zeros(1, dtype=np.int64))
        roles = NpyWriter(temporary / ROLES_FILE, np.dtype(np.uint8)) if description.recipe is not None else None
        progress = Progress(source.origin)
        for chunk in source.encoded(tokenizer, dtype, workers):
            offsets.append(tokens.length + np.cumsum(chunk.lengths))
            tokens.append(chunk.tokens)
            if roles is not None:
                roles.append(chunk.roles)
            progress.add(len(chunk.lengths), len(chunk.tokens), chunk.chars)
        for writer in (tokens, offsets, roles):
            if writer is not None:
                writer.close()
        source_record = {"kind": description.kind, "path": description.path, "split": description.split,
                         "files": file_records}
        if description.recipe is not None:
            source_record["chat"] = description.recipe
        # Chat sources tokenize in this process (titan/data/conversations.py), documents in workers when large.
        processes = workers if roles is None and progress.chars > PARALLEL_FROM_CHARS else 1
        meta = store_meta(dtype, tokens.length, offsets.length - 1, tokenizer, source_record,
                          content_hash(file_records, description, tokenizer_fingerprint(tokenizer)),
                          progress.summary(out, processes))
        if roles is not None:
            meta["roles"] = True
        (temporary / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(temporary, out)
    except OSError as err:
        shutil.rmtree(temporary, ignore_errors=True)
        raise ConfigError(f"Writing the token store {out} failed ({err.strerror or err}); nothing was kept. Free "
                          f"space on that disk or choose another folder (--training.dataset_cache_dir, or "
                          f"`python -m titan.data.prepare --out`).") from err
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return open_store(out, tokenizer)
