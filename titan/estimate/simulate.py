"""One simulated rank of a job at its real world size, on one CPU: a fake process group (no other process, every
collective a no-op) and fake tensors (shapes and dtypes, no storage, no compute) run Titan's own pipeline: the mesh,
the meta-built model, converters, every pipeline stage, TP/CP, activation checkpointing, FSDP2, the optimizer, and
training steps (forward, backward, grad clip, optimizer step). The second step runs under a StepRecorder, whose
record becomes the report (titan/estimate/report.py): memory, FLOPs, collective volume and a roofline step time.

What differs from a real run, and why: no data or tokenizer is read (random token ids; the vocabulary comes from the
tokenizer file when there is one, else Llama 3's); weights are not initialised (their values don't matter, and
trunc_normal_ is data-dependent, which fake tensors can't run); torch.compile is off (it needs real kernels), so
memory and time are the eager code's; tensors live on the CPU, which changes no shape, dtype or collective."""

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining.schedules import _PipelineSchedule

from titan.config.dtypes import to_dtype
from titan.config.job import JobConfig
from titan.config.paths import resolve_path
from titan.data.tokenizer import build_tokenizer
from titan.estimate.roofline import Collective, OpCost
from titan.estimate.trace import GroupInfo, MemoryPeak, StepRecorder, memory_peak
from titan.metrics.log import logger
from titan.models.llama.args import LLAMA3_VOCAB_SIZE
from titan.models.llama.model import precompute_rope_cache
from titan.parallel.ac import keeps_attention
from titan.parallel.dims import Meshes, build_meshes, resolve_dims
from titan.parallel.stages import ideal_bubble_fraction
from titan.train.trainer import Trainer, set_seed


@dataclass(frozen=True)
class DryRunResult:
    """What one simulated rank's recorded step did."""

    rank: int
    world_size: int
    layout: str
    stages: str
    num_params: int
    local_params: int
    flops_per_token: int
    tokens_per_gpu: int
    memory: MemoryPeak
    ops: list[OpCost]
    collectives: list[Collective]
    bubble_fraction: float


def join_fake_process_group(rank: int, world_size: int) -> None:
    """A process group in which this process is `rank` of `world_size`, with no other process: collectives return
    at once and leave their outputs as they were (torch's fake backend, made for this kind of simulation)."""
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def dry_run_vocab_size(tokenizer_path: str) -> int:
    """The tokenizer's vocabulary when its file is here; Llama 3's (the flavors' own) otherwise."""
    if resolve_path(tokenizer_path).is_file():
        return build_tokenizer(tokenizer_path).vocab_size
    logger.info(f"Dry run: --model.tokenizer_path {tokenizer_path!r} is not on this machine; using Llama 3's "
                f"vocabulary of {LLAMA3_VOCAB_SIZE} tokens.")
    return LLAMA3_VOCAB_SIZE


def group_infos(meshes: Meshes | None) -> dict[str, GroupInfo]:
    """Process-group name -> (mesh dimension label, global ranks), for every group a step's collectives use.
    Flattened meshes are labelled by their own names (dp_shard_cp is FSDP's group when CP shards it too)."""
    if meshes is None:
        return {}
    infos = {}
    for mesh in (meshes.root, meshes.dp, meshes.fsdp, meshes.loss):
        for index, name in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(index)
            infos.setdefault(group.group_name, GroupInfo(dim=name, ranks=tuple(dist.get_process_group_ranks(group))))
    return infos


