"""Benchmarks of Titan's train step.

Titan against a bare PyTorch loop on the same model and batches, in one process:

    python scripts/benchmark.py                                   # debug model on CPU
    python scripts/benchmark.py --steps 20 -- --model.flavor 1B --training.seq_len 2048 \
        --training.mixed_precision_param bfloat16 --training.compile

Both loops run the same model, batches, optimizer and clipping; Titan adds its data loader, NaN guard and
metrics. Prints tokens/s of each and their ratio (the target is Titan within 3% of bare).

Parameter + optimizer-state bytes and tokens/s per rank with FSDP over 1, 2 and 4 processes (gloo on CPU,
one GPU each on CUDA machines):

    python scripts/benchmark.py --fsdp-memory 1 2 4

Time training is blocked per checkpoint save, synchronous vs asynchronous (and pinned memory on CUDA), next to
the time of one copy of the training state to host memory, the floor an async save can reach:

    python scripts/benchmark.py --checkpoint

Everything after `--` is a Titan flag, on top of configs/debug_model.toml.
"""

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.check import load_job_config  # noqa: E402
from titan.config.dtypes import to_dtype  # noqa: E402
from titan.exits import run_main  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.models.llama.init import init_weights  # noqa: E402
from titan.models.llama.loss import cross_entropy_loss  # noqa: E402
from titan.models.llama.model import Transformer  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_titan(trainer: Trainer, warmup: int, steps: int) -> float:
    """Seconds for `steps` Titan train steps after `warmup` untimed ones."""
    data_iterator = iter(trainer.dataloader)
    for _ in range(warmup):
        trainer.train_step(data_iterator)
    synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(data_iterator)
    synchronize(trainer.device)
    return time.perf_counter() - start


