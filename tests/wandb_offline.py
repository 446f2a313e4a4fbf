"""Reads what an offline W&B run wrote (`run-<id>.wandb`), for tests: the run's id and its
history rows. wandb ships no reader of these files any more; the format is a LevelDB-style log
(a 7-byte header, then records in 32 KiB blocks, each record a 7-byte header — checksum,
length, type — and a protobuf `Record`), the file `wandb sync` uploads."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    payloads, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos : pos + length], pos + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
    return payloads


def read_offline_run(run_file: Path) -> tuple[str, list[dict[str, Any]]]:
    """(run id, history rows with their `_step`) of one offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, rows = "", []
    for payload in _payloads(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run_id, rows
