"""Hugging Face import/export at scale: throughput and per-rank peak host memory, on Titan's real layouts.

    python scripts/bench_hf.py                                   # ~0.8 GB model: 1 rank, FSDP=2, FSDP=2 x TP=2
    python scripts/bench_hf.py --dim 512 --n_layers 8 --layouts fsdp2xtp2 --json out.json

Builds a Llama of the given shape (the shipped tokenizer's 2256-token vocab, float32), writes it as a Hugging Face
folder from one process, then, for each layout, starts the ranks with torchrun (gloo). Each rank builds the model on
meta, applies Titan's TP and FSDP, allocates its shards, and then loads the folder with load_hf and saves it back
with save_hf. Memory is the rank's resident set (RSS, which includes the file pages it maps): the peak during each
phase is read from VmHWM after resetting it (/proc/self/clear_refs), minus the RSS just before. Throughput is the
model's bytes over the phase's wall time, so several ranks together count the model once. Linux only.

With --check, every rank also compares the loaded weights with the folder's (exact; padding rows zero), and each
layout's export is kept for the caller to compare.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.checkpoint.hf import hf_shapes, titan_shapes  # noqa: E402
from titan.checkpoint.hf_io import read_hf_weights, save_hf  # noqa: E402
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer  # noqa: E402
from titan.exits import exit_process  # noqa: E402
from titan.models.families import FAMILIES  # noqa: E402
from titan.models.llama.args import ModelArgs  # noqa: E402
from titan.models.llama.init import init_weights  # noqa: E402
from titan.models.llama.model import Transformer  # noqa: E402
from titan.parallel.fsdp import apply_fsdp  # noqa: E402
from titan.parallel.tp import apply_tp  # noqa: E402

# Layout name -> (mesh shape, mesh dim names): FSDP shards over "fsdp", TP over "tp"; "replica" holds copies.
LAYOUTS = {
    "single": ((1,), ("fsdp",)),
    "fsdp2": ((2,), ("fsdp",)),
    "fsdp4": ((4,), ("fsdp",)),
    "tp2": ((1, 2), ("replica", "tp")),
    "replica2xtp2": ((2, 2), ("replica", "tp")),
    "fsdp2xtp2": ((2, 2), ("fsdp", "tp")),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=16)
    parser.add_argument("--n_heads", type=int, default=16)
    parser.add_argument("--n_kv_heads", type=int, default=8)
    parser.add_argument("--layouts", default="single,fsdp2,fsdp2xtp2",
                        help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--folder", type=Path, default=None,
                        help="work folder for the HF folders (default: a temporary one, deleted after)")
    parser.add_argument("--check", action="store_true", help="check the loaded weights and keep each export")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a layout, run by each torchrun rank
    return parser.parse_args()


def model_args(cli: argparse.Namespace) -> ModelArgs:
    return ModelArgs(dim=cli.dim, n_layers=cli.n_layers, n_heads=cli.n_heads, n_kv_heads=cli.n_kv_heads,
                     vocab_size=build_tokenizer(SHIPPED_TOKENIZER).vocab_size, max_seq_len=64)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure(phase: object) -> tuple[float, int]:
    """Seconds `phase()` takes on every rank (from a barrier to a barrier), and this rank's peak RSS above its RSS
    before."""
    dist.barrier()
    before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    phase()
    dist.barrier()
    return time.perf_counter() - start, peak_rss_bytes() - before


def build_sharded(args: ModelArgs, layout: str) -> Transformer:
    """The model on this rank's shards of `layout`, allocated (uninitialised) as Titan's trainer leaves it."""
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Transformer(args)
    if "tp" in names:
        apply_tp(model, mesh["tp"], FAMILIES["llama3"].parallel_plan, loss_parallel=True, async_tp=False)
    if "fsdp" in names:
        apply_fsdp(model, mesh["fsdp"], torch.float32, torch.float32, reshard_after_forward="default")
    model.to_empty(device="cpu")
    return model


def check_loaded(model: Transformer, reference: dict[str, torch.Tensor]) -> None:
    """Every full weight equals the reference's, on every rank."""
    for fqn, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not torch.equal(full, reference[fqn]):
            raise AssertionError(f"rank {dist.get_rank()}: {fqn} differs from the Hugging Face folder after loading")