class DryRunTrainer(Trainer):
    """The Trainer's pipeline up to the optimizer, and its step, on fake tensors; no data, checkpoints or metrics
    (so Trainer.__init__, which builds those, is not called)."""

    def __init__(self, cfg: JobConfig, world_size: int, rank: int, fake_mode: FakeTensorMode) -> None:
        self.cfg = replace(cfg, training=replace(cfg.training, compile=False))
        self.compile_requested = cfg.training.compile
        self.rank = rank
        self.device = torch.device("cpu")
        self.dims = resolve_dims(cfg.parallelism, world_size)
        join_fake_process_group(rank, world_size)
        self.meshes = build_meshes(self.dims, self.device)
        set_seed(cfg.training.seed, deterministic=False)
        vocab_size = dry_run_vocab_size(cfg.model.tokenizer_path)
        self.fake_mode = fake_mode
        # Built on meta and parallelized as in a real run; fake tensors from materialisation on (device meshes compute
        # with real tensors, which FSDP over TP does inside fully_shard).
        self.model_fqns = self.build_model(vocab_size)
        with fake_mode:
            self.init_model_weights()
            self.build_optimization()

    def keeps_attention(self) -> bool:
        """As the simulated rank would decide: on a GPU, compiled if the job compiles (compile is off here only
        because fake tensors can't run it)."""
        return keeps_attention(self.cfg.activation_checkpoint.save_attention, self.compile_requested, on_gpu=True)

    def init_model_weights(self) -> None:
        """Storage for every part (fake: none is allocated) and the rotary table; weight values don't matter here."""
        for part in self.model_parts:
            part.to_empty(device=self.device)
            with torch.device(self.device):
                part.rope_cache = precompute_rope_cache(self.model_args)

    def build_pipeline_schedule(self, example_io: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                                ) -> _PipelineSchedule:
        """The real run's schedule, told each stage's shapes: a real run's stages learn them from their neighbours
        during the first step, and a simulated rank has no neighbours."""
        schedule = super().build_pipeline_schedule(self.stage_examples())
        skip_inference_vote(schedule)
        return schedule

    def stage_examples(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) of one micro-batch for each of this rank's stages. A stage after the first takes the
        residual stream as pipelining sends it: this rank's sequence shard (TP and CP shard the sequence), in the
        dtype FSDP computes in (float32 otherwise, autocast keeping the residual stream in float32). The output
        comes from running the stage on that input (fake: no compute, and the autograd graph is dropped at once)."""
        t, d = self.cfg.training, self.dims
        microbatch = self.cfg.parallelism.pipeline_parallel_microbatch_size
        dtype = to_dtype(t.mixed_precision_param) if d.dp_enabled else torch.float32
        examples = []
        for part, stage_id in zip(self.model_parts, self.stage_ids):
            if stage_id == 0:
                example_in = torch.randint(0, self.model_args.vocab_size, (microbatch, t.seq_len // d.cp))
            else:
                example_in = torch.empty(microbatch, t.seq_len // (d.cp * d.tp), self.model_args.dim, dtype=dtype,
                                         requires_grad=True)
            # With autograd on: an output that requires grad tells the stage to receive its gradient.
            with self.autocast():
                example_out = part(example_in)
            examples.append((example_in, example_out.detach().requires_grad_(example_out.requires_grad)))
        return examples

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Random token ids of the real batch shape: the values never matter to shapes or memory."""
        t = self.cfg.training
        while True:
            tokens = torch.randint(0, self.model_args.vocab_size, (t.local_batch_size, t.seq_len + 1))
            yield tokens[:, :-1], tokens[:, 1:]

    def step(self, recorder: StepRecorder | None) -> None:
        """One training step as Trainer.train_step runs it (minus the host read of the loss, which fake tensors
        don't have); the recorder learns which storages are gradients once backward made them."""
        self.optimizer.zero_grad()
        loss_sum, grad_norm = self.compute_gradients(self.batches())
        self.global_mean(loss_sum)
        if recorder is not None:
            recorder.label((p.grad for p in self.model.parameters() if p.grad is not None), "gradients")
        self.apply_update()

    def record_step(self) -> StepRecorder:
        """A first step (it creates the optimizer state and fills torch's sharding caches, as a real run's first
        step does), then the recorded second step: the steady state a long run lives in."""
        with self.fake_mode:
            self.step(recorder=None)
            self.optimizer.zero_grad()
            recorder = StepRecorder(group_infos(self.meshes))
            recorder.register((*self.model.parameters(), *self.model.buffers()), "parameters")
            recorder.register((value for state in self.optimizer.state.values() for value in state.values()
                               if isinstance(value, torch.Tensor)), "optimizer state")
            with recorder:
                self.step(recorder)
        return recorder

    def result(self, recorder: StepRecorder) -> DryRunResult:
        par = self.cfg.parallelism
        stages_per_rank = len(self.model_parts)
        bubble = (ideal_bubble_fraction(par.pipeline_parallel_schedule, self.dims.pp, stages_per_rank,
                                        self.num_microbatches) if self.dims.pp_enabled else 0.0)
        stages = (", ".join(f"stage {s}" for s in self.stage_ids) if self.dims.pp_enabled else "the whole model")
        d = self.dims
        layout = f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}"
        return DryRunResult(
            rank=self.rank, world_size=d.world_size, layout=layout, stages=stages, num_params=self.total_params,
            local_params=sum(local_numel(p) for p in self.model.parameters()), flops_per_token=self.flops_per_token,
            tokens_per_gpu=self.global_tokens_per_step // d.world_size, memory=memory_peak(recorder),
            ops=recorder.ops, collectives=recorder.collectives,
            bubble_fraction=bubble)


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank holds of a parameter (its local shard for a DTensor)."""
    local = getattr(param, "_local_tensor", param)
    return local.numel()


def skip_inference_vote(schedule: _PipelineSchedule) -> None:
    """torch 2.13's schedules vote over point-to-point sends whether every stage was given its shapes (static) or
    must infer them; a fake process group delivers no vote, so this rank's stages, which were given theirs, are
    declared static directly. torch 2.11 and 2.12 have no vote and skip inference for stages given their shapes."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def declare_static(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = declare_static


def run_dry_run(cfg: JobConfig, world_size: int, rank: int) -> DryRunResult:
    """Simulate `rank` of a `world_size` job and return its recorded step; leaves no process group behind."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        trainer = DryRunTrainer(cfg, world_size, rank, fake_mode)
        recorder = trainer.record_step()
        return trainer.result(recorder)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
