"""Documents in, packed token windows out.

Sources, chosen by --training.dataset:
  shipped  titan/data/corpus/stdlib_docs.jsonl.gz: Python's reference docs and stdlib docstrings (PSF licence).
  text     UTF-8 files named by --training.dataset_path: a file, a folder (every non-hidden file under it) or a
           glob. Blank lines separate documents, so even a single large file spreads over data-parallel ranks.
  jsonl    .jsonl or .jsonl.gz files named the same way (a folder: the files with those suffixes); the "text"
           field of each line is one document.
  hf       a Hugging Face dataset name or folder, streamed by `datasets` (the `hf` extra); its "text" column.

Local documents are numbered across the sorted file list and data-parallel rank r of W reads documents
r, r + W, r + 2W, ...; hf shards with `datasets.distributed.split_dataset_by_node`. Each document becomes
BOS + tokens + EOS; the documents are concatenated and cut into windows of seq_len + 1 tokens that do not
overlap, and a window gives (inputs, labels) = (window[:-1], window[1:]). The stream repeats forever, one epoch
per pass over the shard. Its state is the position of the next unused token (epoch, document, token offset),
so a resumed stream yields exactly the windows an uninterrupted one would have.
"""

import glob
import gzip
import itertools
import json
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import IterableDataset

from titan.config.errors import ConfigError
from titan.config.job import Training
from titan.config.paths import PROJECT_ROOT, resolve_path
from titan.data.tokenizer import Tokenizer
from titan.metrics.log import logger

SHIPPED_CORPUS = Path(__file__).resolve().parent / "corpus" / "stdlib_docs.jsonl.gz"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
JSONL_FORMAT = 'one JSON object per line with the document in its "text" field'


def read_text_documents(path: Path, origin: str) -> Iterator[str]:
    """The blank-line-separated documents of a UTF-8 text file, each without its trailing newline.
    `origin` names the flag that led here, for error messages."""
    lines: list[str] = []
    try:
        with open(path, encoding="utf-8") as file:
            for line in file:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
    except UnicodeDecodeError as err:
        raise ConfigError(f"{origin}: {path} is not UTF-8 text ({err.reason}). Convert it to UTF-8 or leave it "
                          f"out.") from err
    except OSError as err:
        raise ConfigError(f"{origin}: {path} can't be read ({err.strerror}). Check the path and the file's "
                          f"permissions.") from err
    if lines:
        yield "".join(lines).rstrip("\n")


def read_jsonl_documents(path: Path, origin: str) -> Iterator[str]:
    """The "text" field of each line of a .jsonl or .jsonl.gz file (gzip is told by the .gz suffix)."""
    line_number = 0
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz")
              else open(path, encoding="utf-8")) as file:
            for line_number, line in enumerate(file, start=1):
                if line.strip():
                    yield jsonl_text(line, path, line_number, origin)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        # gzip.BadGzipFile is an OSError; a truncated .gz raises EOFError.
        where = f" past line {line_number}" if line_number else ""
        raise ConfigError(f"{origin}: {path} can't be read{where} ({err}). Expected {JSONL_FORMAT}, in UTF-8, "
                          f"optionally gzip-compressed.") from err


def jsonl_text(line: str, path: Path, line_number: int, origin: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{origin}: {path} line {line_number} is not valid JSON ({err.msg}). Expected "
                          f"{JSONL_FORMAT}.") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ConfigError(f'{origin}: {path} line {line_number} has no string "text" field. Expected '
                          f"{JSONL_FORMAT}.")
    return text


def read_documents(path: Path, origin: str) -> Iterator[str]:
    """Documents of one file, read as jsonl when its name ends in .jsonl or .jsonl.gz, else as text."""
    if path.name.endswith(JSONL_SUFFIXES):
        return read_jsonl_documents(path, origin)
    return read_text_documents(path, origin)