def run_layout_on_rank(args: ModelArgs, layout: str, folder: Path, check: bool) -> None:
    """This rank's part of one layout: load the folder, (check it), save it back; rank 0 writes the measurements."""
    from titan.checkpoint.hf_io import load_hf

    model = build_sharded(args, layout)
    state = model.state_dict()
    with torch.no_grad():
        for tensor in state.values():
            tensor.fill_(float("nan"))  # so a row the load misses shows
    load_seconds, load_peak = measure(lambda: load_hf(folder / "model", state, args))
    if check:
        check_loaded(model, read_hf_weights(folder / "model", args))
    export = folder / f"export-{layout}"
    save_seconds, save_peak = measure(lambda: save_hf(state, export, args, torch.float32,
                                                      build_tokenizer(SHIPPED_TOKENIZER)))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, {"load_peak_bytes": load_peak, "save_peak_bytes": save_peak})
    if dist.get_rank() == 0:
        result = {"layout": layout, "world_size": dist.get_world_size(), "load_seconds": load_seconds,
                  "save_seconds": save_seconds, "ranks": peaks}
        (folder / f"result-{layout}.json").write_text(json.dumps(result))


def run_worker(cli: argparse.Namespace) -> None:
    """One rank of a torchrun world, running each of its layouts in turn (starting ranks costs more than a layout)."""
    dist.init_process_group("gloo")
    for layout in cli.worker.split(","):
        run_layout_on_rank(model_args(cli), layout, cli.folder, cli.check)
    dist.destroy_process_group()


def write_model(args: ModelArgs, folder: Path) -> float:
    """Initialise the model on this process and write it as a Hugging Face folder; returns the seconds taken."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        init_weights(model, buffer_device="cpu")
    start = time.perf_counter()
    save_hf(model.state_dict(), folder, args, torch.float32, build_tokenizer(SHIPPED_TOKENIZER))
    return time.perf_counter() - start


def world_size_of(layout: str) -> int:
    size = 1
    for dim in LAYOUTS[layout][0]:
        size *= dim
    return size


def run_layouts(cli: argparse.Namespace, layouts: list[str], folder: Path) -> list[dict]:
    """Run `layouts`, which share one world size, on one set of torchrun ranks; their results in order."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world_size_of(layouts[0])}", __file__, "--worker", ",".join(layouts), "--folder",
               str(folder), "--dim", str(cli.dim), "--n_layers", str(cli.n_layers), "--n_heads", str(cli.n_heads),
               "--n_kv_heads", str(cli.n_kv_heads)]
    command += ["--check"] if cli.check else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOG_RANK": "0"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"layouts {layouts} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [json.loads((folder / f"result-{layout}.json").read_text()) for layout in layouts]


def report(args: ModelArgs, write_seconds: float, results: list[dict]) -> dict:
    model_bytes = sum(shape.numel() * 4 for shape in hf_shapes(args).values())
    largest = max(shape.numel() * 4 for shape in titan_shapes(args).values())
    print(f"model: {model_bytes / 2**30:.3f} GiB in float32, largest tensor {largest / 2**20:.1f} MiB")
    print(f"write from one process: {model_bytes / write_seconds / 1e9:.2f} GB/s ({write_seconds:.2f} s)")
    print("| layout | ranks | load GB/s | load peak MiB per rank (max) | bound 1/N + largest | save GB/s | "
          "save peak MiB per rank (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        n = result["world_size"]
        load_peak = max(rank["load_peak_bytes"] for rank in result["ranks"])
        save_peak = max(rank["save_peak_bytes"] for rank in result["ranks"])
        print(f"| {result['layout']} | {n} | {model_bytes / result['load_seconds'] / 1e9:.2f} | "
              f"{load_peak / 2**20:.0f} | {(model_bytes / n + largest) / 2**20:.0f} | "
              f"{model_bytes / result['save_seconds'] / 1e9:.2f} | {save_peak / 2**20:.0f} |")
    return {"model_bytes": model_bytes, "largest_tensor_bytes": largest, "write_seconds": write_seconds,
            "layouts": results}


def main() -> None:
    cli = parse_args()
    if cli.worker is not None:
        run_worker(cli)
        return
    args = model_args(cli)
    with tempfile.TemporaryDirectory() as scratch:
        folder = cli.folder or Path(scratch)
        write_seconds = write_model(args, folder / "model")
        layouts = cli.layouts.split(",")
        results = []
        for size in sorted({world_size_of(layout) for layout in layouts}):
            results += run_layouts(cli, [layout for layout in layouts if world_size_of(layout) == size], folder)
    summary = report(args, write_seconds, results)
    if cli.json is not None:
        cli.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
    exit_process(0)
