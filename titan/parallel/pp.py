"""Pipeline parallel: a meta-built decoder of any family split into stages by FQN, each stage parallelized like a
whole model, and a torch.distributed.pipelining schedule that runs this rank's stages (torchtitan's pipeline_llm is
the model)."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule, get_schedule_class

from titan.config.job import Parallelism
from titan.data.micro_batch import MicroBatch
from titan.metrics.log import logger
from titan.parallel.reductions import full_value
from titan.parallel.stages import StagePlan, ideal_bubble_fraction, plan_stages, requested_num_stages, stage_ids

# Each stage's (input, output) of one micro-batch, as PipelineStage takes them: its example tensors.
StageExamples = list[tuple[Tensor, Tensor]]


def build_stage_models(model: nn.Module, plan: StagePlan, ids: tuple[int, ...]) -> list[nn.Module]:
    """The stages `ids` of `model` (still on meta), parts of it (the family's `part`: its forward, skipping what a
    stage does not hold) that share its modules: each block goes to exactly one stage."""
    last = plan.num_stages - 1
    with torch.device("meta"):
        return [model.part({str(i): model.layers[str(i)] for i in plan.blocks[stage]},
                           tok_embeddings=model.tok_embeddings if stage == 0 else None,
                           norm=model.norm if stage == last else None, output=model.output if stage == last else None)
                for stage in ids]


def merge_stage_models(model: nn.Module, parts: list[nn.Module]) -> nn.Module:
    """One part of `model` (its class before any stage was parallelized) over every stage this rank holds, for what
    needs the rank's whole share by FQN (state dicts, the optimizer, gradient norms); never called."""
    def present(name: str) -> nn.Module | None:
        return next((getattr(part, name) for part in parts if getattr(part, name) is not None), None)

    layers = {layer_id: block for part in parts for layer_id, block in part.layers.items()}
    return model.part(layers, tok_embeddings=present("tok_embeddings"), norm=present("norm"),
                      output=present("output"), rope=parts[0].rope)


@dataclass
class Pipeline:
    """This rank's pipeline stages and the schedule that runs them, forward and backward, over one local batch."""

    parts: list[nn.Module]
    """This rank's stage modules, in pipeline order."""
    model: nn.Module
    """Every stage of this rank as one module (merge_stage_models)."""
    stage_ids: tuple[int, ...]
    num_stages: int
    num_microbatches: int
    schedule_name: str
    pp_mesh: DeviceMesh
    device: torch.device
    schedule: _PipelineSchedule = field(init=False)
    loss_scale: Tensor | None = field(init=False, default=None)
    """What the running step multiplies each micro-batch's summed loss by (step/run)."""

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(self, micro_batch: MicroBatch, scale: Tensor) -> Tensor:
        """One local batch through the schedule, forward and backward: the sum of its micro-batches' summed losses
        times `scale`."""
        return self.run(self.schedule.step, micro_batch, scale)

    def eval(self, micro_batch: MicroBatch, scale: Tensor) -> Tensor:
        """One local batch through the schedule, forward only: the sum of its micro-batches' summed losses times
        `scale`."""
        return self.run(self.schedule.eval, micro_batch, scale)

    def run(self, run: Callable[..., object], micro_batch: MicroBatch, scale: Tensor) -> Tensor:
        """The first stage takes the token ids, every stage their positions and document ids, and the last stage
        the labels, from which it returns the micro-batches' summed losses; ranks without the last stage
        contribute zero to the global mean."""
        losses: list[Tensor] = []
        args = (micro_batch.inputs,) if self.holds_first_stage else ()
        kwargs = micro_batch.model_inputs()
        if self.holds_last_stage:
            kwargs["labels"] = micro_batch.labels
        self.loss_scale = scale
        # The last stage's outputs are the micro-batches' loss sums, which the schedule must not merge into a batch.
        run(*args, target=micro_batch.labels if self.holds_last_stage else None, losses=losses,
            return_outputs=False, **kwargs)
        if not self.holds_last_stage:
            return torch.zeros((), device=self.device)
        return sum(full_value(loss.detach()) for loss in losses)

    def scaled_loss(self, loss_sum: Tensor, labels: Tensor) -> Tensor:
        """The schedule's loss function: the last stage already returns a micro-batch's summed loss (from the
        labels it was handed), which the step's scale turns into its share of the step's mean."""
        return loss_sum * self.loss_scale


@dataclass(frozen=True)
class StageShapes:
    """What crosses a stage boundary for one micro-batch: token ids (microbatch_size, seq_len / cp) into the first
    stage, the residual stream (microbatch_size, seq_len / (cp x tp), dim) in `residual_dtype` between stages (TP's
    sequence shard, as a plain tensor), and the last stage's summed loss, a float32 scalar."""

    microbatch_size: int
    seq_len: int
    cp: int
    tp: int
    dim: int
    residual_dtype: torch.dtype


