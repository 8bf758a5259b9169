"""One simulated rank of a job at its real world size, on one CPU: a fake process group (no other process, every
collective a no-op) and fake tensors (shapes and dtypes, no storage, no compute) run Titan's own pipeline: the mesh,
the meta-built model, converters, every pipeline stage, TP/CP, activation checkpointing, FSDP2, the optimizer, and
training steps (forward, backward, grad clip, optimizer step). The second step runs under a StepRecorder, whose
record becomes the report (titan/estimate/report.py): memory, FLOPs, collective volume and a roofline step time.

What differs from a real run, and why: no data or tokenizer is read (random token ids; the vocabulary comes from the
tokenizer file when there is one, else Llama 3's); weights are not initialised (their values don't matter, and
trunc_normal_ is data-dependent, which fake tensors can't run); torch.compile is off (it needs real kernels), so
memory and time are the eager code's; tensors live on the CPU, which changes no shape, dtype or collective."""

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining.schedules import _PipelineSchedule

from titan.config.job import JobConfig, Model
from titan.config.paths import resolve_path
from titan.data.loader import batch_to
from titan.data.micro_batch import Batch
from titan.data.tokenizer import build_tokenizer
from titan.estimate.cuda_shim import build_cuda_shim
from titan.estimate.data_cost import DataCost, measure_data_cost
from titan.estimate.fake_cuda import simulated_gpu
from titan.estimate.rank_server import simulate_in_child
from titan.estimate.roofline import Collective, OpCost
from titan.estimate.trace import GroupInfo, MemoryPeak, StepRecorder, memory_peak
from titan.hardware import Accelerator, simulated_accelerator
from titan.metrics.log import logger
from titan.models.families import FAMILIES
from titan.parallel.dims import Meshes, data_parallel_rank, resolve_dims
from titan.parallel.shards import local_shard
from titan.parallel.stages import ideal_bubble_fraction
from titan.train.anomalies import skips_update
from titan.train.build import BuildMode, build_training_step
from titan.train.step import TrainingStep


@dataclass(frozen=True)
class DryRunResult:
    """What one simulated rank's recorded step did."""

    rank: int
    world_size: int
    layout: str
    stages: str
    num_params: int
    num_active_params: int
    local_params: int
    flops_per_token: int
    tokens_per_gpu: int
    memory: MemoryPeak
    ops: list[OpCost]
    collectives: list[Collective]
    bubble_fraction: float
    micro_batches: int
    """Loader batches per step (gradient accumulation steps)."""
    data: DataCost
    update_ops: list[OpCost]
    update_collectives: list[Collective]
    """The optimizer update's share of `ops` and `collectives` (Muon's Newton-Schulz and its gathers among them)."""
    optimizer: str
    """The optimizer's name, for the report."""


def join_fake_process_group(rank: int, world_size: int) -> None:
    """A process group in which this process is `rank` of `world_size`, with no other process: collectives return
    at once and leave their outputs as they were (torch's fake backend, made for this kind of simulation)."""
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def dry_run_vocab_size(model: Model) -> int:
    """The tokenizer's vocabulary size when its file is here; otherwise the family's own (its flavors' placeholder
    size)."""
    if resolve_path(model.tokenizer_path).is_file():
        return build_tokenizer(model.tokenizer_path).vocab_size
    vocab_size = FAMILIES[model.name].flavors[model.flavor].vocab_size
    logger.info(f"Dry run: --model.tokenizer_path {model.tokenizer_path!r} is not on this machine; using "
                f"{model.name}'s vocabulary of {vocab_size} tokens.")
    return vocab_size


def group_infos(meshes: Meshes | None) -> dict[str, GroupInfo]:
    """Process-group name -> (mesh dimension label, global ranks), for every group a step's collectives use.
    Flattened meshes are labelled by their own names (dp_shard_cp is FSDP's group when CP shards it too)."""
    if meshes is None:
        return {}
    infos = {}
    for mesh in meshes.all():
        for index, name in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(index)
            infos.setdefault(group.group_name, GroupInfo(dim=name, ranks=tuple(dist.get_process_group_ranks(group))))
    return infos


