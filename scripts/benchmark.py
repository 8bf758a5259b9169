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

Pipeline parallel over 2 CPU processes (gloo), each schedule with 2, 4 and 8 micro-batches of one sequence: the
median step time, and the share of each step's pipelined forward-backward that each rank idles, next to the
schedule's ideal bubble (equal-cost stages, free communication):

    python scripts/benchmark.py --pipeline          # GPipe 1F1B Interleaved1F1B InterleavedZeroBubble ZBVZeroBubble
    python scripts/benchmark.py --pipeline GPipe 1F1B --steps 10 -- --training.seq_len 128

A rank idles while it is blocked in the schedule's waits on point-to-point transfers (torch's _wait_batch_p2p, timed
through a wrapper), and from the end of its own last action until every rank is done: a barrier on each side of the
schedule's step lines up the ranks' windows, so the drain counts against the rank that finished first. The table
shows each rank's idle share of the schedule's step and their mean, the number to compare with the ideal bubble.

The cost of the production-run features (docs/production.md): seconds per step of the whole training loop
(Trainer.run: data, logging, the per-step checks) without and with in-training evaluation, alternating runs, and
the per-step checks alone (the stop/time-limit agreement, the spike and non-finite guard, the hang watchdog), with
the latency of their one all-reduce between 2 gloo processes:

    python scripts/benchmark.py --production
    python scripts/benchmark.py --production --steps 100 -- --validation.freq 20

Everything after `--` is a Titan flag, on top of configs/debug_model.toml.
"""

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import get_args, get_type_hints
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.distributed.pipelining import schedules

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.config.check import load_job_config  # noqa: E402
from titan.config.dtypes import to_dtype  # noqa: E402
from titan.config.job import JobConfig, Parallelism  # noqa: E402
from titan.exits import run_main  # noqa: E402
from titan.metrics.log import init_logger, logger  # noqa: E402
from titan.models.llama.init import init_weights  # noqa: E402
from titan.models.llama.loss import cross_entropy_loss  # noqa: E402
from titan.models.llama.model import Transformer  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.parallel.stages import ideal_bubble_fraction  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

PIPELINE_SCHEDULES = get_args(get_type_hints(Parallelism)["pipeline_parallel_schedule"])
# Every schedule but LoopedBFS, to keep the default run to about three minutes; name it to time it too.
DEFAULT_PIPELINE_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
PIPELINE_MICROBATCHES = (2, 4, 8)
PIPELINE_RANKS = 2
# Fifteen runs (five schedules x three micro-batch counts) share the three minutes: fewer steps each.
PIPELINE_STEPS, PIPELINE_WARMUP = 6, 2


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


class PipelineIdleClock:
    """Seconds this rank spends in pipelined forward-backwards (`span`) and idle within them (`idle`): blocked in
    the schedules' waits on point-to-point work, or done with its own actions while a peer still computes."""

    def __init__(self, schedule_step: Callable[..., object], group: dist.ProcessGroup) -> None:
        self.schedule_step = schedule_step
        self.wait_batch_p2p = schedules._wait_batch_p2p
        self.group = group
        self.span = 0.0
        self.idle = 0.0

    def timed_wait(self, works: list[dist.Work]) -> None:
        """Stands in for schedules._wait_batch_p2p, where every torch schedule blocks on transfers once its stages
        are set up (the set-up's own blocking sends and receives run in the first, untimed step)."""
        start = time.perf_counter()
        self.wait_batch_p2p(works)
        self.idle += time.perf_counter() - start

    def aligned_step(self, *args: object, **kwargs: object) -> object:
        """Stands in for the schedule's step. The first barrier starts every rank's window together; the second
        holds the rank that finished first until the pipeline has drained, which the ideal bubble counts as idle
        (without it, that rank would wait in the gradient-norm all-reduce instead)."""
        dist.barrier(group=self.group)
        start = time.perf_counter()
        result = self.schedule_step(*args, **kwargs)
        finished = time.perf_counter()
        dist.barrier(group=self.group)
        end = time.perf_counter()
        self.idle += end - finished
        self.span += end - start
        return result


