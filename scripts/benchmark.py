"""Benchmarks of Titan's train step, one subcommand each.

Titan's trainer overhead: its train step (data loader, the device-side skip decision, the previous step's
asynchronous loss read, NaN/spike guard, LR schedule, metering) against a bare loop (forward, loss, backward, clip,
optimizer step, no read at all) on the same model, optimizer and batches, in one process.
The two alternate in rounds (ABAB...), and the ratio is the median over rounds, with its range (the target is
Titan within 3% of bare):

    python scripts/benchmark.py overhead                          # debug model on CPU
    python scripts/benchmark.py overhead --steps 20 -- --model.flavor 1B --training.seq_len 2048 \
        --training.mixed_precision_param bfloat16 --training.compile

The speed levers of docs/performance.md, on the job held side by side with torchtitan (its debugmodel: 16 kv
heads, a 2048-token vocabulary, 8 x 2048 tokens, bf16 autocast, every 2nd block checkpointed, eager): the
baseline (main before the levers), each lever alone, all together, and all together compiled, alternating in
rounds. Prints tokens/s (median over rounds), the ratio to the baseline (median and range of the per-round
ratios), peak tensor bytes of one step, and the largest loss difference from the baseline over the first 20 steps:

    python scripts/benchmark.py ablation
    python scripts/benchmark.py ablation --steps 2 --repeats 3 -- --training.seq_len 256   # a quick look

Parameter + optimizer-state bytes and tokens/s per rank with FSDP over 1, 2 and 4 processes (gloo on CPU,
one GPU each on CUDA machines):

    python scripts/benchmark.py fsdp-memory 1 2 4

Time training is blocked per checkpoint save, synchronous vs asynchronous (and pinned memory on CUDA), next to
the time of one copy of the training state to host memory, the floor an async save can reach:

    python scripts/benchmark.py checkpoint
    python scripts/benchmark.py checkpoint -- --checkpoint.folder s3://bucket/prefix   # object storage (AWS_*)

Pipeline parallel over 2 CPU processes (gloo), each schedule with 2, 4 and 8 micro-batches of one sequence: the
median step time, and the share of each step's pipelined forward-backward that each rank idles, next to the
schedule's ideal bubble (equal-cost stages, free communication):

    python scripts/benchmark.py pipeline          # GPipe 1F1B Interleaved1F1B InterleavedZeroBubble ZBVZeroBubble
    python scripts/benchmark.py pipeline --schedules GPipe 1F1B --steps 10 -- --training.seq_len 128

A rank idles while it is blocked in the schedule's waits on point-to-point transfers (torch's _wait_batch_p2p, timed
through a wrapper), and from the end of its own last action until every rank is done: a barrier on each side of the
schedule's step lines up the ranks' windows, so the drain counts against the rank that finished first. The table
shows each rank's idle share of the schedule's step and their mean, the number to compare with the ideal bubble.

The last data-parallel rank's time to read its batch of 1 x 8,192 tokens at data-parallel degrees 1 to 1024
(scripts/bench_data.py has the preparation and memory measurements):

    python scripts/benchmark.py data

The cost of the production-run features (docs/production.md): seconds per step of the whole training loop
(Trainer.run: data, logging, the per-step checks) without and with in-training evaluation, alternating runs, and
the per-step checks alone (the stop/time-limit agreement, the spike and non-finite guard, the hang watchdog), with
the latency of their one all-reduce between 2 gloo processes:

    python scripts/benchmark.py production
    python scripts/benchmark.py production --steps 100 -- --validation.freq 20

Python's garbage collections during a whole training run on N processes (torchrun), per rank: with the collector's
automatic runs (what Titan did before --training.gc_freq) and on Titan's schedule; their count by generation, total
and longest pause, and the steps at which the scheduled ones ran:

    python scripts/benchmark.py gc 2 --steps 60 -- --parallelism.tensor_parallel_degree 2

Fine-tuning on the shipped conversations (docs/sft.md) against pretraining on the shipped documents, on the same
model and layout, alternating in rounds: tokens/s (median over rounds), the ratio to pretraining (median and range of
the per-round ratios; masking the prompts costs the step nothing, so it should be within 5%), and the share of the
targets that carry a loss, counted over the timed batches:

    python scripts/benchmark.py sft

Everything after `--` is a Titan flag, on top of configs/debug_model.toml. `python scripts/benchmark.py MODE --help`
lists a subcommand's own options.
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import get_args, get_type_hints
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.multiprocessing
import torch.nn.functional as F
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.distributed.pipelining import schedules

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import DEBUG_TOML, peak_tensor_bytes  # noqa: E402
from bench_data import per_rank_table  # noqa: E402
from levers import LEVERS as EAGER_STEP_LEVERS  # noqa: E402
from titan.config.job import JobConfig, Parallelism  # noqa: E402
from titan.config.paths import is_url  # noqa: E402
from titan.data.micro_batch import Batch  # noqa: E402
from titan.data.tokenizer import SHIPPED_TOKENIZER  # noqa: E402
from titan.exits import exit_process, run_main  # noqa: E402
from titan.metrics.log import init_logger, logger  # noqa: E402
from titan.models.common.attention import expand_kv_heads  # noqa: E402
from titan.models.common.loss import num_valid_targets  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.parallel.stages import ideal_bubble_fraction  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402
from titan.validate import load_job_config  # noqa: E402
from titan_flags import parse_with_titan_flags  # noqa: E402

STEPS, WARMUP, REPEATS = 10, 3, 3
"""The modes' --steps, --warmup and --repeats unless a mode says otherwise."""
PIPELINE_SCHEDULES = get_args(get_type_hints(Parallelism)["pipeline_parallel_schedule"])
# Every schedule but LoopedBFS, to keep the default run to about three minutes; name it to time it too.
DEFAULT_PIPELINE_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
PIPELINE_MICROBATCHES = (2, 4, 8)
PIPELINE_RANKS = 2
# Fifteen runs (five schedules x three micro-batch counts) share the three minutes: fewer steps each.
PIPELINE_STEPS, PIPELINE_WARMUP = 6, 2


