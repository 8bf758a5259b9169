"""Helpers shared by the checkpoint scripts (convert_to_hf.py, convert_from_hf.py, generate.py): their parser,
reading the model's family and shape from Titan flags, reading a step folder's weights against that shape, and
turning user mistakes into one message and exit code 2."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.checkpoint.dcp import read_model_weights  # noqa: E402
from titan.checkpoint.hf import check_shapes, titan_shapes  # noqa: E402
from titan.config.errors import ConfigError  # noqa: E402
from titan.config.job import Model, MoE  # noqa: E402
from titan.config.load import parse_args  # noqa: E402
from titan.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from titan.exits import run_main  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.models.common.family import BuildOptions  # noqa: E402
from titan.models.families import FAMILIES  # noqa: E402
from titan.train.rules import check_flavor  # noqa: E402

TITAN_FLAGS_HELP = ("Titan flags go after --, e.g. -- --model.flavor 8B --model.tokenizer_path <file> (and "
                    "--model.name qwen3 for a Qwen3), or -- --job.config_file <dump_folder>/config.toml to reuse the "
                    "training run's config. Without them: the Llama debug model and the shipped tokenizer.")


def checkpoint_parser(description: str) -> argparse.ArgumentParser:
    """A checkpoint script's parser: its docstring above the arguments, how to pass Titan flags below them."""
    return argparse.ArgumentParser(description=description, epilog=TITAN_FLAGS_HELP,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_model_flags(flags: list[str]) -> tuple[Model, MoE, Tokenizer]:
    """The [model] and [moe] sections that Titan flags describe, and the tokenizer.

    The config is parsed but not validated: validation checks a training run (parallel degrees against the
    world size, float8 hardware), and a 64-GPU job's config.toml must still convert on one CPU process. Only the
    flavor is checked, against --model.name's family.
    """
    cfg = parse_args(flags)
    problem = check_flavor(cfg.model)
    if problem is not None:
        raise ConfigError(problem)
    return cfg.model, cfg.moe, build_tokenizer(cfg.model.tokenizer_path)


def build_args(model: Model, moe: MoE, tokenizer: Tokenizer, max_seq_len: int) -> Any:
    """The args of --model.name's --model.flavor with the tokenizer's vocab and a rotary table of max_seq_len. A
    mixture of experts trained with --moe.load_balance_coeff (the default) checkpoints a routing bias per layer, so
    the coefficient is part of the checkpoint's shape."""
    options = BuildOptions(vocab_size=tokenizer.vocab_size, vocab_size_multiple_of=model.vocab_size_multiple_of,
                           max_seq_len=max_seq_len, moe_load_balance_coeff=moe.load_balance_coeff)
    return FAMILIES[model.name].build_args(model.flavor, options)


def parse_model_shape(flags: list[str]) -> tuple[Model, Any, Tokenizer]:
    """The [model] section, the model's args (its family's) with the flavor's own context length, and the tokenizer:
    a converted checkpoint describes the model (HF's max_position_embeddings), not one run's --training.seq_len."""
    model, moe, tokenizer = parse_model_flags(flags)
    args = build_args(model, moe, tokenizer, FAMILIES[model.name].flavors[model.flavor].max_seq_len)
    return model, args, tokenizer


def read_checked_weights(step_folder: str, args: Any) -> dict[str, Tensor]:
    """The model tensors of a Titan DCP step folder, refused with one message if their shapes are not `args`'."""
    weights = read_model_weights(step_folder)
    check_shapes({fqn: tensor.shape for fqn, tensor in weights.items()}, titan_shapes(args),
                 f"Checkpoint {step_folder}")
    return weights


def check_new_folder(folder: Path, flag: str) -> None:
    """Refuse to write into a non-empty folder, where stale shards or .distcp files could mix with new ones."""
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{flag} {str(folder)!r} already exists and is not empty. Pass a new folder, or "
                          f"delete this one first.")


def run_script(main: Callable[[], None]) -> int:
    """Run a script's main() under Titan's exit handler: a ConfigError prints as one message and exits 2."""
    init_logger()
    return run_main(main)