def time_pipeline_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of `steps` train steps after `warmup` untimed ones, and the share of each step's pipelined
    forward-backward this rank idled."""
    clock = PipelineIdleClock(trainer.schedule.step, trainer.meshes.pp.get_group())
    data_iterator = iter(trainer.dataloader)
    step_seconds, idle_shares = [], []
    with (patch.object(schedules, "_wait_batch_p2p", clock.timed_wait),
          patch.object(trainer.schedule, "step", clock.aligned_step)):
        for step in range(warmup + steps):
            clock.span = clock.idle = 0.0
            start = time.perf_counter()
            trainer.train_step(data_iterator)
            if step >= warmup:
                step_seconds.append(time.perf_counter() - start)
                idle_shares.append(clock.idle / clock.span)
    return step_seconds, idle_shares


def measure_pipeline_rank(rank: int, port: int, cfg: JobConfig, warmup: int, steps: int,
                          results: SimpleQueue) -> None:
    """One pipeline rank, forked by pipeline_table: rank 0 puts its median step seconds, the ideal bubble and each
    rank's median idle share on `results`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(PIPELINE_RANKS), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)  # one core per rank, as torchrun's OMP_NUM_THREADS=1 gives
    logger.handlers.clear()  # the parent's handler has its rank and world size
    init_logger()
    logger.setLevel(logging.WARNING)  # the table is the output; Trainer's startup report would repeat per run
    trainer = Trainer(cfg, PIPELINE_RANKS)
    step_seconds, idle_shares = time_pipeline_steps(trainer, warmup, steps)
    rank_idle: list[float] = [0.0] * PIPELINE_RANKS
    dist.all_gather_object(rank_idle, statistics.median(idle_shares), group=trainer.meshes.pp.get_group())
    schedule = trainer.cfg.parallelism.pipeline_parallel_schedule
    ideal = ideal_bubble_fraction(schedule, PIPELINE_RANKS, len(trainer.stage_ids), trainer.num_microbatches)
    if rank == 0:
        results.put((statistics.median(step_seconds), ideal, rank_idle))
    destroy_distributed(wait_for_peers=True)


def pipeline_table(args: argparse.Namespace, argv: list[str]) -> None:
    """Fork PIPELINE_RANKS processes running measure_pipeline_rank for each schedule and micro-batch count and
    print one table. Forked, not launched with torchrun: the children inherit the imported torch and Titan, which
    would otherwise cost each of the fifteen runs several seconds. Every config is checked first, so a bad flag
    stops with its ConfigError before any process starts."""
    runs = [(schedule, num_microbatches,
             load_job_config([*argv, "--parallelism.pipeline_parallel_degree", str(PIPELINE_RANKS),
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--parallelism.pipeline_parallel_microbatch_size", "1",
                              "--training.local_batch_size", str(num_microbatches)], PIPELINE_RANKS))
            for schedule in args.pipeline or DEFAULT_PIPELINE_SCHEDULES for num_microbatches in PIPELINE_MICROBATCHES]
    print(f"{'schedule':<22} {'microbatches':>12} {'step s':>7} {'idle rank 0':>12} {'idle rank 1':>12} "
          f"{'idle mean':>10} {'ideal bubble':>13}", flush=True)
    results = torch.multiprocessing.get_context("fork").SimpleQueue()
    for schedule, num_microbatches, cfg in runs:
        torch.multiprocessing.start_processes(measure_pipeline_rank,
                                              (get_free_port(), cfg, args.warmup, args.steps, results),
                                              nprocs=PIPELINE_RANKS, start_method="fork")
        seconds, ideal, rank_idle = results.get()
        print(f"{schedule:<22} {num_microbatches:>12} {seconds:7.3f} {100 * rank_idle[0]:11.1f}% "
              f"{100 * rank_idle[1]:11.1f}% {100 * statistics.mean(rank_idle):9.1f}% {100 * ideal:12.1f}%",
              flush=True)


def timed_run(argv: list[str], flags: list[str]) -> tuple[float, list[dict]]:
    """Wall seconds of Trainer.run() for `argv` + `flags` in a fresh dump folder, and its validation records."""
    folder = Path("/tmp/titan_benchmark_production")
    shutil.rmtree(folder, ignore_errors=True)
    trainer = Trainer(load_job_config([*argv, "--job.dump_folder", str(folder), *flags], world_size=1), world_size=1)
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return seconds, [record for record in records if "val_loss" in record]