def job_argv(flags: list[str]) -> list[str]:
    """Titan's arguments for the user's `flags`: on top of the debug config, dumping to /tmp/titan_benchmark."""
    return ["--job.config_file", DEBUG_TOML, "--job.dump_folder", "/tmp/titan_benchmark", *flags]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_titan(trainer: Trainer, warmup: int, steps: int) -> float:
    """Seconds for `steps` Titan train steps after `warmup` untimed ones."""
    data_iterator = iter(trainer.dataloader)
    timed_train_steps(trainer, data_iterator, warmup)
    return timed_train_steps(trainer, data_iterator, steps)[0]


def timed_train_steps(trainer: Trainer, data_iterator: Iterator, steps: int) -> tuple[float, list[float]]:
    """Seconds for the next `steps` train steps of `trainer`, numbered as the training loop numbers them, and
    their losses."""
    results = []
    synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step += 1
        results.append(trainer.train_step(data_iterator))  # the step before this one, finished while this one runs
    results.append(trainer.finish_step())
    synchronize(trainer.device)
    return time.perf_counter() - start, [result.loss for result in results if result is not None]


def bare_step(trainer: Trainer) -> Callable[[Batch], None]:
    """A minimal training step on the trainer's own model, loss and optimizer (forward, loss, backward, clip,
    step), without the trainer's data loading, guards and metering: what is left is the trainer's overhead."""
    params = [p for p in trainer.training.model.parameters() if p.requires_grad]
    max_norm = trainer.cfg.training.max_norm

    def step(batch: Batch) -> None:
        trainer.training.optimizer.zero_grad()
        micro_batch = trainer.training.micro_batch(*batch)
        with trainer.training.autocast():
            loss_sum = trainer.training.model(micro_batch.inputs, labels=micro_batch.labels,
                                              **micro_batch.model_inputs())
        (loss_sum / num_valid_targets(micro_batch.labels)).backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        trainer.training.optimizer.step()

    return step


