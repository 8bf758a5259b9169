"""Documents in: the sources a job reads, before they are tokenized into token stores (titan/data/store.py).

Sources, chosen by --training.dataset (several at once, weighted, by --training.mixture: titan/data/stream.py):
  shipped  titan/data/corpus/stdlib_docs.jsonl.gz: Python's reference docs and stdlib docstrings (PSF licence).
           1 in HELD_OUT_EVERY documents are held out: training never reads them, --validation.dataset shipped
           reads only them.
  text     UTF-8 files named by --training.dataset_path: a file, a folder (every non-hidden file under it) or a
           glob. Blank lines separate documents.
  jsonl    .jsonl or .jsonl.gz files named the same way (a folder: the files with those suffixes); the "text"
           field of each line is one document.
  hf       a Hugging Face dataset, streamed by `datasets` (the `hf` extra) once, to tokenize it; its "text" column.
           A local folder is tokenized on first use; a hub dataset with `python -m titan.data.prepare`.
  prepared a token store made by `python -m titan.data.prepare` (its folder in --training.dataset_path).

Local documents are read in the order of the sorted file list. Each source is tokenized once into a token store
(titan/data/cache.py finds or makes it); training then reads windows of token ids from the store
(titan/data/stream.py).
"""

import glob
import gzip
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from titan.config.errors import ConfigError
from titan.config.paths import PROJECT_ROOT, resolve_path
from titan.data.store import EncodedChunk, SourceDescription, StoreSource, encoded_chunks
from titan.data.tokenizer import Tokenizer

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