def per_step_check_seconds(argv: list[str], calls: int) -> float:
    """Seconds of one step boundary's checks on one process: Stopper.start_step + end_step (signal and time-limit
    agreement, step times, watchdog deadlines) and AnomalyGuard.inspect (non-finite and spike guard)."""
    trainer = Trainer(load_job_config([*argv, "--job.dump_folder", "/tmp/titan_benchmark_production"], 1), 1)
    with trainer.stopper.watching(trainer.meshes):
        start = time.perf_counter()
        for step in range(1, calls + 1):
            trainer.stopper.start_step(step)
            trainer.anomalies.inspect(step, 2.0, 1.0, trainer.dataloader.dataset.position())
            trainer.stopper.end_step(step, saving=False)
        return (time.perf_counter() - start) / calls


def measure_agreement_rank(rank: int, port: int, calls: int, results: SimpleQueue) -> None:
    """One of 2 forked gloo ranks timing the step boundary's all-reduce (4 float64, MAX); rank 0 reports."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    values = torch.zeros(4, dtype=torch.float64)
    for _ in range(10):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put((time.perf_counter() - start) / calls)
    dist.destroy_process_group()


def production_table(args: argparse.Namespace, argv: list[str]) -> None:
    """Seconds per step of the whole loop without and with evaluation (median of alternating runs), and the
    per-step checks alone."""
    steps = args.steps
    logger.setLevel(logging.WARNING)  # the table is the output
    variants = {"no validation": [], "validation": ["--validation.enable"]}
    if not any(flag.startswith("--validation.freq") for flag in argv):
        variants["validation"] += ["--validation.freq", str(max(steps // 5, 1))]
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    evaluations: list[dict] = []
    for _ in range(max(args.repeats, 3)):
        for name, flags in variants.items():
            run_seconds, records = timed_run(argv, ["--training.steps", str(steps), "--metrics.log_freq",
                                                    str(steps), *flags])
            seconds[name].append(run_seconds)
            evaluations = records or evaluations
    base = statistics.median(seconds["no validation"]) / steps
    print(f"{'loop':<16} {'s/step':>8} {'overhead':>9}   ({steps} steps, median of {len(seconds['validation'])} "
          f"alternating runs)")
    for name, runs in seconds.items():
        per_step = statistics.median(runs) / steps
        print(f"{name:<16} {per_step:8.4f} {100 * (per_step / base - 1):8.1f}%")
    val_seconds = statistics.median(record["val_seconds"] for record in evaluations)
    print(f"one evaluation: {val_seconds:.3f} s for {evaluations[0]['val_tokens']:,} tokens; "
          f"{len(evaluations)} evaluations per run")
    checks = per_step_check_seconds([*argv, "--training.steps", "1000000"], calls=2000)
    results = torch.multiprocessing.get_context("fork").SimpleQueue()
    torch.multiprocessing.start_processes(measure_agreement_rank, (get_free_port(), 2000, results), nprocs=2,
                                          start_method="fork")
    print(f"per-step checks, one process: {checks * 1e6:.1f} us ({100 * checks / base:.3f}% of a step); their "
          f"all-reduce between 2 gloo processes: {results.get() * 1e6:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int,
                        help=f"timed steps per loop (default 10; {PIPELINE_STEPS} with --pipeline)")
    parser.add_argument("--warmup", type=int, help="untimed steps first: compile, allocator, pipeline set-up "
                                                   f"(default 3; {PIPELINE_WARMUP} with --pipeline)")
    parser.add_argument("--repeats", type=int, default=2, help="alternate titan/bare this many times, keep the best")
    parser.add_argument("--fsdp-memory", type=int, nargs="+", metavar="N",
                        help="bytes and tokens/s per rank with FSDP over each N processes")
    parser.add_argument("--rank-memory", action="store_true", help=argparse.SUPPRESS)  # the --fsdp-memory worker
    parser.add_argument("--checkpoint", action="store_true", help="time blocked per checkpoint save, sync vs async")
    parser.add_argument("--pipeline", nargs="*", choices=PIPELINE_SCHEDULES, metavar="SCHEDULE",
                        help="step time and idle share of each pipeline schedule over 2 ranks and 2, 4 and 8 "
                             f"micro-batches (default: {' '.join(DEFAULT_PIPELINE_SCHEDULES)})")
    parser.add_argument("--production", action="store_true",
                        help="seconds per step without and with evaluation, and the per-step checks' cost")
    parser.add_argument("titan_flags", nargs="*", help="Titan flags after --")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = PIPELINE_STEPS if args.pipeline is not None else 10
    if args.warmup is None:
        args.warmup = PIPELINE_WARMUP if args.pipeline is not None else 3
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
    if args.pipeline is not None:
        pipeline_table(args, argv)
        return
    if args.production:
        production_table(args, argv)
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
