"""Reads a W&B offline run (``offline-run-*/run-*.wandb``) back into config, history and summary.

W&B keeps an offline run only in its transaction log (no ``wandb-summary.json``), and the SDK no longer ships
a Python reader for it: the log is LevelDB's log format (32 KiB blocks of CRC-checked, possibly fragmented
records) after a 7-byte ``:W&B`` header, each record one ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The payloads of a W&B transaction log, fragments joined and checksums verified."""
    data = path.read_bytes()
    assert data.startswith(HEADER), data[:7]
    offset, pending = len(HEADER), b""
    while offset + RECORD_HEADER <= len(data):
        if BLOCK - offset % BLOCK < RECORD_HEADER:  # a block's tail too short for a header is padding
            offset += BLOCK - offset % BLOCK
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, offset)
        payload = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        if kind == 0 and length == 0:  # zero fill after the last record
            break
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == checksum, f"bad checksum at {offset}"
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        else:
            assert kind == LAST, kind
            yield pending + payload


@dataclass
class OfflineRun:
    project: str = ""
    name: str = ""
    group: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else str(item.key)


def read_offline_run(run_dir: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    [log] = run_dir.glob("run-*.wandb")
    run = OfflineRun()
    for payload in records(log):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.project, run.name, run.group = (
                record.run.project,
                record.run.display_name,
                record.run.run_group,
            )
            for item in record.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
