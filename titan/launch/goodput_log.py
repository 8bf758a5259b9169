"""What the launcher reads from and writes to the job's goodput log (titan/metrics/goodput.py): the last step
finished, each failed attempt, and the job's record when its last attempt could not write it."""

import json
import time
from pathlib import Path

from titan.metrics.goodput import EventLog, measure_goodput, read_events, summary
from titan.metrics.log import logger


def last_finished_step(events: list[dict]) -> int | None:
    """The last step rank 0 finished, from the goodput log's events; None before any (or with the log on another
    node)."""
    steps = [event["step"] for event in events if event.get("event") == "step"]
    return steps[-1] if steps else None


def record_failure(dump_folder: Path, rank: int, code: int) -> None:
    """Append a failure to the job's goodput log (the node of group rank 0 does, once per failure)."""
    events = EventLog(dump_folder, enabled=True)
    events.write("failure", rank=rank, code=code)
    events.close()


def record_goodput_after_failure(dump_folder: Path) -> None:
    """Write the job's goodput record to the console and metrics.jsonl when its last attempt could not (it crashed,
    hung or was killed): the launcher's record is the last word on the job."""
    events = read_events(dump_folder)
    starts = [index for index, event in enumerate(events) if event.get("event") == "start"]
    if not starts or any(event.get("event") == "end" for event in events[starts[-1]:]):
        return
    record = measure_goodput(events, now=time.time()).record(last_finished_step(events) or 0)
    logger.info(summary(record))
    with (dump_folder / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(record) + "\n")