def random_batches(training: TrainingStep) -> Iterator[Batch]:
    """Random token ids of the real batch shape, and document ends, made in host memory and copied to the device as
    the trainer copies the loader's batches: the values never matter to shapes or memory."""
    t, vocab_size = training.train_cfg, training.model_parts.args.vocab_size
    while True:
        tokens = torch.randint(0, vocab_size, (t.local_batch_size, t.seq_len + 1))
        ends = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.bool)
        yield batch_to((tokens[:, :-1], tokens[:, 1:], ends), training.device)


def run_step(training: TrainingStep, recorder: StepRecorder | None) -> tuple[int, int]:
    """One training step as the trainer queues it (Trainer.queue_gradients and queue_update): forward and backward,
    clipping, the update skipped on the device for a non-finite loss or norm, and the copy of the loss, norm and skip
    flag to the host. What the host does with them a step later needs their values, which fake tensors have none of.
    The recorder learns which storages are gradients once backward made them. Returns where the update's ops and
    collectives start among the recorder's (0, 0 without one)."""
    batches = random_batches(training)
    micro_batches = [training.micro_batch(*next(batches)) for _ in range(training.grad_accumulation_steps)]
    loss_sum, grad_norm = training.compute_gradients(micro_batches)
    loss = training.global_mean(loss_sum).float()
    update_start = (0, 0)
    if recorder is not None:
        recorder.label((p.grad for p in training.model.parameters() if p.grad is not None), "gradients")
        update_start = (len(recorder.ops), len(recorder.collectives))
    training.update_and_read_back(loss, grad_norm, skips_update(loss, grad_norm))
    return update_start


def record_step(training: TrainingStep, fake_mode: FakeTensorMode) -> tuple[StepRecorder, tuple[int, int]]:
    """A first step (it creates the optimizer state and fills torch's sharding caches, as a real run's first
    step does), then the recorded second step: the steady state a long run lives in. Returns the recorder and where
    the update's ops and collectives start among its records."""
    with fake_mode:
        run_step(training, recorder=None)
        training.optimizer.zero_grad()
        recorder = StepRecorder(group_infos(training.meshes))
        recorder.register((*training.model.parameters(), *training.model.buffers()), "parameters")
        recorder.register((value for state in training.optimizer.state.values() for value in state.values()
                           if isinstance(value, torch.Tensor)), "optimizer state")
        with recorder:
            update_start = run_step(training, recorder)
    return recorder, update_start


def dry_run_result(training: TrainingStep, rank: int, recorder: StepRecorder, update_start: tuple[int, int],
                   data: DataCost, host_memory: bool) -> DryRunResult:
    """The report's facts about the recorded step, whose update starts at `update_start` among the recorder's ops
    and collectives. `host_memory`: storages in host memory are counted apart from the GPU's (on a simulated GPU; on
    a CPU every storage is the device's)."""
    d, model_parts, pipeline = training.dims, training.model_parts, training.model_parts.pipeline
    bubble = (ideal_bubble_fraction(pipeline.schedule_name, d.pp, len(pipeline.parts), pipeline.num_microbatches)
              if pipeline is not None else 0.0)
    stages = ", ".join(f"stage {s}" for s in pipeline.stage_ids) if pipeline is not None else "the whole model"
    layout = f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}"
    return DryRunResult(
        rank=rank, world_size=d.world_size, layout=layout, stages=stages, num_params=model_parts.num_params,
        num_active_params=model_parts.num_active_params,
        local_params=sum(local_shard(p).numel() for p in training.model.parameters()),
        flops_per_token=model_parts.flops_per_token, tokens_per_gpu=training.global_tokens_per_step // d.world_size,
        memory=memory_peak(recorder, host_memory),
        ops=recorder.ops, collectives=recorder.collectives, bubble_fraction=bubble,
        micro_batches=training.grad_accumulation_steps, data=data, update_ops=recorder.ops[update_start[0]:],
        update_collectives=recorder.collectives[update_start[1]:], optimizer=type(training.optimizer).__name__)


