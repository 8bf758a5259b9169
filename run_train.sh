#!/usr/bin/env bash
# Launch Titan on this machine with torchrun, one process per GPU (gloo processes on a CPU-only machine).
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
# Environment: NGPU (processes, default 1), CONFIG_FILE (default configs/debug_model.toml),
# LOG_RANK (ranks that print info, comma-separated, default 0), MAX_RESTARTS (in-job restarts after a crash, a hang
# or a failed save, each resuming from the newest checkpoint; default 0). Other arguments go to train.py.
# Across nodes, call python -m titan.launch yourself (see README.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU="${NGPU:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
PYTHON="${PYTHON:-python3}"
export LOG_RANK="${LOG_RANK:-0}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${CONFIG_FILE:-}" && ! -f "$CONFIG_FILE" ]]; then
    echo "Config error: CONFIG_FILE=$CONFIG_FILE is not a file. Point it at a TOML job such as configs/debug_model.toml." >&2
    exit 2
fi
CONFIG_FILE="${CONFIG_FILE:-$ROOT/configs/debug_model.toml}"

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        exec "$PYTHON" "$ROOT/train.py" --job.config_file "$CONFIG_FILE" "$@"
    fi
done

# titan.launch is torchrun that checks NGPU, LOG_RANK and the config once before starting ranks, and passes a
# failed rank's exit code through (2: config or data mistake, 3: diverged, 4: stopped early by a signal or
# --job.time_limit, rerun to resume; 5: hung; 6: a checkpoint save failed; 7: MAX_RESTARTS restarts were not enough).
exec "$PYTHON" -m titan.launch --standalone --nnodes=1 --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
    "$ROOT/train.py" --job.config_file "$CONFIG_FILE" "$@"
