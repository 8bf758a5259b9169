"""Token stores: the format (read back with numpy alone), tokenizing on every core, the cache made on first use, the
prepare command and --training.dataset prepared, and every way a store can be bad."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titan.config.errors import ConfigError
from titan.config.job import Training
from titan.data import store as store_module
from titan.data.cache import cache_dir, cached_store
from titan.data.dataset import build_document_source
from titan.data.loader import build_stream
from titan.data.store import HEADER_BYTES, open_store, prepare_store
from titan.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer
from titan.estimate.data_cost import data_report_lines, measure_data_cost

from harness.documents import write_jsonl

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The first document.", "", "A second one, longer than the first by a few words.",
         "Third: \u00e9t\u00e9 \u2603."]


def jsonl_source(path: Path):
    return build_document_source("jsonl", str(path), "--training.dataset", "--training.dataset_path")


def prepared(tmp_path: Path, tokenizer: Tokenizer, texts: list[str] = TEXTS, workers: int = 1) -> Path:
    source = jsonl_source(write_jsonl(tmp_path / "d.jsonl", texts))
    out = tmp_path / "store"
    prepare_store(source, tokenizer, out, workers)
    return out


def test_store_is_plain_numpy_documents_and_tokens(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A reader needs numpy and meta.json, not Titan: document d is tokens[documents[d]:documents[d + 1]], each
    BOS + text + EOS, empty documents left out."""
    out = prepared(tmp_path, tokenizer)
    tokens = np.load(out / "tokens.npy", mmap_mode="r")
    documents = np.load(out / "documents.npy")
    meta = json.loads((out / "meta.json").read_text())
    non_empty = [text for text in TEXTS if text]
    assert tokens.dtype == np.uint16 and documents.dtype == np.int64 and len(documents) == len(non_empty) + 1
    for d, text in enumerate(non_empty):
        assert tokens[documents[d] : documents[d + 1]].tolist() == tokenizer.encode(text, bos=True, eos=True)
    assert meta["num_tokens"] == len(tokens) and meta["num_documents"] == len(non_empty)
    assert meta["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    assert meta["source"]["files"][0]["sha256"] == store_module.file_sha256(tmp_path / "d.jsonl")
    assert not list(tmp_path.glob(".store.partial-*"))


def test_large_vocabularies_take_uint32() -> None:
    assert store_module.token_dtype(65_536) == np.uint16 and store_module.token_dtype(128_256) == np.uint32
    header = store_module.npy_header(np.dtype(np.uint32), 12_345_678_901)
    assert len(header) == HEADER_BYTES


def test_worker_processes_tokenize_like_one_process(tmp_path: Path, tokenizer: Tokenizer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The parallel path (spawned processes, chunks in flight) writes exactly the one-process store."""
    texts = [f"document {i}: " + "lorem ipsum dolor " * (i % 7) for i in range(300)]
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = prepared(tmp_path / "one", tokenizer, texts)
    monkeypatch.setattr(store_module, "CHUNK_CHARS", 500)
    monkeypatch.setattr(store_module, "PARALLEL_FROM_CHARS", 1_000)
    many = prepared(tmp_path / "many", tokenizer, texts, workers=2)
    for name in ("tokens.npy", "documents.npy"):
        assert (one / name).read_bytes() == (many / name).read_bytes()
    assert json.loads((many / "meta.json").read_text())["preparation"]["processes"] == 2


def test_cache_tokenizes_once_and_again_when_the_source_changes(tmp_path: Path, tokenizer: Tokenizer,
                                                                titan_records: list[logging.LogRecord]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    folder = cache_dir(str(tmp_path / "cache"))
    first = cached_store(jsonl_source(path), tokenizer, folder)
    again = cached_store(jsonl_source(path), tokenizer, folder)
    assert again.path == first.path
    assert sum("Data: tokenized" in r.getMessage() for r in titan_records) == 1
    write_jsonl(path, TEXTS[:2])
    os.utime(path, ns=(1, 1))  # a new modification time, whatever the clock's resolution
    changed = cached_store(jsonl_source(path), tokenizer, folder)
    assert changed.path != first.path and changed.content_hash != first.content_hash
    assert sum("Data: tokenized" in r.getMessage() for r in titan_records) == 2


def test_damaged_cached_store_is_made_again(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    folder = cache_dir(str(tmp_path / "cache"))
    store = cached_store(jsonl_source(path), tokenizer, folder)
    tokens = store.tokens.tolist()
    with open(store.path / "tokens.npy", "r+b") as file:
        file.truncate(HEADER_BYTES + 4)
    assert cached_store(jsonl_source(path), tokenizer, folder).tokens.tolist() == tokens


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "tokens.npy").write_bytes((out / "tokens.npy").read_bytes()[:-6]), "truncated or overwritten"),
    (lambda out: (out / "documents.npy").unlink(), "documents.npy is missing"),
    (lambda out: (out / "meta.json").unlink(), "meta.json is missing"),
    (lambda out: (out / "meta.json").write_text("{"), "meta.json can't be read"),
], ids=["truncated", "no-index", "no-meta", "bad-meta"])
def test_bad_store_is_a_config_error_naming_it(tmp_path: Path, tokenizer: Tokenizer, damage, message: str) -> None:
    out = prepared(tmp_path, tokenizer)
    damage(out)
    with pytest.raises(ConfigError, match=message) as err:
        open_store(out, tokenizer)
    assert str(out) in str(err.value) and "python -m titan.data.prepare" in str(err.value)


def test_store_of_another_tokenizer(tmp_path: Path, tokenizer: Tokenizer) -> None:
    out = prepared(tmp_path, tokenizer)
    other = Tokenizer(dict(list(tokenizer.mergeable_ranks.items())[:1000]), "smaller")
    with pytest.raises(ConfigError, match=r"another tokenizer \(vocabulary 2256.*than --model\.tokenizer_path's "
                                          r"\(vocabulary 1002"):
        open_store(out, other)


def test_tiktoken_fingerprint_is_unchanged(tokenizer: Tokenizer) -> None:
    """The shipped tokenizer's fingerprint, as stores and checkpoints made before tokenizer.json support recorded
    it (meta.json, content_hash): a change would make every cached store be tokenized again and every data
    position in a checkpoint be refused on resume."""
    assert store_module.tokenizer_fingerprint(tokenizer) == \
        "c95c110dde0257b593a80f42f8c2a99a8d424268ede255e6dfbc841bce034949"


def test_prepared_dataset_trains_and_notices_a_changed_source(tmp_path: Path, tokenizer: Tokenizer) -> None:
    out = prepared(tmp_path, tokenizer, TEXTS * 20)
    training = Training(dataset="prepared", dataset_path=str(out), seq_len=16)
    stream = build_stream(tokenizer, training)
    assert stream.sources[0].store.path == out and stream.take(2).tokens.shape == (2, 17)
    write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(ConfigError, match=r"its source changed since it was prepared \(.*d\.jsonl\)"):
        build_stream(tokenizer, training)


def write_limited(tmp_path: Path, limit_bytes: int) -> subprocess.CompletedProcess:
    """Prepare a store of the shipped corpus in a process whose files may not grow past `limit_bytes`, as on a
    full disk (the write fails with an OSError: EFBIG here, ENOSPC there; both take the same path)."""
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))
from titan.data.prepare import main
sys.exit(main(["--dataset", "shipped", "--out", "{tmp_path / 'store'}", "--workers", "1"]))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_full_disk_leaves_nothing_and_exits_2(tmp_path: Path) -> None:
    result = write_limited(tmp_path, 100_000)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"Writing the token store {tmp_path / 'store'} failed (File too large); nothing was kept. Free space" \
        in output
    assert list(tmp_path.iterdir()) == []  # no store, no partial folder


def test_interrupted_preparation_is_never_used(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A preparation killed mid-way leaves only its temporary folder; the store's name appears only when complete,
    and the next preparation replaces the leftover."""
    code = f"""
import os, signal
from titan.data import store
real = store.NpyWriter.close
def killed(self):
    real(self)
    os.kill(os.getpid(), signal.SIGKILL)
store.NpyWriter.close = killed
from titan.data.prepare import main
main(["--dataset", "shipped", "--out", "{tmp_path / 'store'}"])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert not (tmp_path / "store").exists() and len(list(tmp_path.glob(".store.partial-*"))) == 1
    with pytest.raises(ConfigError, match="no such folder"):
        open_store(tmp_path / "store", tokenizer)
    source = build_document_source("shipped", None, "--training.dataset", "--training.dataset_path")
    prepare_store(source, tokenizer, tmp_path / "store", 1)
    assert open_store(tmp_path / "store", tokenizer).meta["num_documents"] > 300
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # the killed process's folder is gone


def test_next_preparation_removes_the_leftovers_of_dead_processes_only(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Temporary folders are named by host and PID: the next preparation of the store removes those of this host's
    processes that are gone, and leaves a running one's (another job preparing the same store) and another host's,
    whose PIDs can't be checked from here (a filesystem shared by nodes)."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its PID names no process now
    host = socket.gethostname()
    dead_leftover = f".store.partial-{host}-{dead.pid}"
    kept = [f".store.partial-{host}-{os.getppid()}",  # a running process's: pytest's parent
            f".store.partial-other-{host}-{dead.pid}",  # another host's (named other-<this host>)
            f".other.partial-{host}-{dead.pid}"]  # another store's, left to that store's next preparation
    for name in [dead_leftover, *kept]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokens.npy").write_bytes(b"half")
    prepared(tmp_path, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d.jsonl", "store", *kept])


def test_prepare_command(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS * 10)
    result = subprocess.run([sys.executable, "-m", "titan.data.prepare", "--dataset", "jsonl", "--dataset_path",
                             str(path), "--out", str(tmp_path / "store")], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'store'}: 30 documents" in result.stdout and "bytes per token" in result.stdout
    assert "Data: tokenized --dataset_path" in result.stderr + result.stdout
    missing = subprocess.run([sys.executable, "-m", "titan.data.prepare", "--dataset", "jsonl", "--dataset_path",
                              str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x")], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "--dataset_path" in missing.stderr + missing.stdout


def test_dry_run_measures_the_rank_data_cost_on_the_job_stores_or_a_sample(tmp_path: Path,
                                                                           tokenizer: Tokenizer) -> None:
    """The dry run never tokenizes: a store not made yet, or data not on this machine, is stood in for by a sample;
    once made, the rank's reads are timed on the job's own store."""
    training = Training(dataset="jsonl", dataset_path=str(write_jsonl(tmp_path / "d.jsonl", TEXTS * 50)), seq_len=32,
                        local_batch_size=2, dataset_cache_dir=str(tmp_path / "cache"))
    before = measure_data_cost(training, SHIPPED_TOKENIZER, dp_rank=3, dp_degree=4, micro_batches=2)
    assert before.measured_on == "a sample store: the job's data is not tokenized on this machine yet"
    assert not (tmp_path / "cache").exists()
    build_stream(tokenizer, training)
    cost = measure_data_cost(training, SHIPPED_TOKENIZER, dp_rank=3, dp_degree=4, micro_batches=2)
    assert cost.measured_on == "the job's token stores" and 0 < cost.seconds_per_step < 0.1
    hub = measure_data_cost(Training(dataset="hf", dataset_path="org/set", seq_len=32), SHIPPED_TOKENIZER, 0, 8, 1)
    assert hub.measured_on.startswith("a sample store: the job's data is not usable here")
    assert measure_data_cost(training, "missing.tiktoken", 0, 1, 1).measured_on.endswith("tokenizer is not on this "
                                                                                          "machine")
    assert cost.keeps_up(0.5) and not cost.keeps_up(cost.seconds_per_step / 2)
    [_, line] = data_report_lines(cost, step_s=cost.seconds_per_step / 2)
    assert line.endswith("does NOT keep up: batches would arrive slower than steps")
