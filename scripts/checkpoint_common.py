"""Helpers shared by the checkpoint scripts (convert_to_hf.py, convert_from_hf.py, generate.py): reading the
model's shape from Titan flags, and turning user mistakes into one message and exit code 2."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.errors import ConfigError  # noqa: E402
from titan.config.job import Model  # noqa: E402
from titan.config.load import parse_args  # noqa: E402
from titan.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from titan.exits import run_main  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, build_model_args  # noqa: E402

TITAN_FLAGS_HELP = ("Titan flags go after --, e.g. -- --model.flavor 8B --model.tokenizer_path <file>, or "
                    "-- --job.config_file <dump_folder>/config.toml to reuse the training run's config. "
                    "Without them: the debug model and the shipped tokenizer.")


def parse_with_titan_flags(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The script's own arguments (those before `--`) parsed by `parser`, and the Titan flags after `--`.
    Split by hand: argparse can't hand a `--` tail to a nargs="*" positional that follows other positionals."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def parse_model_flags(flags: list[str]) -> tuple[Model, Tokenizer]:
    """The [model] section that Titan flags describe, and its tokenizer.

    The config is parsed but not validated: validation checks a training run (parallel degrees against the
    world size, float8 hardware), and a 64-GPU job's config.toml must still convert on one CPU process.
    """
    model = parse_args(flags).model
    return model, build_tokenizer(model.tokenizer_path)


def parse_model_shape(flags: list[str]) -> tuple[Model, ModelArgs, Tokenizer]:
    """The [model] section and the model's shape with the flavor's own context length: a converted checkpoint
    describes the model (HF's max_position_embeddings), not one run's --training.seq_len."""
    model, tokenizer = parse_model_flags(flags)
    args = build_model_args(model.flavor, tokenizer.vocab_size, model.vocab_size_multiple_of,
                            LLAMA3_FLAVORS[model.flavor].max_seq_len)
    return model, args, tokenizer


def check_new_folder(folder: Path, flag: str) -> None:
    """Refuse to write into a non-empty folder, where stale shards or .distcp files could mix with new ones."""
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{flag} {str(folder)!r} already exists and is not empty. Pass a new folder, or "
                          f"delete this one first.")


def run_script(main: Callable[[], None]) -> int:
    """Run a script's main() under Titan's exit handler: a ConfigError prints as one message and exits 2."""
    init_logger()
    return run_main(main)
