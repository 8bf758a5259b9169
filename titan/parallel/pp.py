"""Pipeline parallel: a meta-built Llama split into stages by FQN, run by a torch.distributed.pipelining schedule."""

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule, get_schedule_class

from titan.metrics.log import logger
from titan.models.llama.args import ModelArgs
from titan.models.llama.model import Transformer
from titan.parallel.stages import StagePlan, ideal_bubble_fraction, stage_ids


class StageModel(nn.Module):
    """The parts of a Transformer that one pipeline stage runs, under the full model's FQNs (layers.<id>,
    tok_embeddings, norm, output), so checkpoints do not depend on the layout. The first stage takes token ids
    (bs, seq), the last returns logits (bs, seq, padded_vocab), the others take and return hidden states
    (bs, seq, dim). Absent parts are None."""

    def __init__(self, args: ModelArgs, rope_cache: Tensor, layers: dict[str, nn.Module],
                 tok_embeddings: nn.Module | None = None, norm: nn.Module | None = None,
                 output: nn.Module | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = tok_embeddings
        self.register_buffer("rope_cache", rope_cache, persistent=False)
        self.layers = nn.ModuleDict(layers)
        self.norm = norm
        self.output = output

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        return self.output(self.norm(h)) if self.output is not None else h


def build_stage_models(model: Transformer, plan: StagePlan, ids: tuple[int, ...]) -> list[StageModel]:
    """The stages `ids` of `model` (still on meta), sharing its modules: each block goes to exactly one stage."""
    last = plan.num_stages - 1
    return [StageModel(model.args, model.rope_cache, {str(i): model.layers[str(i)] for i in plan.blocks[stage]},
                       tok_embeddings=model.tok_embeddings if stage == 0 else None,
                       norm=model.norm if stage == last else None, output=model.output if stage == last else None)
            for stage in ids]


def merge_stage_models(parts: list[StageModel]) -> StageModel:
    """One module over every part this rank holds, for what needs the rank's whole share by FQN (state dicts,
    the optimizer, gradient norms); never called."""
    def present(name: str) -> nn.Module | None:
        return next((getattr(part, name) for part in parts if getattr(part, name) is not None), None)

    layers = {layer_id: block for part in parts for layer_id, block in part.layers.items()}
    return StageModel(parts[0].args, parts[0].rope_cache, layers, tok_embeddings=present("tok_embeddings"),
                      norm=present("norm"), output=present("output"))


def split_model(model: Transformer, plan: StagePlan, pp_mesh: DeviceMesh, schedule: str) -> tuple[list[StageModel],
                                                                                                 tuple[int, ...]]:
    """This rank's stage models and their stage ids."""
    ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), plan.num_stages, schedule)
    return build_stage_models(model, plan, ids), ids


def build_schedule(parts: list[StageModel], ids: tuple[int, ...], num_stages: int, schedule: str,
                   num_microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], pp_mesh: DeviceMesh,
                   device: torch.device, example_io: list[tuple[Tensor, Tensor]] | None = None) -> _PipelineSchedule:
    """A torch.distributed.pipelining schedule over this rank's stages. Gradients are not rescaled by the schedule
    (scale_grads=False): loss_fn divides by the microbatch count itself, since the schedule's rescale would also
    divide gradients kept from earlier accumulation steps. example_io: each stage's (input, output) of one
    micro-batch, so that the stages need not learn their shapes from their neighbours (a dry run has none); None:
    torch infers them during the first step."""
    examples = example_io or [(None, None)] * len(parts)
    stages = [PipelineStage(part, stage_id, num_stages, device, input_args=example_in, output_args=example_out,
                            group=pp_mesh.get_group())
              for part, stage_id, (example_in, example_out) in zip(parts, ids, examples)]
    schedule_class = get_schedule_class(schedule)
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)


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