def time_bare(trainer: Trainer, batches: list[Batch]) -> float:
    """Seconds for one bare step per batch of `batches` (already on the device)."""
    step = bare_step(trainer)
    synchronize(trainer.device)
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    synchronize(trainer.device)
    return time.perf_counter() - start


def ratio_summary(ratios: list[float]) -> str:
    """Median of per-round ratios and their range: "1.012 (0.998-1.020)"."""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def overhead_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Titan's step against the bare loop on the same trainer, alternating `args.steps` steps of each per round."""
    trainer = Trainer(load_job_config(job_argv(flags), world_size=1), world_size=1)
    t = trainer.cfg.training
    if t.global_batch_size not in (-1, t.local_batch_size):
        raise SystemExit("benchmark.py overhead compares single micro-batch steps: leave --training.global_batch_size "
                         "at -1")
    data_iterator = iter(trainer.dataloader)
    batches = [tuple(x.to(trainer.device) for x in next(data_iterator)) for _ in range(args.steps)]
    timed_train_steps(trainer, data_iterator, args.warmup)  # compile, allocator, optimizer state
    time_bare(trainer, batches[: args.warmup])
    titan_seconds, bare_seconds = [], []
    for _ in range(args.repeats):
        titan_seconds.append(timed_train_steps(trainer, data_iterator, args.steps)[0])
        bare_seconds.append(time_bare(trainer, batches))
    tokens = t.local_batch_size * t.seq_len * args.steps
    print(f"model {trainer.cfg.model.flavor}  device {trainer.device}  batch {t.local_batch_size}x{t.seq_len}  "
          f"dtype {t.mixed_precision_param}  compile {trainer.cfg.compile.enable}  {args.repeats} rounds of "
          f"{args.steps} steps each")
    print(f"titan  tokens/s {tokens / statistics.median(titan_seconds):12,.0f}")
    print(f"bare   tokens/s {tokens / statistics.median(bare_seconds):12,.0f}")
    ratios = [bare / titan for titan, bare in zip(titan_seconds, bare_seconds)]
    print(f"titan/bare ratio {ratio_summary(ratios)}  (tokens/s, median over rounds, and range)")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its shard, for a DTensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def measure_rank_memory(args: argparse.Namespace, flags: list[str]) -> None:
    """Worker under torchrun (fsdp-memory): FSDP over every rank, then bytes held and tokens/s on this rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(load_job_config([*job_argv(flags), "--parallelism.data_parallel_shard_degree", str(world_size)],
                                      world_size), world_size)
    seconds = time_titan(trainer, args.warmup, args.steps) if args.steps else 0.0
    param_bytes = sum(local_bytes(p) for p in trainer.training.model.parameters())
    state_bytes = sum(local_bytes(v) for state in trainer.training.optimizer.state.values() for v in state.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    t = trainer.cfg.training
    tps = t.local_batch_size * t.seq_len * args.steps / seconds if seconds else 0.0
    if trainer.rank == 0:
        print(f"RESULT {world_size} {param_bytes} {state_bytes} {tps:.1f}", flush=True)
    destroy_distributed(wait_for_peers=True)


def torchrun_results(nprocs: int, worker: list[str], flags: list[str], name: str) -> list[str]:
    """The RESULT lines that the worker subcommand `worker` (with its options) prints on `flags` when torchrun
    starts it on `nprocs` processes; a failed run stops the benchmark with its output, as the `name` run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", __file__,
               *worker, "--", *flags]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "LOG_RANK": "0"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{name} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return lines


