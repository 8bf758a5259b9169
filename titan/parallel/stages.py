"""Pipeline stage arithmetic: which blocks each stage holds, which stages each rank runs, and a schedule's ideal
bubble. Plain integers only (no torch), so the pipeline's config rules (titan/parallel/rules.py) check a layout with
the same code that builds it (titan/parallel/pp.py), and the dry run prices its bubble."""

from dataclasses import dataclass

# Schedules that run several stages per rank; the rest run one.
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
# Rank r of p runs stages r and 2p-1-r (a V), so the last stage sits next to the first and the loss is computed on
# rank 0; the other looped schedules place stage s on rank s mod p.
V_SCHEDULES = ("ZBVZeroBubble",)
# Schedules that split backward into input-gradient and weight-gradient passes, scheduling weight passes into
# the bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
# Schedules whose rounds of microbatches torch requires to divide the microbatch count.
ROUND_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


@dataclass(frozen=True)
class StagePlan:
    """The block ids of every stage, in pipeline order (the first stage also holds the embedding, the last the
    norm and output)."""

    blocks: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.blocks)


def default_stages_per_rank(schedule: str) -> int:
    return 2 if schedule in LOOPED_SCHEDULES else 1


def extra_block_order(num_stages: int, pp: int, schedule: str) -> list[int]:
    """Which stages get the blocks left over from an even split, first to last. In a V (rank r runs stages r and
    2p-1-r) one extra per rank, inner ranks first, so ranks stay balanced; otherwise the middle stages first, since
    the first and last stage also carry the embedding and the output projection, and the last stage (the
    vocab-sized output matmul and the loss) last of all."""
    if schedule in V_SCHEDULES:
        return [*range(pp - 1, -1, -1), *range(pp, num_stages)]
    return [*range(1, num_stages - 1), 0, num_stages - 1][:num_stages]


def even_split(num_layers: int, num_stages: int, pp: int, schedule: str) -> tuple[int, ...]:
    """Blocks per stage, as even as possible, with the remainder placed by extra_block_order."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    for stage in extra_block_order(num_stages, pp, schedule)[:extra]:
        counts[stage] += 1
    return tuple(counts)


def split_point_layers(split_points: list[str]) -> list[int]:
    """"layers.3" -> 3. Raises ValueError on anything else."""
    layers = []
    for point in split_points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit():
            raise ValueError(point)
        layers.append(int(index))
    return layers


def plan_stages(num_layers: int, num_stages: int, split_points: list[str], pp: int, schedule: str) -> StagePlan:
    """Stages from split points ("layers.k" starts a stage) when given, else an even split into num_stages.
    Validation has checked that the points are increasing and inside the model."""
    if split_points:
        bounds = [0, *split_point_layers(split_points), num_layers]
    else:
        bounds = [0]
        for count in even_split(num_layers, num_stages, pp, schedule):
            bounds.append(bounds[-1] + count)
    return StagePlan(tuple(tuple(range(start, end)) for start, end in zip(bounds, bounds[1:])))


def requested_num_stages(num_layers: int, pp: int, schedule: str, layers_per_stage: int | None,
                         split_points: list[str]) -> int:
    """Stages the config asks for: split points + 1, else layers / layers_per_stage, else stages per rank x pp."""
    if split_points:
        return len(split_points) + 1
    if layers_per_stage is not None:
        return -(-num_layers // layers_per_stage)
    return default_stages_per_rank(schedule) * pp


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str) -> tuple[int, ...]:
    """The stages rank pp_rank runs, in pipeline order."""
    if schedule in V_SCHEDULES:
        return tuple(sorted((pp_rank, num_stages - 1 - pp_rank)))
    return tuple(range(pp_rank, num_stages, pp))


def ideal_bubble_fraction(schedule: str, pp: int, stages_per_rank: int, num_microbatches: int) -> float:
    """Share of a step each rank idles in the schedule's ideal timeline, with equal-cost stages and no
    communication time. GPipe/1F1B: (p-1)/(m+p-1). Looped schedules cut each idle slot to one of v virtual stages:
    (p-1)/(vm+p-1) (Narayanan et al. 2021). Zero-bubble schedules fill all but a third of that with weight-gradient
    passes when forward, input-gradient and weight-gradient passes cost the same (ZB-H1, Qi et al. 2023):
    (p-1)/(3vm+p-1)."""
    if pp == 1:
        return 0.0
    work = stages_per_rank * num_microbatches * (3 if schedule in ZERO_BUBBLE_SCHEDULES else 1)
    return (pp - 1) / (work + pp - 1)
