"""Hugging Face import and export on sharded models (FSDP, TP, FSDP x TP over 4 gloo ranks), through
scripts/bench_hf.py: every rank reads and writes only its own rows, the result is exact, and a rank's peak host
memory stays near its share of the model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# 2 kv heads of 16 rows: FSDP=4 gives each rank 8 rows of wk, half a head; TP=2 gives each rank one head, and FSDP=2
# on top cuts it in half. 8 layers (28 MB in float32, largest tensor 2.4 MB), so that a whole model stands out from a
# rank's share plus the process's own noise.
SHAPE = ("--dim", "256", "--n_heads", "16", "--n_kv_heads", "2", "--n_layers", "8")
LAYOUTS = ["fsdp4", "replica2xtp2", "fsdp2xtp2"]
SLACK_BYTES = 12 * 2**20  # Python objects, DCP plans, tensor headers: 5-6 MiB measured


def run_bench(folder: Path, shape: tuple[str, ...], layouts: str) -> dict:
    command = [sys.executable, str(ROOT / "scripts" / "bench_hf.py"), *shape, "--layouts", layouts, "--check",
               "--folder", str(folder), "--json", str(folder / "summary.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((folder / "summary.json").read_text())


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index.values())):
        tensors.update(load_file(folder / file_name))
    assert sorted(tensors) == sorted(index)
    return tensors


def assert_same_export(folder: Path, layout: str) -> None:
    """The export of `layout` has the files and the bit-exact tensors of the folder it loaded."""
    export = folder / f"export-{layout}"
    assert not (export / "sharded").exists()
    assert sorted(p.name for p in export.iterdir()) == sorted(p.name for p in (folder / "model").iterdir())
    want, got = folder_tensors(folder / "model"), folder_tensors(export)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{layout}: {name}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """All layouts on one set of 4 ranks; --check: on every rank the loaded weights equal the folder's."""
    folder = tmp_path_factory.mktemp("hf_sharded")
    return folder, run_bench(folder, SHAPE, ",".join(LAYOUTS))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_is_exact(runs: tuple[Path, dict], layout: str) -> None:
    folder, _ = runs
    assert_same_export(folder, layout)


def test_each_rank_holds_only_its_share(runs: tuple[Path, dict]) -> None:
    """Loading into FSDP=2 x TP=2 raises a rank's resident memory (mapped file pages included) by at most its
    quarter of the model plus the largest tensor; the old loader read the whole model on every rank."""
    _, summary = runs
    (result,) = [result for result in summary["layouts"] if result["layout"] == "fsdp2xtp2"]
    model_bytes, largest = summary["model_bytes"], summary["largest_tensor_bytes"]
    share = model_bytes / result["world_size"]
    for rank, peaks in enumerate(result["ranks"]):
        assert peaks["load_peak_bytes"] <= share + largest + SLACK_BYTES, (rank, peaks, model_bytes)
        # Saving holds the rank's chunks twice (tensors and their serialised bytes), then one tensor at a time
        # while the output files are assembled.
        assert peaks["save_peak_bytes"] <= 2 * share + 2 * largest + SLACK_BYTES, (rank, peaks, model_bytes)
