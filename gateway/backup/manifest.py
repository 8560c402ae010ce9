"""A backup's `manifest.json`: what the backup holds (Kaizen version, schema revision, database kind, active
versions) and every file's size and SHA-256, so a restore can tell a whole backup from a damaged one."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal

import msgspec

from gateway.backup.errors import BackupError
from gateway.backup.progress import Meter, mib

log = logging.getLogger("kaizen")

#: The layout this code writes and reads; a restore refuses a backup of a later one.
FORMAT = 1
MANIFEST = "manifest.json"
_CHUNK = 2**20

DatabaseKind = Literal["sqlite", "postgresql"]

# The layout of a backup directory, beside the manifest.
DATABASE_FILES: dict[DatabaseKind, str] = {"sqlite": "database.sqlite3", "postgresql": "database.pgdump"}
ADAPTERS = "adapters"  # adapters/<policy>/<version>/..., as in the adapter store
CAPTURE = "capture"  # the capture log's segments, numbered in the order they are to be stored
DATA = "data"  # files of the data directory the stored data depends on
#: Keys generated once into the data directory: hashed redaction tokens and dashboard sessions depend on them.
DATA_FILES = ("redaction.key", "dashboard.key")
_PLACES = {*DATABASE_FILES.values(), ADAPTERS, CAPTURE, DATA}


class BackupFile(msgspec.Struct, frozen=True):
    path: str  # relative to the backup's directory, `/`-separated
    bytes: int
    sha256: str


class BackupAdapter(msgspec.Struct, frozen=True):
    """A version the database names. `in_backup` is false when its files were not in the adapter store."""

    policy: str
    version: int
    status: str
    in_backup: bool


class Manifest(msgspec.Struct, frozen=True):
    format: int
    kaizen_version: str
    schema_revision: str
    created_at: str  # ISO 8601, UTC: when the capture log was copied, the backup's point in time
    database: DatabaseKind
    database_file: str
    active_versions: dict[str, int | None]
    adapters: list[BackupAdapter]
    capture_calls: int  # lines in the capture log's copy (some may be stored in the database already)
    files: list[BackupFile]


class _Header(msgspec.Struct):
    """What every format's manifest starts with."""

    format: int
    kaizen_version: str = "?"


@dataclass
class _Streamed:
    size: int = 0
    sha256: str = ""
    lines: int = 0


def _stream(
    reader: BinaryIO, write: Callable[[bytes], object] | None = None, *, whole_lines: bool = False
) -> _Streamed:
    """Read to the end in chunks, hashing what is read and counting its lines, passing each chunk to `write`.
    `whole_lines`: stop after the last newline, leaving out a line being appended right now."""
    digest = hashlib.sha256()
    streamed = _Streamed()
    pending = b""
    while chunk := reader.read(_CHUNK):
        if whole_lines:
            data = pending + chunk
            end = data.rfind(b"\n") + 1
            chunk, pending = data[:end], data[end:]
        if write is not None:
            write(chunk)
        digest.update(chunk)
        streamed.size += len(chunk)
        streamed.lines += chunk.count(b"\n")
    streamed.sha256 = digest.hexdigest()
    return streamed


def copy_file(source: Path, target: Path, root: Path, *, whole_lines: bool = False) -> tuple[BackupFile, int]:
    """Copy `source` to `target` (under `root`), hashing it on the way; the entry and the lines copied.
    `whole_lines`: stop after the last newline, leaving out a line being appended right now (a capture log
    segment's)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as reader, target.open("wb") as writer:
        streamed = _stream(reader, writer.write, whole_lines=whole_lines)
    return BackupFile(target.relative_to(root).as_posix(), streamed.size, streamed.sha256), streamed.lines


def describe(path: Path, root: Path) -> BackupFile:
    """The manifest entry of a file already in the backup."""
    with path.open("rb") as reader:
        streamed = _stream(reader)
    return BackupFile(path.relative_to(root).as_posix(), streamed.size, streamed.sha256)


def write_manifest(root: Path, manifest: Manifest) -> None:
    encoded = msgspec.json.format(msgspec.json.encode(manifest), indent=2)
    (root / MANIFEST).write_bytes(encoded + b"\n")


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    if not path.is_file():
        raise BackupError(f"{root} is not a Kaizen backup: it has no {MANIFEST}")
    raw = path.read_bytes()
    try:
        header = msgspec.json.decode(raw, type=_Header)
        if header.format > FORMAT:
            raise BackupError(
                f"{path} is of backup format {header.format}, newer than this Kaizen reads ({FORMAT}): restore it "
                f"with Kaizen {header.kaizen_version} or later"
            )
        return msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackupError(f"{path} is damaged: {exc}") from exc


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is there, of its size and SHA-256; raises `BackupError` naming the first
    that is not."""
    total = sum(entry.bytes for entry in manifest.files)
    log.info("checking the %d files of the backup (%s)", len(manifest.files), mib(total))
    meter = Meter("checking the backup", total)
    for entry in manifest.files:
        parts = PurePosixPath(entry.path).parts
        if not parts or entry.path.startswith("/") or ".." in parts or parts[0] not in _PLACES:
            raise BackupError(f"the backup's manifest names a file outside the backup: {entry.path!r}")
        path = root / entry.path
        if not path.is_file():
            raise BackupError(f"the backup is incomplete: {entry.path} is missing")
        if path.stat().st_size != entry.bytes:
            raise BackupError(
                f"the backup is damaged: {entry.path} has {path.stat().st_size} bytes, the manifest says "
                f"{entry.bytes}"
            )
        with path.open("rb") as reader:
            streamed = _stream(reader, lambda chunk: meter.add(len(chunk)))
        if streamed.sha256 != entry.sha256:
            raise BackupError(
                f"the backup is damaged: {entry.path} does not match its SHA-256 in the manifest"
            )
    listed = {entry.path for entry in manifest.files} | {MANIFEST}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.relative_to(root).as_posix() not in listed:
            log.warning("%s is in the backup directory but not in its manifest: left out", path)