def read_jsonl_records(path: Path, origin: str, expected: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of each non-blank line of a .jsonl or .jsonl.gz file (gzip is told by the .gz suffix), `where`
    naming the line for error messages. `expected` describes the format the file should have, for errors."""
    line_number = 0
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz")
              else open(path, encoding="utf-8")) as file:
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                where = f"{origin}: {path} line {line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where} is not valid JSON ({err.msg}). Expected {expected}.") from None
                yield where, record
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        # gzip.BadGzipFile is an OSError; a truncated .gz raises EOFError.
        where = f" past line {line_number}" if line_number else ""
        raise ConfigError(f"{origin}: {path} can't be read{where} ({err}). Expected {expected}, in UTF-8, "
                          f"optionally gzip-compressed.") from err


def read_jsonl_documents(path: Path, origin: str) -> Iterator[str]:
    """The "text" field of each line of a .jsonl or .jsonl.gz file."""
    for where, record in read_jsonl_records(path, origin, JSONL_FORMAT):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f'{where} has no string "text" field. Expected {JSONL_FORMAT}.')
        yield text


def read_documents(path: Path, origin: str) -> Iterator[str]:
    """Documents of one file, read as jsonl when its name ends in .jsonl or .jsonl.gz, else as text."""
    if path.name.endswith(JSONL_SUFFIXES):
        return read_jsonl_documents(path, origin)
    return read_text_documents(path, origin)


def find_files(dataset_path: str, dataset: str, flag: str) -> list[Path]:
    """The files `dataset_path` names (a file, a folder or a glob), sorted so every rank sees one order. `flag`
    names where the path was given, for error messages."""
    resolved = resolve_path(dataset_path)
    if resolved.is_file():
        return [resolved]
    if resolved.is_dir():
        files = sorted(p for p in resolved.rglob("*") if p.is_file() and wanted_in_folder(p.relative_to(resolved),
                                                                                          dataset))
        kind = "non-hidden" if dataset == "text" else "*.jsonl or *.jsonl.gz"
        if not files:
            raise ConfigError(f"{flag} {dataset_path!r} is a folder with no {kind} files. Put the data there or "
                              f"point at another folder.")
        return files
    if any(c in dataset_path for c in "*?["):
        files = sorted(p for p in glob_paths(dataset_path) if p.is_file())
        if not files:
            raise ConfigError(f"{flag} {dataset_path!r} is a glob that matches no file. Check the pattern, and "
                              f"quote it so the shell leaves it alone.")
        return files
    raise ConfigError(f"{flag} {dataset_path!r} does not exist (looked in the working directory and the project "
                      f"root). Give a file, a folder or a glob.")


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


class DocumentSource(StoreSource, Protocol):
    """A source of text documents."""

    def documents(self) -> Iterator[str]:
        """Every document in a fixed order; a new call starts again from the first."""
        ...


HELD_OUT_EVERY = 20
"""One in this many documents of the shipped corpus is held out for validation (19 of its 404 documents, about 22k
tokens: a few global batches of the debug job). Training never reads them, whether or not validation is on, so
turning validation on cannot change a run's losses."""


def is_held_out(text: str) -> bool:
    """Whether a shipped document belongs to the validation split. A CRC-32 of its text rather than its position
    keeps the split fixed when documents are added or reordered, and rather than hash() it is the same in every
    process (Python salts str hashes per process)."""
    return zlib.crc32(text.encode("utf-8")) % HELD_OUT_EVERY == 0


def is_training_document(text: str) -> bool:
    return not is_held_out(text)


@dataclass(frozen=True)
class LocalDocuments:
    files: list[Path]
    read: Callable[[Path, str], Iterator[str]]
    origin: str
    description: SourceDescription
    keep: Callable[[str], bool] | None = None
    """Which documents to read, for the shipped corpus's training and validation splits; None: all."""

    def documents(self) -> Iterator[str]:
        documents = (document for path in self.files for document in self.read(path, self.origin))
        return documents if self.keep is None else filter(self.keep, documents)

    def encoded(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[EncodedChunk]:
        return encoded_chunks(self.documents(), tokenizer, dtype, workers)


class HuggingFaceDocuments:
    """The "text" column of a streamed Hugging Face dataset's train split."""

    def __init__(self, name: str, dataset_flag: str, path_flag: str) -> None:
        self.origin = f"{path_flag} {name!r}"
        self.description = SourceDescription("hf", name, "all", hf_folder_files(name))
        self._dataset = stream_hf_dataset(name, self.origin, f"{dataset_flag} hf",
                                          f"use {dataset_flag} jsonl with local files")

    def documents(self) -> Iterator[str]:
        for row_number, row in enumerate(self._dataset):
            text = row.get("text")
            if not isinstance(text, str):
                raise ConfigError(f'{self.origin}: row {row_number} has no string "text" column (columns: '
                                  f"{', '.join(sorted(row))}). Use a dataset with a text column.")
            yield text

    def encoded(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[EncodedChunk]:
        return encoded_chunks(self.documents(), tokenizer, dtype, workers)


def hf_folder_files(name: str) -> tuple[Path, ...]:
    """The files of a Hugging Face dataset's local folder, hashed like other local files; none for a hub dataset,
    which is known by its name alone."""
    folder = resolve_path(name)
    if not folder.is_dir():
        return ()
    return tuple(sorted(p for p in folder.rglob("*") if p.is_file() and wanted_in_folder(p.relative_to(folder),
                                                                                          "text")))


def stream_hf_dataset(name: str, origin: str, needs: str, instead: str) -> Iterable[dict[str, Any]]:
    """The train split of the Hugging Face dataset `name` (a hub name or a local folder), streamed. `origin` names
    it in errors, `needs` says what needs the `datasets` package, and `instead` what to use without it."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{needs} needs the `datasets` package, which is not installed. Run `pip install "
                          f"titan[hf]`, or {instead}.") from None
    try:
        return datasets.load_dataset(name, split="train", streaming=True)
    except (OSError, ValueError) as err:  # DatasetNotFoundError is a FileNotFoundError
        raise ConfigError(f"{origin} could not be opened as a Hugging Face dataset ({err}). Check the name, or "
                          f"download it and give the local folder.") from err


def build_document_source(dataset: str, dataset_path: str | None, dataset_flag: str, path_flag: str,
                          held_out: bool = False) -> DocumentSource:
    """The documents of `dataset` (shipped, text, jsonl, hf) at `dataset_path`. `dataset_flag` and `path_flag` name
    the flags they came from in error messages ("--training.dataset", "--training.dataset_path"); `held_out` picks
    the shipped corpus's validation documents instead of its training documents."""
    if dataset == "shipped":
        split = "held_out" if held_out else "train"
        description = SourceDescription("shipped", None, split, (SHIPPED_CORPUS,))
        keep = is_held_out if held_out else is_training_document
        return LocalDocuments([SHIPPED_CORPUS], read_jsonl_documents, f"{dataset_flag} shipped", description, keep)
    assert dataset_path is not None, "titan/data/rules.py requires a dataset path here"
    if dataset == "hf":
        return HuggingFaceDocuments(dataset_path, dataset_flag, path_flag)
    read = read_text_documents if dataset == "text" else read_jsonl_documents
    files = find_files(dataset_path, dataset, path_flag)
    return LocalDocuments(files, read, f"{path_flag} {dataset_path!r}",
                          SourceDescription(dataset, dataset_path, "all", tuple(files)))


def hub_dataset_problem(dataset_flag: str, path_flag: str, name: str) -> str:
    """Hub datasets are too large to tokenize on a job's first start: they are prepared once, on their own."""
    return (f"{dataset_flag} hf {path_flag} {name!r} is not a local folder: a dataset from the Hugging Face hub is "
            f"tokenized once, before training, with `python -m titan.data.prepare --dataset hf --dataset_path {name} "
            f"--out STORE` (needs the `hf` extra and the network), then trained on with --training.dataset prepared "
            f"--training.dataset_path STORE.")