def find_files(dataset_path: str, dataset: str) -> list[Path]:
    """The files `dataset_path` names (a file, a folder or a glob), sorted so every rank sees one order."""
    resolved = resolve_path(dataset_path)
    if resolved.is_file():
        return [resolved]
    if resolved.is_dir():
        files = sorted(p for p in resolved.rglob("*") if p.is_file() and wanted_in_folder(p.relative_to(resolved),
                                                                                          dataset))
        kind = "non-hidden" if dataset == "text" else "*.jsonl or *.jsonl.gz"
        if not files:
            raise ConfigError(f"--training.dataset_path {dataset_path!r} is a folder with no {kind} files. Put the "
                              f"data there or point at another folder.")
        return files
    if any(c in dataset_path for c in "*?["):
        files = sorted(p for p in glob_paths(dataset_path) if p.is_file())
        if not files:
            raise ConfigError(f"--training.dataset_path {dataset_path!r} is a glob that matches no file. Check the "
                              f"pattern, and quote it so the shell leaves it alone.")
        return files
    raise ConfigError(f"--training.dataset_path {dataset_path!r} does not exist (looked in the working directory "
                      f"and the project root). Give a file, a folder or a glob.")


def wanted_in_folder(relative: Path, dataset: str) -> bool:
    if any(part.startswith(".") for part in relative.parts):
        return False  # .git, editor swap files and the like are not data
    return dataset == "text" or relative.name.endswith(JSONL_SUFFIXES)


def glob_paths(pattern: str) -> list[Path]:
    """Matches of `pattern` in the working directory, else (for a relative pattern) in the project root."""
    matches = glob.glob(pattern, recursive=True)
    if not matches and not Path(pattern).is_absolute():
        return [PROJECT_ROOT / m for m in glob.glob(pattern, root_dir=PROJECT_ROOT, recursive=True)]
    return [Path(m) for m in matches]


class DocumentSource(Protocol):
    origin: str
    """The flag and value the documents come from, for error messages."""

    def shard(self, dp_rank: int, dp_world_size: int) -> Iterator[str]:
        """This rank's documents in a fixed order; a new call starts again from the first."""
        ...


@dataclass(frozen=True)
class LocalDocuments:
    files: list[Path]
    read: Callable[[Path, str], Iterator[str]]
    origin: str

    def shard(self, dp_rank: int, dp_world_size: int) -> Iterator[str]:
        documents = (document for path in self.files for document in self.read(path, self.origin))
        return itertools.islice(documents, dp_rank, None, dp_world_size)


class HuggingFaceDocuments:
    """The "text" column of a streamed Hugging Face dataset's train split."""

    def __init__(self, name: str) -> None:
        self.origin = f"--training.dataset_path {name!r}"
        try:
            import datasets
        except ImportError:
            raise ConfigError("--training.dataset hf needs the `datasets` package, which is not installed. Run "
                              "`pip install titan[hf]`, or use --training.dataset jsonl with local files.") from None
        try:
            self._dataset = datasets.load_dataset(name, split="train", streaming=True)
        except (OSError, ValueError) as err:  # DatasetNotFoundError is a FileNotFoundError
            raise ConfigError(f"--training.dataset_path {name!r} could not be opened as a Hugging Face dataset "
                              f"({err}). Check the name, or download it and give the local folder.") from err

    def shard(self, dp_rank: int, dp_world_size: int) -> Iterator[str]:
        from datasets.distributed import split_dataset_by_node

        rows = split_dataset_by_node(self._dataset, rank=dp_rank, world_size=dp_world_size)
        for row_number, row in enumerate(rows):
            text = row.get("text")
            if not isinstance(text, str):
                raise ConfigError(f'{self.origin}: row {row_number} of rank {dp_rank}\'s shard has no string "text" '
                                  f"column (columns: {', '.join(sorted(row))}). Use a dataset with a text column.")
            yield text


def build_document_source(training: Training) -> DocumentSource:
    if training.dataset == "shipped":
        return LocalDocuments([SHIPPED_CORPUS], read_jsonl_documents, "--training.dataset shipped")
    assert training.dataset_path is not None, "config/validate.py requires --training.dataset_path here"
    if training.dataset == "hf":
        return HuggingFaceDocuments(training.dataset_path)
    read = read_text_documents if training.dataset == "text" else read_jsonl_documents
    return LocalDocuments(find_files(training.dataset_path, training.dataset), read,
                          f"--training.dataset_path {training.dataset_path!r}")


