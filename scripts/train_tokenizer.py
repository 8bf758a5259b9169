"""Train a byte-level BPE tokenizer (Llama 3 pre-tokenization) and write it in tiktoken format.

    python scripts/train_tokenizer.py --vocab-size 2256 --input titan/data/corpus/stdlib_docs.jsonl.gz \\
        --output tokenizers/titan_2256.tiktoken

Inputs: .jsonl or .jsonl.gz files (the "text" field of each line) and plain UTF-8 text files (documents
separated by blank lines, as --training.dataset text reads them). The vocabulary counts every id the model
sees: the ranks written to --output plus BOS and EOS, which Titan's tokenizer appends after them.
"""

import argparse
import sys
import time
from pathlib import Path

# Run as `python scripts/train_tokenizer.py`, Python puts scripts/ (not the project root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bpe_train import train_bpe, write_tiktoken  # noqa: E402  (scripts/, beside this file)
from titan.config.errors import ConfigError  # noqa: E402
from titan.data.dataset import read_documents  # noqa: E402
from titan.data.tokenizer import LLAMA3_NUM_RANKS, TITAN_SPECIAL_TOKENS, Tokenizer  # noqa: E402
from titan.exits import run_main  # noqa: E402
from titan.metrics.log import init_logger, logger  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="total token ids including BOS and EOS; the file gets this minus 2 ranks")
    parser.add_argument("--input", type=Path, nargs="+", required=True, help=".txt, .jsonl or .jsonl.gz files")
    parser.add_argument("--output", type=Path, required=True, help="tiktoken file to write")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    num_ranks = args.vocab_size - len(TITAN_SPECIAL_TOKENS)
    if num_ranks == LLAMA3_NUM_RANKS:
        raise ConfigError(f"--vocab-size {args.vocab_size} would write {LLAMA3_NUM_RANKS} ranks, which Titan reads "
                          f"as Llama 3's tokenizer (with 256 special tokens). Pick another size.")
    start = time.perf_counter()
    texts = (text for path in args.input for text in read_documents(path, origin="--input"))
    ranks = train_bpe(texts, num_ranks)
    write_tiktoken(ranks, args.output)
    vocab_size = Tokenizer(ranks, name=args.output.stem).vocab_size
    logger.info(f"Wrote {args.output}: {len(ranks)} ranks + BOS + EOS = {vocab_size} tokens, "
                f"trained in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    init_logger()
    sys.exit(run_main(main))
