"""Pipeline stage arithmetic (titan/parallel/stages.py) and the schedule report, on plain integers."""

import logging

import pytest

from titan.parallel.pp import log_schedule
from titan.parallel.stages import even_split, ideal_bubble_fraction, plan_stages, requested_num_stages, stage_ids


@pytest.mark.parametrize("num_layers, num_stages, schedule, counts", [
    (6, 2, "1F1B", (3, 3)),
    (7, 2, "1F1B", (4, 3)),  # the one extra block goes to the first stage: the last has the output matmul and loss
    (6, 4, "Interleaved1F1B", (1, 2, 2, 1)),  # extras go to the middle stages
    (7, 4, "Interleaved1F1B", (2, 2, 2, 1)),
    (126, 16, "Interleaved1F1B", (7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7)),  # 405B on PP 8 x 2 stages
    # A V: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; one extra block each keeps them at 3 blocks.
    (6, 4, "ZBVZeroBubble", (2, 2, 1, 1)),
    (7, 4, "ZBVZeroBubble", (2, 2, 2, 1)),
])
def test_even_split_spares_the_first_and_last_stage(num_layers: int, num_stages: int, schedule: str,
                                                    counts: tuple[int, ...]) -> None:
    assert even_split(num_layers, num_stages, num_stages // 2, schedule) == counts
    assert sum(counts) == num_layers


def test_split_points_give_uneven_stages() -> None:
    plan = plan_stages(6, 3, ["layers.1", "layers.4"], 3, "1F1B")
    assert plan.blocks == ((0,), (1, 2, 3), (4, 5))


@pytest.mark.parametrize("schedule, layers_per_stage, split_points, stages", [
    ("1F1B", None, [], 2),
    ("Interleaved1F1B", None, [], 4),
    ("ZBVZeroBubble", None, [], 4),
    ("Interleaved1F1B", 1, [], 6),
    ("GPipe", None, ["layers.2"], 2),
])
def test_requested_stages(schedule: str, layers_per_stage: int | None, split_points: list[str], stages: int) -> None:
    assert requested_num_stages(6, 2, schedule, layers_per_stage, split_points) == stages


def test_stage_placement_loops_or_forms_a_v() -> None:
    assert [stage_ids(rank, 2, 4, "Interleaved1F1B") for rank in range(2)] == [(0, 2), (1, 3)]
    assert [stage_ids(rank, 2, 4, "ZBVZeroBubble") for rank in range(2)] == [(0, 3), (1, 2)]
    assert [stage_ids(rank, 4, 4, "1F1B") for rank in range(4)] == [(0,), (1,), (2,), (3,)]


def test_ideal_bubble() -> None:
    assert ideal_bubble_fraction("1F1B", 2, 1, 4) == pytest.approx(1 / 5)
    assert ideal_bubble_fraction("GPipe", 8, 1, 8) == pytest.approx(7 / 15)
    assert ideal_bubble_fraction("Interleaved1F1B", 2, 2, 4) == pytest.approx(1 / 9)
    assert ideal_bubble_fraction("InterleavedZeroBubble", 2, 2, 4) == pytest.approx(1 / 25)
    assert ideal_bubble_fraction("1F1B", 1, 1, 4) == 0.0


def test_schedule_report_names_every_rank_stage_and_block(titan_records: list[logging.LogRecord]) -> None:
    log_schedule(plan_stages(6, 4, [], 2, "Interleaved1F1B"), "Interleaved1F1B", 2, num_microbatches=4,
                 microbatch_size=1)
    report = titan_records[0].getMessage()
    assert "Interleaved1F1B over 2 ranks, 4 stages (2 per rank), 4 micro-batches of 1 sequences" in report
    assert "ideal bubble 11.1%" in report
    assert "pp rank 0: stage 0: embedding + block 0, stage 2: blocks 3-4" in report
    assert "pp rank 1: stage 1: blocks 1-2, stage 3: block 5 + norm, output" in report