class Position(NamedTuple):
    """Where the next window starts: `token_offset` tokens into document `document_index` (counted in this
    rank's shard, BOS included) of pass `epoch` (0 is the first pass)."""

    epoch: int
    document_index: int
    token_offset: int


@dataclass
class Segment:
    """A document's tokens, of which the first `start` are already in earlier windows."""

    epoch: int
    document_index: int
    tokens: list[int]
    start: int


class PackedTokenDataset(IterableDataset):
    """Endless (inputs, labels) pairs of int64 tensors of shape (seq_len,) from this rank's documents."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, dp_rank: int,
                 dp_world_size: int) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._position = Position(epoch=0, document_index=0, token_offset=0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window_len = self.seq_len + 1
        pending: deque[Segment] = deque()
        num_pending = 0
        for segment in self._segments():
            pending.append(segment)
            num_pending += len(segment.tokens) - segment.start
            while num_pending >= window_len:
                window = torch.tensor(take_tokens(pending, window_len), dtype=torch.long)  # (seq_len + 1,)
                num_pending -= window_len
                if pending:
                    front = pending[0]
                    self._position = Position(front.epoch, front.document_index, front.start)
                else:
                    self._position = Position(segment.epoch, segment.document_index + 1, 0)
                yield window[:-1], window[1:]

    def _segments(self) -> Iterator[Segment]:
        """Tokenized documents from the current position on, epoch after epoch."""
        epoch, first_document, offset = self._position
        while True:
            from_start = first_document == 0 and offset == 0
            if from_start:
                logger.info(f"Data: epoch {epoch} starts ({self.source.origin}, data-parallel rank {self.dp_rank} "
                            f"of {self.dp_world_size})")
            num_documents = num_tokens = 0
            documents = itertools.islice(self.source.shard(self.dp_rank, self.dp_world_size), first_document, None)
            for document_index, text in enumerate(documents, start=first_document):
                if not text:
                    continue  # BOS + EOS alone would teach nothing
                tokens = self.tokenizer.encode(text, bos=True, eos=True)
                num_documents += 1
                num_tokens += len(tokens)
                yield Segment(epoch, document_index, tokens, offset)
                offset = 0
            if from_start:
                self._check_epoch(num_documents, num_tokens)
            epoch, first_document, offset = epoch + 1, 0, 0

    def _check_epoch(self, num_documents: int, num_tokens: int) -> None:
        """A shard without a full window per pass would only ever repeat itself inside one sequence."""
        shard = "" if self.dp_world_size == 1 else f" for data-parallel rank {self.dp_rank} of {self.dp_world_size}"
        if num_documents == 0:
            hint = " (fewer documents than data-parallel ranks?)" if self.dp_world_size > 1 else ""
            raise ConfigError(f"{self.source.origin} has no documents with text{shard}{hint}. Point it at "
                              f"non-empty data.")
        if num_tokens < self.seq_len + 1:
            raise ConfigError(f"{self.source.origin} has only {num_tokens} tokens{shard} per epoch, but one sequence "
                              f"needs --training.seq_len {self.seq_len} + 1 = {self.seq_len + 1}. Lower "
                              f"--training.seq_len or add more data.")

    def position(self) -> dict[str, int]:
        """Where the next window starts, as plain JSON-able values (for anomaly records)."""
        return self._position._asdict()

    def state_dict(self) -> dict[str, Any]:
        return self._position._asdict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._position = Position(**state_dict)


def take_tokens(pending: deque[Segment], count: int) -> list[int]:
    """Remove and return the next `count` tokens from the front of `pending`, which holds at least that many."""
    tokens: list[int] = []
    while len(tokens) < count:
        segment = pending[0]
        end = min(segment.start + count - len(tokens), len(segment.tokens))
        tokens.extend(segment.tokens[segment.start : end])
        segment.start = end
        if end == len(segment.tokens):
            pending.popleft()
    return tokens
