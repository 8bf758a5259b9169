#!/usr/bin/env bash
# Downloads into .whl/ the wheels that scripts/gpu_check.py needs on a lent GPU machine and its image lacks (the
# image has torch 2.11.0+cu130, triton, numpy, tiktoken, regex, tensorboard, safetensors, tokenizers, pyarrow,
# pandas, huggingface-hub, einops, pillow, pytest; it has no network). Run it here, once, from anywhere:
#
#     scripts/gpu_wheels.sh
#
# Then a session runs the check with the device tool's `run`, carry [".whl"], as one line:
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --log-dir $OUT
#
# and pastes the table it brings back into docs/performance.md with
# `python3 scripts/gpu_check.py --apply-section <files_at>/gpu_check.md`.
#
# Every wheel is pure Python apart from multiprocess's, which is for CPython 3.12 (the image's Python), and each is
# pinned: one version of each, since two stop the whole --no-deps install.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$root/.whl"
mkdir -p "$wheels"
# .whl/ travels only when `carry` names it, and never into a commit.
grep -qxF '/.whl/' "$root/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$root/.git/info/exclude"

packages=(
    # Titan's runtime dependencies (pyproject.toml) that the image lacks, with tyro's own. typeguard needs
    # typing_extensions 4.14 or newer, and no reading of the image names its version: the newest travels too
    # (typing_extensions only ever adds names, so it serves whatever the image's other packages import from it).
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing_extensions==4.16.0 torchdata==0.11.0
    # torchtitan 0.3.0 and what it imports at start-up that the image lacks. datasets is held below 4.8 by
    # torchtitan's pin; dill, multiprocess and fsspec by datasets 4.7's.
    torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 datasets==4.7.0 dill==0.4.0
    multiprocess==0.70.18 fsspec==2026.2.0
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" "${packages[@]}"

# A wheel of another version left from an earlier list would be installed beside the pinned one.
expected=${#packages[@]}
found=$(find "$wheels" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$found" -ne "$expected" ]; then
    echo "$wheels holds $found wheels where this script pins $expected: remove the others (rm -r $wheels) and rerun." >&2
    exit 1
fi
du -sh "$wheels"
