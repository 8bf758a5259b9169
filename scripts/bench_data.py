"""Benchmarks of the data path (docs/performance.md, "Data at scale").

Per-rank cost of a batch at a data-parallel degree: the last rank's time to read its 1 x 8,192 tokens of a global
batch from the shipped corpus's token store (the work the loader's background thread does per step), median of 20
batches after a warm one, one line per degree:

    python scripts/benchmark.py data              # or: python scripts/bench_data.py --per-rank

Preparation throughput (tokens/s with 1 process and with every core, bytes per token) on a generated jsonl corpus:

    python scripts/bench_data.py --prepare [--prepare-mb 200]

Resident memory of a training process on a small store and on a generated store of a few GB (memory-mapped reads
must keep it flat in the corpus size), and the main thread's data wait per step with prefetch:

    python scripts/bench_data.py --memory [--memory-gb 4]
"""

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.job import Training  # noqa: E402
from titan.data.dataset import SHIPPED_CORPUS, read_jsonl_documents  # noqa: E402
from titan.data.loader import RankBatches, build_stream  # noqa: E402
from titan.data.store import (  # noqa: E402
    DOCUMENTS_FILE,
    META_FILE,
    TOKENS_FILE,
    NpyWriter,
    store_meta,
    token_dtype,
)
from titan.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer, build_tokenizer  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402

DEGREES = (1, 8, 64, 256, 1024)
SEQ_LEN = 8192
TIMED_BATCHES = 20


def per_rank_table(degrees: tuple[int, ...] = DEGREES) -> None:
    """The last data-parallel rank's time to make its (inputs, labels) of 1 x SEQ_LEN tokens of one global batch: what
    the loader's background thread does per step (RankBatches.next)."""
    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    # The shipped corpus (554k tokens) wraps around in every global batch from dp 64 on, so each batch would log
    # "starts epochs ..." (about 15 us): a corpus of a real run starts an epoch rarely. Timed without it.
    logging.getLogger("titan").setLevel(logging.WARNING)
    print(f"last rank's read of its 1 x {SEQ_LEN} tokens per global batch, shipped corpus store, median of "
          f"{TIMED_BATCHES} batches after 1 warm one")
    for degree in degrees:
        batches = RankBatches(build_stream(tokenizer, Training(seq_len=SEQ_LEN, local_batch_size=1)), 1, degree - 1,
                              degree)
        batches.next()
        times = []
        for _ in range(TIMED_BATCHES):
            start = time.perf_counter()
            batches.next()
            times.append(time.perf_counter() - start)
        print(f"dp {degree}: {statistics.median(times) * 1e3:.3f} ms per batch")


def generated_jsonl(path: Path, megabytes: int) -> Path:
    """About `megabytes` MB of jsonl: the shipped corpus's documents over and over, each copy numbered so no two
    documents are alike."""
    documents = list(read_jsonl_documents(SHIPPED_CORPUS, "bench"))
    written = 0
    with open(path, "w") as file:
        for copy in range(10**6):
            for document in documents:
                line = json.dumps({"text": f"Copy {copy}. {document}"}) + "\n"
                file.write(line)
                written += len(line)
            if written >= megabytes * 1e6:
                return path
    return path


def prepare_table(megabytes: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source = generated_jsonl(Path(folder) / "corpus.jsonl", megabytes)
        print(f"preparing {source.stat().st_size / 1e6:.0f} MB of jsonl ({os.cpu_count()} cores)")
        for workers in sorted({1, os.cpu_count() or 1}):
            out = Path(folder) / f"store-{workers}"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "titan.data.prepare", "--dataset", "jsonl", "--dataset_path",
                            str(source), "--out", str(out), "--workers", str(workers)], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - start
            meta = json.loads((out / META_FILE).read_text())
            store_bytes = (out / TOKENS_FILE).stat().st_size + (out / DOCUMENTS_FILE).stat().st_size
            print(f"{workers} process(es): {meta['num_tokens'] / seconds / 1e6:.2f}M tokens/s "
                  f"({meta['num_tokens'] / seconds / workers / 1e6:.2f}M per process), {meta['num_tokens']:,} "
                  f"tokens in {seconds:.1f} s (command included), {store_bytes / meta['num_tokens']:.3f} bytes per "
                  f"token on disk")


