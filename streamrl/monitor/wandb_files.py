"""Read the history of an offline W&B run straight from its `.wandb` file (no network, no wandb service).

The file is a LevelDB-style log: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of
records, each with a 7-byte header (crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST).
Each reassembled record is a `wandb_internal_pb2.Record`; `history` records carry the logged rows.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_FILE_HEADER = 7
_RECORD_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("wandb file: missing ':W&B' header")
    pos, pending = _FILE_HEADER, b""
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += left_in_block
            continue
        chunk = data[pos + _RECORD_HEADER : pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """Logged rows of the offline W&B run under `run_dir` (searched recursively), in order: a run resumed by later
    starts of the job is one run (one id) over several offline directories, read in the order they were made."""
    from wandb.proto import wandb_internal_pb2 as pb

    # offline-run-YYYYMMDD_HHMMSS-<id>/run-<id>.wandb: the directory names sort by start time.
    files = sorted(Path(run_dir).rglob("offline-run-*/run-*.wandb"), key=lambda file: file.parent.name)
    ids = {file.stem.removeprefix("run-") for file in files}
    if len(ids) != 1:
        raise FileNotFoundError(f"expected one offline W&B run under {run_dir}, found {len(ids)}: {sorted(ids)}")
    rows = []
    for blob in (blob for file in files for blob in _records(file.read_bytes())):
        record = pb.Record()
        record.ParseFromString(blob)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