def fsdp_memory_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Run measure_rank_memory under torchrun for each process count and print one table."""
    print(f"{'ranks':>5} {'param MiB/rank':>15} {'optim MiB/rank':>15} {'total MiB/rank':>15} {'tokens/s/rank':>14}")
    for nprocs in args.process_counts:
        worker = ["rank-memory", "--steps", str(args.steps), "--warmup", str(args.warmup)]
        lines = torchrun_results(nprocs, worker, flags, f"FSDP={nprocs}")
        _, ranks, params, states, tps = lines[0].split()
        params_mib, states_mib = int(params) / 2**20, int(states) / 2**20
        print(f"{ranks:>5} {params_mib:15.2f} {states_mib:15.2f} {params_mib + states_mib:15.2f} {float(tps):14,.0f}")


def state_bytes_and_copy_seconds(trainer: Trainer) -> tuple[int, float]:
    """Bytes of this rank's model + optimizer state, and the seconds to copy them to (unpinned) host memory."""
    state = trainer.checkpointer.training_state(trainer.train_state())
    tensors = [local_tensor(t) for t in _tensors(state)]
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


def checkpoint_table(args: argparse.Namespace, flags: list[str]) -> None:
    """For each async mode: median seconds the training loop is blocked by save(), and until the files are done,
    over `args.repeats` saves."""
    argv = job_argv(flags)
    modes = ["disabled", "async"] + (["async_with_pinned_mem"] if torch.cuda.is_available() else [])
    print(f"{'async_mode':<22} {'blocked ms':>11} {'written ms':>11} {'state MiB':>10} {'host copy ms':>13}")
    remote = load_job_config(argv, world_size=1).checkpoint.folder
    for mode in modes:
        folder = Path("/tmp/titan_benchmark_checkpoint") / mode
        shutil.rmtree(folder, ignore_errors=True)
        # each mode starts empty: a URL gets a new prefix per mode and run, so that nothing is resumed
        target = (["--checkpoint.folder", f"{remote}/{mode}-{time.strftime('%Y%m%d-%H%M%S')}"]
                  if is_url(remote) else [])
        trainer = Trainer(load_job_config([*argv, "--job.dump_folder", str(folder), "--checkpoint.enable",
                                           "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "2",
                                           *target], world_size=1), world_size=1)
        data_iterator = iter(trainer.dataloader)
        blocked, written = [], []
        for _ in range(args.repeats):
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
    schedule = trainer.training.model_parts.pipeline.schedule
    clock = PipelineIdleClock(schedule.step, trainer.training.meshes.pp.get_group())
    data_iterator = iter(trainer.dataloader)
    step_seconds, idle_shares = [], []
    with (patch.object(schedules, "_wait_batch_p2p", clock.timed_wait),
          patch.object(schedule, "step", clock.aligned_step)):
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
    dist.all_gather_object(rank_idle, statistics.median(idle_shares), group=trainer.training.meshes.pp.get_group())
    schedule = trainer.cfg.parallelism.pipeline_parallel_schedule
    ideal = ideal_bubble_fraction(schedule, PIPELINE_RANKS, len(trainer.training.model_parts.pipeline.stage_ids),
                                  trainer.training.model_parts.pipeline.num_microbatches)
    if rank == 0:
        results.put((statistics.median(step_seconds), ideal, rank_idle))
    destroy_distributed(wait_for_peers=True)


