"""train.py with some of scripts/levers.py's changes switched off, for scripts/gpu_check.py's lever rows and
scripts/benchmark.py's ablation:

    python scripts/train_levers_off.py --off fused_norm,saved_flex -- --model.flavor 1B ...

Everything after `--` is train.py's command line; the levers stay off for the whole run."""

import argparse
import faulthandler
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from levers import LEVERS, levers_off, unknown_levers  # noqa: E402
from titan.exits import exit_process  # noqa: E402
from train import main as train_main  # noqa: E402


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
    """(levers to switch off, train.py's arguments) of this script's command line."""
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--off", required=True, help=f"comma-separated levers: {', '.join(LEVERS)}")
    names = [name for name in parser.parse_args(ours).off.split(",") if name]
    unknown = unknown_levers(names)
    if unknown:
        parser.error(f"--off names no lever {unknown}: the levers are {', '.join(LEVERS)}")
    return names, train_argv


if __name__ == "__main__":
    faulthandler.enable()
    off, train_argv = parse(sys.argv[1:])
    with levers_off(off):
        code = train_main(train_argv)
    exit_process(code)
