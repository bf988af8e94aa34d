"""Read the records of an offline W&B run's `.wandb` file (wandb 0.31 ships no reader).

The file is W&B's LevelDB-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then
32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full / first /
middle / last piece) and a protobuf `wandb_internal_pb2.Record` as payload. A header never
straddles a block: fewer than 7 bytes left in a block are zero padding.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a .wandb log"
    out, pos, pieces = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # zero padding to the next block
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and crc == 0 and kind == 0:  # the unwritten tail
            break
        payload = data[pos + HEADER : pos + HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"{path}@{pos}: bad crc"
        pos += HEADER + length
        pieces = payload if kind in (FULL, FIRST) else pieces + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """The logged history rows (`_step` and every logged key, JSON-decoded), in order."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_record(path: Path) -> wandb_internal_pb2.RunRecord:
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return run


def config(path: Path) -> dict:
    """The run's config as sent at start (the run record) and updated later."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def exit_code(path: Path) -> int | None:
    codes = [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None