def random_store(path: Path, tokenizer: Tokenizer, num_tokens: int, document_len: int = 2_000) -> Path:
    """A store of `num_tokens` random token ids in documents of `document_len` (BOS first, EOS last), written
    without tokenizing: to measure reading, not preparing."""
    path.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = NpyWriter(path / TOKENS_FILE, dtype)
    rng = np.random.default_rng(0)
    block = 50 * document_len
    while tokens.length < num_tokens:
        chunk = rng.integers(0, tokenizer.bos_id, size=min(block, num_tokens - tokens.length), dtype=dtype)
        chunk[::document_len] = tokenizer.bos_id
        chunk[document_len - 1 :: document_len] = tokenizer.eos_id
        tokens.append(chunk)
    tokens.close()
    offsets = NpyWriter(path / DOCUMENTS_FILE, np.dtype(np.int64))
    offsets.append(np.append(np.arange(0, num_tokens, document_len), num_tokens))
    offsets.close()
    meta = store_meta(dtype, num_tokens, offsets.length - 1, tokenizer,
                      {"kind": "random", "path": None, "split": "all", "files": []}, f"{num_tokens:064x}", {})
    (path / META_FILE).write_text(json.dumps(meta))
    return path


RSS_WRAPPER = """
import atexit, json, resource, runpy, sys
out, sys.argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs train.py (sys.argv[2], its flags after it) and writes its max resident MB to sys.argv[1] at exit (train.py
ends with exit_process, which runs atexit handlers)."""


def train_and_measure(store: Path, dump: Path, steps: int) -> dict:
    """Max resident memory and the mean data wait of a debug-model run of `steps` steps on `store`, each step
    logged; the first step, whose wait includes starting the loader, is left out."""
    rss_file = dump.parent / f"{dump.name}.rss"
    subprocess.run([sys.executable, "-c", RSS_WRAPPER, str(rss_file), str(ROOT / "train.py"), "--job.config_file",
                    str(ROOT / "configs/debug_model.toml"), "--job.dump_folder", str(dump), "--training.dataset",
                    "prepared", "--training.dataset_path", str(store), "--training.steps", str(steps),
                    "--metrics.log_freq", "1"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "data_wait_pct" in r and r["step"] > 1]
    return {"data_wait_pct": statistics.mean(r["data_wait_pct"] for r in timed),
            "max_rss_mb": json.loads(rss_file.read_text())}


def memory_table(gigabytes: float, steps: int) -> None:
    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    with tempfile.TemporaryDirectory() as folder:
        for name, num_tokens in (("small", 2_000_000), ("large", int(gigabytes * 1e9 / 2))):
            store = random_store(Path(folder) / name, tokenizer, num_tokens)
            result = train_and_measure(store, Path(folder) / f"run-{name}", steps)
            size = (store / TOKENS_FILE).stat().st_size / 1e6
            print(f"{name} store, {size:,.0f} MB: max resident {result['max_rss_mb']:,.0f} MB, main thread waits "
                  f"{result['data_wait_pct']:.2f}% of each step for data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-rank", action="store_true", help="per-rank read time at each data-parallel degree")
    parser.add_argument("--prepare", action="store_true", help="preparation throughput on 1 and every core")
    parser.add_argument("--prepare-mb", type=int, default=200, help="size of the generated corpus to prepare")
    parser.add_argument("--memory", action="store_true", help="resident memory: small against large store")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="size of the large generated store")
    parser.add_argument("--steps", type=int, default=30, help="training steps per --memory run")
    args = parser.parse_args()
    if args.memory and args.steps < 2:
        parser.error(f"--steps {args.steps}: --memory times the steps after the first, so it needs at least 2")
    init_logger()
    if args.per_rank:
        per_rank_table()
    if args.prepare:
        prepare_table(args.prepare_mb)
    if args.memory:
        memory_table(args.memory_gb, args.steps)


if __name__ == "__main__":
    main()
