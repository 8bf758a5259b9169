"""Token stores made on first use: a job that names text, jsonl, hf or shipped data gets a store of it from a cache
folder, tokenized the first time and reused after.

A cached store is named by its source's kind, split and files (resolved path, size and modification time) and the
tokenizer's fingerprint: editing a file, or another tokenizer, makes a new store; the next run then tokenizes
again. Processes that need the same store at once (the ranks of a node, nodes sharing a filesystem) take a file
lock: the first tokenizes, the others wait and open what it wrote.
"""

import fcntl
import hashlib
import json
import os
from pathlib import Path

from titan.config.errors import ConfigError
from titan.data.store import (
    META_FILE,
    STORE_VERSION,
    StoreSource,
    TokenStore,
    open_store,
    prepare_store,
    tokenizer_fingerprint,
)
from titan.data.tokenizer import Tokenizer
from titan.metrics.log import logger

CACHE_ENV = "TITAN_CACHE_DIR"


def default_cache_dir() -> Path:
    """$TITAN_CACHE_DIR, else $XDG_CACHE_HOME/titan, else ~/.cache/titan; stores go in its token_stores folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "titan"


def cache_dir(configured: str) -> Path:
    """The folder cached stores live in: --training.dataset_cache_dir, or default_cache_dir() when it is empty."""
    return (Path(configured).expanduser() if configured else default_cache_dir()) / "token_stores"


def cache_key(source: StoreSource, tokenizer: Tokenizer) -> str:
    description = source.description
    identity = {"version": STORE_VERSION, "kind": description.kind, "path": description.path,
                "split": description.split, "files": description.file_stamps(),
                "tokenizer": tokenizer_fingerprint(tokenizer)}
    if description.recipe is not None:  # only then: the names of documents' cached stores stay what they were
        identity["recipe"] = description.recipe
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def cached_store_path(source: StoreSource, tokenizer: Tokenizer, folder: Path) -> Path:
    description = source.description
    return folder / f"{description.kind}-{description.split}-{cache_key(source, tokenizer)[:20]}"


def cached_store(source: StoreSource, tokenizer: Tokenizer, folder: Path, prepare: bool = True
                 ) -> TokenStore | None:
    """The store of `source` under `folder`, tokenized now if it is not there yet (or is damaged). Without
    `prepare` nothing is written: None when the store is not there (the dry run)."""
    path = cached_store_path(source, tokenizer, folder)
    if not prepare:
        return open_store(path, tokenizer) if (path / META_FILE).is_file() else None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock_file = open(folder / f".{path.name}.lock", "w")
    except OSError as err:
        raise ConfigError(f"The token store cache {folder} can't be written ({err.strerror}). Set "
                          f"--training.dataset_cache_dir (or ${CACHE_ENV}) to a writable folder.") from err
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if (path / META_FILE).is_file():
            try:
                return open_store(path, tokenizer)
            except ConfigError as err:
                logger.warning(f"{err} Tokenizing it again.")
        return prepare_store(source, tokenizer, path)
