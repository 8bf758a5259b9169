"""How the scripts take Titan flags: after `--`, past the script's own arguments."""

import argparse
import sys


def parse_with_titan_flags(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The script's own arguments (those before `--`) parsed by `parser`, and the Titan flags after `--`.
    Split by hand: argparse can't hand a `--` tail to a nargs="*" positional that follows other positionals or
    a subcommand."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]