def time_bare(trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> float:
    """Seconds for a minimal loop (forward, loss, backward, clip, AdamW) over `batches` after `warmup` steps."""
    cfg = trainer.cfg
    torch.manual_seed(cfg.training.seed)
    with torch.device("meta"):
        model = Transformer(trainer.model_args)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    model.to_empty(device=trainer.device)
    with torch.no_grad():
        init_weights(model, buffer_device=trainer.device)
    loss_fn = torch.compile(cross_entropy_loss) if cfg.training.compile else cross_entropy_loss
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=o.implementation == "foreach",
                                  fused=o.implementation == "fused")
    dtype = to_dtype(cfg.training.mixed_precision_param)
    autocast = (contextlib.nullcontext() if dtype == torch.float32
                else torch.autocast(trainer.device.type, dtype=dtype))
    vocab_size = trainer.model_args.vocab_size

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> None:
        optimizer.zero_grad()
        with autocast:
            logits = model(inputs)
        loss_fn(logits, labels, vocab_size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
        optimizer.step()

    for inputs, labels in batches[:warmup]:
        step(inputs, labels)
    synchronize(trainer.device)
    start = time.perf_counter()
    for inputs, labels in batches[warmup:]:
        step(inputs, labels)
    synchronize(trainer.device)
    return time.perf_counter() - start


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (its shard, for a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def measure_rank_memory(args: argparse.Namespace, argv: list[str]) -> None:
    """Worker under torchrun: FSDP over every rank, then bytes held and tokens/s on this rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(load_job_config([*argv, "--parallelism.data_parallel_shard_degree", str(world_size)],
                                      world_size), world_size)
    seconds = time_titan(trainer, args.warmup, args.steps) if args.steps else 0.0
    param_bytes = sum(local_bytes(p) for p in trainer.model.parameters())
    state_bytes = sum(local_bytes(v) for state in trainer.optimizer.state.values() for v in state.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    t = trainer.cfg.training
    tps = t.local_batch_size * t.seq_len * args.steps / seconds if seconds else 0.0
    if trainer.rank == 0:
        print(f"RESULT {world_size} {param_bytes} {state_bytes} {tps:.1f}", flush=True)
    destroy_distributed(wait_for_peers=True)


def fsdp_memory_table(args: argparse.Namespace) -> None:
    """Run measure_rank_memory under torchrun for each process count and print one table."""
    print(f"{'ranks':>5} {'param MiB/rank':>15} {'optim MiB/rank':>15} {'total MiB/rank':>15} {'tokens/s/rank':>14}")
    for nprocs in args.fsdp_memory:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
                   __file__, "--rank-memory", "--steps", str(args.steps), "--warmup", str(args.warmup), "--",
                   *args.titan_flags]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "LOG_RANK": "0"})
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
        if result.returncode != 0 or not lines:
            raise SystemExit(f"FSDP={nprocs} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        _, ranks, params, states, tps = lines[0].split()
        params_mib, states_mib = int(params) / 2**20, int(states) / 2**20
        print(f"{ranks:>5} {params_mib:15.2f} {states_mib:15.2f} {params_mib + states_mib:15.2f} {float(tps):14,.0f}")


def state_bytes_and_copy_seconds(trainer: Trainer) -> tuple[int, float]:
    """Bytes of this rank's model + optimizer state, and the seconds to copy them to (unpinned) host memory."""
    state = trainer.checkpointer.training_state(trainer.train_state())
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in _tensors(state)]
    synchronize(trainer.device)
    start = time.perf_counter()
    copies = [t.to("cpu", copy=True) for t in tensors]
    synchronize(trainer.device)
    seconds = time.perf_counter() - start
    return sum(c.numel() * c.element_size() for c in copies), seconds


def _tensors(state: object) -> list[torch.Tensor]:
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    return []


def checkpoint_table(argv: list[str], repeats: int) -> None:
    """For each async mode: median seconds the training loop is blocked by save(), and until the files are done."""
    modes = ["disabled", "async"] + (["async_with_pinned_mem"] if torch.cuda.is_available() else [])
    print(f"{'async_mode':<22} {'blocked ms':>11} {'written ms':>11} {'state MiB':>10} {'host copy ms':>13}")
    for mode in modes:
        folder = Path("/tmp/titan_benchmark_checkpoint") / mode
        shutil.rmtree(folder, ignore_errors=True)
        trainer = Trainer(load_job_config([*argv, "--job.dump_folder", str(folder), "--checkpoint.enable",
                                           "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "2"],
                                          world_size=1), world_size=1)
        data_iterator = iter(trainer.dataloader)
        blocked, written = [], []
        for _ in range(repeats):
            trainer.step += 1
            trainer.train_step(data_iterator)
            synchronize(trainer.device)
            start = time.perf_counter()
            trainer.checkpointer.save(trainer.train_state(), last_step=trainer.cfg.training.steps)
            blocked.append(time.perf_counter() - start)
            trainer.checkpointer.wait()
            written.append(time.perf_counter() - start)
        state_bytes, copy_seconds = state_bytes_and_copy_seconds(trainer)
        trainer.checkpointer.close()
        print(f"{mode:<22} {statistics.median(blocked) * 1e3:11.1f} {statistics.median(written) * 1e3:11.1f} "
              f"{state_bytes / 2**20:10.1f} {copy_seconds * 1e3:13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per loop")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator)")
    parser.add_argument("--repeats", type=int, default=2, help="alternate titan/bare this many times, keep the best")
    parser.add_argument("--fsdp-memory", type=int, nargs="+", metavar="N",
                        help="bytes and tokens/s per rank with FSDP over each N processes")
    parser.add_argument("--rank-memory", action="store_true", help=argparse.SUPPRESS)  # the --fsdp-memory worker
    parser.add_argument("--checkpoint", action="store_true", help="time blocked per checkpoint save, sync vs async")
    parser.add_argument("titan_flags", nargs="*", help="Titan flags after --")
    args = parser.parse_args()
    init_logger()
    argv = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dump_folder",
            "/tmp/titan_benchmark", *args.titan_flags]
    if args.fsdp_memory:
        fsdp_memory_table(args)
        return
    if args.rank_memory:
        measure_rank_memory(args, argv)
        return
    if args.checkpoint:
        checkpoint_table(argv, max(args.repeats, 3))
        return
    trainer = Trainer(load_job_config(argv, world_size=1), world_size=1)
    t = trainer.cfg.training
    if t.global_batch_size not in (-1, t.local_batch_size):
        raise SystemExit("benchmark.py compares single micro-batch steps: leave --training.global_batch_size at -1")
    data_iterator = iter(trainer.dataloader)
    batches = [tuple(x.to(trainer.device) for x in next(data_iterator)) for _ in range(args.warmup + args.steps)]
    tokens = t.local_batch_size * t.seq_len * args.steps

    titan_seconds, bare_seconds = [], []
    for _ in range(args.repeats):
        titan_seconds.append(time_titan(trainer, args.warmup, args.steps))
        bare_seconds.append(time_bare(trainer, batches, args.warmup))
    titan_tps, bare_tps = tokens / min(titan_seconds), tokens / min(bare_seconds)
    print(f"model {trainer.cfg.model.flavor}  device {trainer.device}  batch {t.local_batch_size}x{t.seq_len}  "
          f"dtype {t.mixed_precision_param}  compile {t.compile}  steps {args.steps} (best of {args.repeats})")
    print(f"titan  tokens/s {titan_tps:12,.0f}")
    print(f"bare   tokens/s {bare_tps:12,.0f}")
    print(f"titan/bare ratio {titan_tps / bare_tps:.3f}")


if __name__ == "__main__":
    sys.exit(run_main(main))