def pipeline_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Fork PIPELINE_RANKS processes running measure_pipeline_rank for each schedule and micro-batch count and
    print one table. Forked, not launched with torchrun: the children inherit the imported torch and Titan, which
    would otherwise cost each of the fifteen runs several seconds. Every config is checked first, so a bad flag
    stops with its ConfigError before any process starts."""
    runs = [(schedule, num_microbatches,
             load_job_config([*job_argv(flags), "--parallelism.pipeline_parallel_degree", str(PIPELINE_RANKS),
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--parallelism.pipeline_parallel_microbatch_size", "1",
                              "--training.local_batch_size", str(num_microbatches)], PIPELINE_RANKS))
            for schedule in args.schedules for num_microbatches in PIPELINE_MICROBATCHES]
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
    with trainer.stopper.watching(trainer.training.meshes):
        start = time.perf_counter()
        for step in range(1, calls + 1):
            trainer.stopper.start_step(step)
            trainer.anomalies.inspect(step, 2.0, 1.0, trainer.dataloader.position())
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


def production_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Seconds per step of the whole loop without and with evaluation (median of alternating runs), and the
    per-step checks alone."""
    argv, steps = job_argv(flags), args.steps
    logger.setLevel(logging.WARNING)  # the table is the output
    variants = {"no validation": [], "validation": ["--validation.enable"]}
    if not any(flag.startswith("--validation.freq") for flag in flags):
        variants["validation"] += ["--validation.freq", str(max(steps // 5, 1))]
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    evaluations: list[dict] = []
    for _ in range(args.repeats):
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


class AutomaticCollection:
    """In place of the trainer's ScheduledCollector: Python's automatic collections, as before --training.gc_freq."""

    def __enter__(self) -> "AutomaticCollection":
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def step(self, step: int) -> None:
        return None

    def take_pause_seconds(self) -> float:
        return 0.0


def measure_rank_collections(args: argparse.Namespace, flags: list[str]) -> None:
    """Worker under torchrun (gc): Trainer.run of --steps steps, with every collection timed through gc.callbacks;
    --automatic keeps the collector's automatic runs (the trainer's schedule replaced by nothing)."""
    world_size = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(load_job_config([*job_argv(flags), "--training.steps", str(args.steps), "--metrics.log_freq",
                                       str(args.steps)], world_size), world_size)
    if args.automatic:
        trainer.collector = AutomaticCollection()
    pauses: list[tuple[int, int, float]] = []  # (generation, step, seconds)
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], trainer.step, time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    trainer.run()
    gc.callbacks.remove(timed)
    print(f"RESULT {trainer.rank} {json.dumps(pauses)}", flush=True)
    destroy_distributed(wait_for_peers=True)


def collection_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Run measure_rank_collections under torchrun, automatic and scheduled, and print a line per rank."""
    print(f"{'collector':<10} {'rank':>4} {'collections (gen 0/1/2)':>24} {'total ms':>9} {'longest ms':>11}  steps")
    for mode in ("automatic", "scheduled"):
        worker = ["rank-collections", "--steps", str(args.steps), *(["--automatic"] if mode == "automatic" else [])]
        lines = sorted(line.split(" ", 2) for line in torchrun_results(args.processes, worker, flags, mode))
        for _, rank, text in lines:
            pauses = json.loads(text)
            counts = "/".join(str(sum(1 for generation, _, _ in pauses if generation == g)) for g in range(3))
            seconds = [pause for _, _, pause in pauses]
            steps = sorted({step for _, step, _ in pauses}) if mode == "scheduled" else "-"
            print(f"{mode:<10} {rank:>4} {counts:>24} {1000 * sum(seconds):9.1f} {1000 * max(seconds, default=0):11.2f}"
                  f"  {steps}")


# The job Titan is held against torchtitan on (issue 14): torchtitan's debugmodel (16 kv heads, a 2048-token
# vocabulary: 6,163,712 parameters), 8 x 2048 tokens per step, bf16 autocast, every 2nd block checkpointed, eager.
ABLATION_JOB = ["--model.flavor", "debugmodel_mha", "--training.seq_len", "2048", "--training.local_batch_size", "8",
                "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective",
                "--activation_checkpoint.selective_ac_option", "2", "--metrics.log_freq", "1000000"]
ABLATION_VOCAB = 2048
ABLATION_LOSS_STEPS = 20
# Ten rows of about 7 s steps on 2 CPU cores: 2 warm-up + 3 rounds x 6 steps = the 20 steps the losses compare.
ABLATION_STEPS, ABLATION_WARMUP = 6, 2


def truncated_tokenizer(vocab_size: int) -> Path:
    """The shipped tokenizer cut to its first vocab_size - 2 ranks (+ BOS and EOS): a BPE tokenizer of exactly
    vocab_size tokens, since both parts of every merge rank below it."""
    ranks = (ROOT / SHIPPED_TOKENIZER).read_text().splitlines()[: vocab_size - 2]
    path = Path(tempfile.gettempdir()) / f"titan_{vocab_size}.tiktoken"
    path.write_text("\n".join(ranks) + "\n")
    return path


def main_gqa_sdpa(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """SDPA as main fed it before enable_gqa: keys and values expanded to every query head (a copy)."""

    def expanded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
                 enable_gqa: bool = False, **kwargs: object) -> torch.Tensor:
        if enable_gqa:
            n_rep = query.size(1) // key.size(1)
            key, value = expand_kv_heads(key, n_rep), expand_kv_heads(value, n_rep)
        return sdpa(query, key, value, *args, **kwargs)

    return expanded


@dataclass
class Lever:
    """A speed lever and how to turn it off: config flags, or patches that put main's code back."""

    name: str
    off_flags: list[str] = field(default_factory=list)
    off_patches: Callable[[], list[contextlib.AbstractContextManager]] = list


LEVERS = [
    # Issue 51's, off as scripts/levers.py restores what they replaced (FlexAttention's saved region is CUDA's).
    Lever("complex RoPE", off_patches=lambda: [EAGER_STEP_LEVERS["complex_rope"].off()]),
    Lever("fused norm", off_patches=lambda: [EAGER_STEP_LEVERS["fused_norm"].off()]),
    Lever("fused SwiGLU", off_patches=lambda: [EAGER_STEP_LEVERS["fused_swiglu"].off()]),
    Lever("GQA without copies", off_patches=lambda: [
        patch.object(F, "scaled_dot_product_attention", main_gqa_sdpa(F.scaled_dot_product_attention))]),
    Lever("fused AdamW", off_flags=["--optimizer.implementation", "foreach"]),
    Lever("chunked loss", off_flags=["--training.loss_chunk_size", "0"]),
    Lever("AC keeps attention", off_flags=["--activation_checkpoint.no_save_attention"]),
]


@dataclass
class Contender:
    """One row of the ablation: a trainer built with `flags`, with the levers in `off` turned off."""

    name: str
    flags: list[str]
    off: list[Lever]
    trainer: Trainer | None = None
    data_iterator: Iterator | None = None
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_bytes: int | None = None

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """The off levers' patches, around this row's build and each of its runs (rows alternate)."""
        with contextlib.ExitStack() as stack:
            for lever in self.off:
                for context in lever.off_patches():
                    stack.enter_context(context)
            yield

    def build(self, argv: list[str]) -> None:
        with self.patched():
            self.trainer = Trainer(load_job_config([*argv, *self.flags], world_size=1), world_size=1)
        self.data_iterator = iter(self.trainer.dataloader)

    def run(self, steps: int) -> float:
        """Seconds of this row's next `steps` train steps; their losses are kept."""
        with self.patched():
            seconds, losses = timed_train_steps(self.trainer, self.data_iterator, steps)
        self.losses += losses
        return seconds

    def measure_peak(self) -> None:
        """Peak tensor bytes of one more step. Not for compiled rows: MemTracker counts tensors in a dispatch mode,
        which compiled blocks cannot run under (fullgraph=True fails)."""
        if self.trainer.cfg.compile.enable:
            return
        with self.patched():
            training = self.trainer.training
            self.peak_bytes = peak_tensor_bytes(lambda: timed_train_steps(self.trainer, self.data_iterator, 1),
                                                *training.model_parts.parts, training.optimizer)


def ablation_contenders() -> list[Contender]:
    """Baseline (every lever off), the baseline again (the noise floor of the ratios and, on GPUs whose kernels are
    not deterministic, of the loss differences), each lever alone, all together, and baseline and all together
    compiled."""

    def flags_off(levers: list[Lever]) -> list[str]:
        return [flag for lever in levers for flag in lever.off_flags]

    rows = [Contender("baseline (main)", flags_off(LEVERS), list(LEVERS)),
            Contender("baseline again", flags_off(LEVERS), list(LEVERS))]
    for lever in LEVERS:
        others = [other for other in LEVERS if other is not lever]
        rows.append(Contender(f"{lever.name} alone", flags_off(others), others))
    rows.append(Contender("all levers", [], []))
    rows.append(Contender("baseline + compile", [*flags_off(LEVERS), "--training.compile"], list(LEVERS)))
    rows.append(Contender("all levers + compile", ["--training.compile"], []))
    return rows


def ablation_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Build every row, run `args.warmup` untimed steps of each, then `args.repeats` rounds of `args.steps` steps
    of each in turn; then one more step each for peak memory."""
    logger.setLevel(logging.WARNING)  # the table is the output
    argv = job_argv([*ABLATION_JOB, "--model.tokenizer_path", str(truncated_tokenizer(ABLATION_VOCAB)), *flags])
    contenders = ablation_contenders()
    for contender in contenders:
        contender.build(argv)
    for contender in contenders:
        contender.run(args.warmup)
    for _ in range(args.repeats):
        for contender in contenders:
            contender.seconds.append(contender.run(args.steps))
    for contender in contenders:
        contender.measure_peak()
    base = contenders[0]
    t, vocab = base.trainer.cfg.training, base.trainer.training.model_parts.args.vocab_size
    tokens = t.local_batch_size * t.seq_len * args.steps
    compared = min(ABLATION_LOSS_STEPS, len(base.losses))
    print(f"{base.trainer.cfg.model.flavor}, vocab {vocab}, {t.local_batch_size} x {t.seq_len} tokens, "
          f"{t.mixed_precision_param}: {args.repeats} alternating rounds of {args.steps} steps after "
          f"{args.warmup} warm-up steps")
    print(f"{'':<26} {'tokens/s':>9} {'vs baseline (range)':>22} {'peak MiB':>9} "
          f"{f'max |dloss|, {compared} steps':>23}")
    for contender in contenders:
        ratios = [b / c for b, c in zip(base.seconds, contender.seconds)]
        loss_diff = max(abs(a - b) for a, b in zip(contender.losses[:compared], base.losses[:compared]))
        peak = f"{contender.peak_bytes / 2**20:9.1f}" if contender.peak_bytes is not None else f"{'-':>9}"
        print(f"{contender.name:<26} {tokens / statistics.median(contender.seconds):9,.0f} "
              f"{ratio_summary(ratios):>22} {peak} {loss_diff:23.2e}")


SFT_FLAGS = ["--training.dataset", "chat", "--training.dataset_path",
             str(ROOT / "titan" / "data" / "corpus" / "stdlib_chats.jsonl.gz")]


def loss_share(trainer: Trainer, num_batches: int) -> float:
    """The share of the next `num_batches` batches' targets that carry a loss, as the step masks them."""
    iterator = iter(trainer.dataloader)
    batches = [trainer.training.micro_batch(*next(iterator)) for _ in range(num_batches)]
    return sum(num_valid_targets(b.labels).item() for b in batches) / sum(b.labels.numel() for b in batches)


def sft_table(args: argparse.Namespace, flags: list[str]) -> None:
    """Pretraining and fine-tuning rows built side by side, `args.warmup` untimed steps each, then `args.repeats`
    rounds of `args.steps` steps of each in turn."""
    argv = job_argv(flags)
    logger.setLevel(logging.WARNING)  # the table is the output
    rows = [Contender("pretraining (documents)", [], []), Contender("fine-tuning (conversations)", SFT_FLAGS, [])]
    for row in rows:
        row.build(argv)
        row.run(args.warmup)
    for _ in range(args.repeats):
        for row in rows:
            row.seconds.append(row.run(args.steps))
    t = rows[0].trainer.cfg.training
    tokens = t.local_batch_size * t.seq_len * args.steps
    print(f"{rows[0].trainer.cfg.model.flavor}, {t.local_batch_size} x {t.seq_len} tokens, {t.mixed_precision_param}: "
          f"{args.repeats} alternating rounds of {args.steps} steps after {args.warmup} warm-up steps")
    print(f"{'':<28} {'tokens/s':>9} {'vs pretraining (range)':>24} {'targets with a loss':>20}")
    for row in rows:
        ratios = [p / r for p, r in zip(rows[0].seconds, row.seconds)]
        share = loss_share(row.trainer, args.steps)
        print(f"{row.name:<28} {tokens / statistics.median(row.seconds):9,.0f} {ratio_summary(ratios):>24} "
              f"{share:20.1%}")


def add_mode(modes: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace, list[str]], None],
             summary: str | None, steps: int | None = None, warmup: int | None = None,
             repeats: int | None = None) -> argparse.ArgumentParser:
    """The subcommand `name`, which runs `run(args, titan_flags)`, with --steps, --warmup and --repeats where the mode
    takes them (their defaults given). A mode without a summary is a worker that another mode starts under torchrun:
    --help leaves it out."""
    listing = {"help": summary, "description": summary} if summary else {}
    parser = modes.add_parser(name, **listing)
    parser.set_defaults(run=run)
    if steps is not None:
        parser.add_argument("--steps", type=int, default=steps, help=f"steps per timed run or round (default {steps})")
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup,
                            help=f"untimed steps first: compile, allocator, pipeline set-up (default {warmup})")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"rounds, alternating where a mode compares runs; medians are over rounds "
                                 f"(default {repeats})")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """One subcommand per benchmark, in the docstring's order, then the workers that fsdp-memory and gc start on each
    rank under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(metavar="MODE", required=True)
    add_mode(modes, "overhead", overhead_table, "Titan's train step against a bare loop: tokens/s and their ratio",
             STEPS, WARMUP, REPEATS)
    add_mode(modes, "ablation", ablation_table,
             "tokens/s, peak memory and loss difference of each speed lever, alone and together",
             ABLATION_STEPS, ABLATION_WARMUP, REPEATS)
    fsdp_memory = add_mode(modes, "fsdp-memory", fsdp_memory_table,
                           "bytes and tokens/s per rank with FSDP over each N processes", STEPS, WARMUP)
    fsdp_memory.add_argument("process_counts", type=int, nargs="+", metavar="N", help="process counts, e.g. 1 2 4")
    checkpoint = add_mode(modes, "checkpoint", checkpoint_table, "time blocked per checkpoint save, sync vs async")
    checkpoint.add_argument("--repeats", type=int, default=REPEATS,
                            help=f"saves per async mode; medians are over them (default {REPEATS})")
    pipeline = add_mode(modes, "pipeline", pipeline_table, "step time and idle share of each pipeline schedule "
                        "over 2 ranks and 2, 4 and 8 micro-batches", PIPELINE_STEPS, PIPELINE_WARMUP)
    pipeline.add_argument("--schedules", nargs="+", choices=PIPELINE_SCHEDULES, default=DEFAULT_PIPELINE_SCHEDULES,
                          metavar="SCHEDULE", help=f"any of {' '.join(PIPELINE_SCHEDULES)} "
                                                   f"(default: {' '.join(DEFAULT_PIPELINE_SCHEDULES)})")
    add_mode(modes, "data", lambda args, flags: per_rank_table(),
             "the last data-parallel rank's read time per batch at degrees 1 to 1024")
    add_mode(modes, "production", production_table,
             "seconds per step without and with evaluation, and the per-step checks' cost", STEPS, repeats=REPEATS)
    collections = add_mode(modes, "gc", collection_table,
                           "garbage collections per rank over a run on N processes, automatic and scheduled", STEPS)
    collections.add_argument("processes", type=int, metavar="N", help="processes, as torchrun's --nproc_per_node")
    add_mode(modes, "sft", sft_table,
             "tokens/s of fine-tuning on conversations against pretraining, same model and layout",
             STEPS, WARMUP, REPEATS)
    add_mode(modes, "rank-memory", measure_rank_memory, None, STEPS, WARMUP)
    rank_collections = add_mode(modes, "rank-collections", measure_rank_collections, None, STEPS)
    rank_collections.add_argument("--automatic", action="store_true",
                                  help="Python's automatic collections instead of the trainer's schedule")
    return parser


def main() -> None:
    args, titan_flags = parse_with_titan_flags(build_parser())
    init_logger()
    args.run(args, titan_flags)


if __name__ == "__main__":
    exit_process(run_main(main))
