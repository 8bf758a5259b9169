"""Tokenize a corpus once into a token store (titan/data/store.py), on every core, for --training.dataset prepared:

    python -m titan.data.prepare --dataset jsonl --dataset_path data/web/ --out /data/stores/web
    ./run_train.sh --training.dataset prepared --training.dataset_path /data/stores/web

Jobs that name text, jsonl, hf or shipped data get the same store made on first use in a cache folder; this command
is for corpora large enough that preparing them is a step of its own (on a machine with many cores, to a shared
filesystem). Errors exit with code 2 and say what to fix.
"""

import argparse
import os
import sys
from pathlib import Path

from titan.config.errors import ConfigError
from titan.config.job import Chat
from titan.data.dataset import build_document_source
from titan.data.loader import build_conversation_source
from titan.data.store import StoreSource, prepare_store
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer
from titan.exits import run_main
from titan.metrics.log import init_logger


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titan.data.prepare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["shipped", "text", "jsonl", "hf", "chat"], required=True,
                        help="the source, as --training.dataset names it")
    parser.add_argument("--dataset_path",
                        help="its files, folder or glob (text, jsonl, chat), or dataset name or folder (hf, chat)")
    parser.add_argument("--held_out", action="store_true",
                        help="shipped only: the held-out validation documents instead of the training ones")
    parser.add_argument("--tokenizer_path", default=SHIPPED_TOKENIZER, help="as --model.tokenizer_path")
    parser.add_argument("--template_path", default="", help="chat only: as --chat.template_path")
    parser.add_argument("--messages_field", default="messages", help="chat only: as --chat.messages_field")
    parser.add_argument("--out", required=True, type=Path, help="the store's folder (replaced once complete)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> None:
    if args.dataset != "shipped" and args.dataset_path is None:
        raise ConfigError(f"--dataset {args.dataset} needs --dataset_path.")
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} must be at least 1.")
    tokenizer = build_tokenizer(args.tokenizer_path)
    source: StoreSource
    if args.dataset == "chat":
        chat = Chat(template_path=args.template_path, messages_field=args.messages_field)
        source = build_conversation_source(args.dataset_path, "--dataset_path", tokenizer, chat)
    else:
        source = build_document_source(args.dataset, args.dataset_path, "--dataset", "--dataset_path",
                                       held_out=args.held_out)
    store = prepare_store(source, tokenizer, args.out, args.workers)
    meta = store.meta
    bytes_per_token = (store.tokens.nbytes + store.documents.nbytes) / max(meta["num_tokens"], 1)
    print(f"{store.path}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens, "
          f"{bytes_per_token:.3f} bytes per token, {meta['preparation']['tokens_per_second']:,} tokens/s on "
          f"{meta['preparation']['processes']} process(es)")


def main(argv: list[str]) -> int:
    init_logger()
    args = parse_args(argv)
    return run_main(lambda: prepare(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
