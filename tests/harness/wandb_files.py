"""Reading a W&B run's transaction log (run-<id>.wandb), which an offline run writes and `wandb sync` uploads.

wandb 0.31 reads it in its Go core only, so the tests read it here: LevelDB's log framing (32 KiB blocks of
checksummed chunks, github.com/google/leveldb doc/log_format.md) after W&B's 7-byte header (":W&B", a magic number,
a version), and each record parsed by wandb's own protobuf message (wandb.proto.wandb_internal_pb2.Record).
"""

import json
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
CHUNK_HEADER = 7  # checksum (4), length (2, little-endian), chunk type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, position = [], b"", 7
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:  # a block's tail too short for a chunk is padding
            position += left_in_block
            continue
        length = int.from_bytes(data[position + 4:position + 6], "little")
        kind = data[position + 6]
        payload = data[position + CHUNK_HEADER:position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + payload)
            records.append(record)
            pending = b""
        elif kind in (FIRST, MIDDLE):
            pending += payload
    return records


def run_history(run_file: Path) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(the run id, its config, its history rows in order: each {"_step": ..., tag: value})."""
    run_id, config, rows = "", {}, []
    for record in read_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, config, rows
