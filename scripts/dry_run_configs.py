"""Dry-run every shipped config (configs/*.toml) at the world size it documents ("# World size: N"), for its first
and last rank, as CI does: exit 1 if any config stops dividing, stops building or stops fitting in an H100.
    python scripts/dry_run_configs.py [configs/llama3_8b.toml ...]"""

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.dry_run import documented_world_size  # noqa: E402


def main(paths: list[str]) -> int:
    configs = [Path(p) for p in paths] or sorted((ROOT / "configs").glob("*.toml"))
    summary = []
    for config in configs:
        world_size = documented_world_size(config)
        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "titan.dry_run", "--world_size", str(world_size),
                               "--job.config_file", str(config)], cwd=ROOT, check=False).returncode
        summary.append(f"{config.name:<24} world size {world_size:>4}: {'ok' if code == 0 else f'FAILED ({code})'} "
                       f"in {time.perf_counter() - start:.0f} s")
    print("\n".join(summary))
    return 0 if all(line.split(": ")[1].startswith("ok") for line in summary) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