def stage_examples(shapes: StageShapes, ids: tuple[int, ...], num_stages: int) -> StageExamples:
    """(input, output) meta tensors of one micro-batch for each stage in `ids`: every stage is told its shapes, so
    none runs a forward on placeholder tensors to learn them (torch's shape inference would, at the first step and
    after every evaluation, and a mixture of experts would count those placeholder tokens as routed)."""
    with torch.device("meta"):
        tokens = torch.empty(shapes.microbatch_size, shapes.seq_len // shapes.cp, dtype=torch.int64)
        hidden = torch.empty(shapes.microbatch_size, shapes.seq_len // (shapes.cp * shapes.tp), shapes.dim,
                             dtype=shapes.residual_dtype, requires_grad=True)
        loss = torch.empty((), dtype=torch.float32, requires_grad=True)
    return [(tokens if stage == 0 else hidden, loss if stage == num_stages - 1 else hidden) for stage in ids]


def build_pipeline(model: nn.Module, pp_mesh: DeviceMesh, par: Parallelism, local_batch_size: int,
                   device: torch.device, parallelize: Callable[[nn.Module], None], shapes: StageShapes) -> Pipeline:
    """Split `model` (on meta) into this rank's stages, parallelize each with `parallelize` (TP, CP, AC, compile,
    FSDP, as a whole model would be), and build the schedule over them, each stage told its `shapes`."""
    schedule_name = par.pipeline_parallel_schedule
    num_microbatches = local_batch_size // par.pipeline_parallel_microbatch_size
    num_layers, pp = model.args.n_layers, pp_mesh.size()
    num_stages = requested_num_stages(num_layers, pp, schedule_name, par.pipeline_parallel_layers_per_stage,
                                      par.pipeline_parallel_split_points)
    plan = plan_stages(num_layers, num_stages, par.pipeline_parallel_split_points, pp, schedule_name)
    log_schedule(plan, schedule_name, pp, num_microbatches, par.pipeline_parallel_microbatch_size)
    ids = stage_ids(pp_mesh.get_local_rank(), pp, num_stages, schedule_name)
    parts = build_stage_models(model, plan, ids)
    for part in parts:
        parallelize(part)
    pipeline = Pipeline(parts=parts, model=merge_stage_models(model, parts), stage_ids=ids, num_stages=num_stages,
                        num_microbatches=num_microbatches, schedule_name=schedule_name, pp_mesh=pp_mesh, device=device)
    pipeline.schedule = build_schedule(pipeline, stage_examples(shapes, ids, num_stages))
    return pipeline


def build_schedule(pipeline: Pipeline, example_io: StageExamples) -> _PipelineSchedule:
    """A torch.distributed.pipelining schedule over the pipeline's stages. Gradients are not rescaled by the
    schedule (scale_grads=False): the step scales each micro-batch's loss by the step's valid targets itself, since
    the schedule's rescale would also divide gradients kept from earlier accumulation steps. example_io: each stage's
    (input, output) of one micro-batch, so that the stages need not learn their shapes by running."""
    stages = [PipelineStage(part, stage_id, pipeline.num_stages, pipeline.device, input_args=example_in,
                            output_args=example_out, group=pipeline.pp_mesh.get_group())
              for part, stage_id, (example_in, example_out) in zip(pipeline.parts, pipeline.stage_ids, example_io)]
    schedule_class = get_schedule_class(pipeline.schedule_name)
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=pipeline.num_microbatches, loss_fn=pipeline.scaled_loss,
                              scale_grads=False)
    return schedule_class(stages, n_microbatches=pipeline.num_microbatches, loss_fn=pipeline.scaled_loss,
                          scale_grads=False)


def log_schedule(plan: StagePlan, schedule: str, pp: int, num_microbatches: int, microbatch_size: int) -> None:
    """The schedule report: every rank's stages and blocks, the microbatches, and the ideal bubble."""
    per_rank = plan.num_stages // pp
    rows = []
    for rank in range(pp):
        stages = stage_ids(rank, pp, plan.num_stages, schedule)
        described = ", ".join(f"stage {s}: {describe_blocks(plan, s)}" for s in stages)
        rows.append(f"  pp rank {rank}: {described}")
    bubble = ideal_bubble_fraction(schedule, pp, per_rank, num_microbatches)
    logger.info(f"Pipeline parallel: {schedule} over {pp} ranks, {plan.num_stages} stages ({per_rank} per rank), "
                f"{num_microbatches} micro-batches of {microbatch_size} sequences per step; ideal bubble "
                f"{100 * bubble:.1f}% of each step\n" + "\n".join(rows))


def describe_blocks(plan: StagePlan, stage: int) -> str:
    """'embedding + blocks 0-1', 'blocks 2-4 + norm, output'."""
    blocks = plan.blocks[stage]
    text = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
    if stage == 0:
        text = "embedding + " + text
    if stage == plan.num_stages - 1:
        text += " + norm, output"
    return text