@dataclass(frozen=True)
class RankRequest:
    """What the process simulating one rank is asked (titan/estimate/gpu_rank.py)."""

    cfg: JobConfig
    world_size: int
    rank: int
    gpu: Accelerator | None
    """The GPU the rank runs on; None simulates a CPU rank (scripts/validate_estimate.py checks those against real
    CPU steps)."""


class SimulatedRankError(Exception):
    """A simulated rank's failure, with the traceback of the process that simulated it."""


def run_dry_run(cfg: JobConfig, world_size: int, rank: int, simulate_gpu: bool = True) -> DryRunResult:
    """Simulate `rank` of a `world_size` job, on the --estimate.gpu card (or, without `simulate_gpu`, on a CPU), and
    return its recorded step. The rank is simulated in a process of its own (titan/estimate/gpu_rank.py), which sees
    no real GPU; its errors are raised here."""
    gpu = simulated_accelerator(cfg.estimate.gpu) if simulate_gpu else None
    shim = str(build_cuda_shim()) if simulate_gpu else ""
    with tempfile.TemporaryDirectory(prefix="titan_dry_run_") as folder:
        outcome, code = simulate_in_child(shim, RankRequest(cfg, world_size, rank, gpu), Path(folder))
    if outcome is None:
        raise SimulatedRankError(f"The process simulating rank {rank} ended with exit code {code} before "
                                 f"reporting; its output above says why.")
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def simulation_mode(fake_mode: FakeTensorMode) -> BuildMode:
    """The trainer's build as a simulated rank runs it: fake tensors without values from the weights on, so no
    compile (it runs real kernels), no FlexAttention (its mask is built from the batch's values), weights without
    init, and an even spread of tokens over experts where the host reads their counts."""
    return BuildMode(fake_mode=fake_mode, compile=False, flex_as_causal_sdpa=True, init_weights=False, valueless=True)


def declare_static_shapes(schedule: _PipelineSchedule) -> None:
    """torch 2.13's schedules vote over point-to-point sends whether every stage was given its shapes (static) or
    must infer them; without peers to vote with (a dry run's fake process group), this rank's stages, which were
    given theirs, are declared static directly. torch 2.11 and 2.12 have no vote and skip inference for stages given
    their shapes."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def declare_static(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = declare_static


def simulate_rank(request: RankRequest) -> DryRunResult:
    """The simulation of one rank, in the process gpu_rank.py started for it: the fake process group, the trainer's
    own build (titan/train/build.py) and two steps on fake tensors, on the simulated GPU's fake CUDA tensors under
    its device rules (titan/estimate/fake_cuda.py). A real run's pipeline stages confirm with their neighbours that
    every stage was told its shapes, which a simulated rank has none of, so here its stages are declared static."""
    cfg, gpu = request.cfg, request.gpu
    join_fake_process_group(request.rank, request.world_size)
    dims = resolve_dims(cfg.parallelism, request.world_size, cfg.training.enable_cpu_offload)
    device = torch.device("cuda", 0) if gpu is not None else torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with simulated_gpu(gpu.name, gpu.capability, fake_mode) if gpu is not None else contextlib.nullcontext():
        training = build_training_step(cfg, dims, device, dry_run_vocab_size(cfg.model), simulation_mode(fake_mode))
        if training.model_parts.pipeline is not None:
            declare_static_shapes(training.model_parts.pipeline.schedule)
        recorder, update_start = record_step(training, fake_mode)
    dp_rank, dp_degree = data_parallel_rank(training.meshes)
    data = measure_data_cost(cfg.training, cfg.model.tokenizer_path, dp_rank, dp_degree,
                             training.grad_accumulation_steps, cfg.chat)
    return dry_run_result(training, request.rank, recorder, update_start, data, host_memory=gpu is not None)
