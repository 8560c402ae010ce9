"""`kaizen backup DEST`: a consistent backup while the gateway serves.

The order is what makes it consistent:

1. **The capture log first.** The writer deletes a segment only once every call in it is committed, so a call
   answered before the copy starts is in the copy, or was committed before the database snapshot that follows.
   Calls in both places are stored once: the writer skips a call whose id is stored already.
2. **The database**, as of one moment (`gateway.backup.databases`), with the schema revision and the adapter
   versions read from that same snapshot.
3. **The adapter files of every version the snapshot names.** A version's row is written only after its files
   are complete, and its files are deleted only after its row, so the versions of a snapshot taken earlier
   still have theirs (unless retention pruned that version in between: it is then reported, and its row is
   kept without files).
4. The keys generated into the data directory (`redaction.key`, `dashboard.key`).

Everything is written into a hidden directory beside `DEST`, renamed to `DEST` once the manifest is written, so a
backup that failed or was interrupted never looks like one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gateway.backup.databases import (
    Contents,
    StoredVersion,
    database_kind,
    find_tool,
    snapshot_postgres,
    snapshot_sqlite,
)
from gateway.backup.errors import BackupError
from gateway.backup.manifest import (
    ADAPTERS,
    CAPTURE,
    DATA,
    DATA_FILES,
    DATABASE_FILES,
    FORMAT,
    BackupAdapter,
    BackupFile,
    Manifest,
    copy_file,
    describe,
    write_manifest,
)
from gateway.backup.progress import Meter, mib
from gateway.capture.writer import segment_numbers, segment_path
from gateway.settings import Settings
from storage.policies import adapter_dir

log = logging.getLogger("kaizen")

#: The spool file of versions before the capture log, stored by a gateway like a leftover segment.
_LEGACY_SPOOL = "calls.jsonl"


def capture_log_files(data_dir: Path) -> list[Path]:
    """Every capture log file under the data directory, in the order the writers store them: each capture
    directory's (the first gateway's, then `replica-1`, ...) segments oldest first, then its legacy spool."""
    root = data_dir / "spool"
    replicas = [path for path in root.glob("replica-*") if path.name.removeprefix("replica-").isdigit()]
    found: list[Path] = []
    for directory in [root, *sorted(replicas, key=lambda path: int(path.name.removeprefix("replica-")))]:
        found.extend(segment_path(directory / "log", number) for number in segment_numbers(directory / "log"))
        if (directory / _LEGACY_SPOOL).is_file():
            found.append(directory / _LEGACY_SPOOL)
    return found


@dataclass
class _Copied:
    files: list[BackupFile]
    calls: int = 0


def _copy_capture_log(data_dir: Path, work: Path) -> _Copied:
    copied = _Copied([])
    for source in capture_log_files(data_dir):
        target = segment_path(work / CAPTURE, len(copied.files))
        try:
            entry, lines = copy_file(source, target, work, whole_lines=True)
        except FileNotFoundError:  # stored and deleted since it was listed: in the database snapshot to come
            target.unlink(missing_ok=True)
            continue
        if not entry.bytes:
            target.unlink()
            continue
        copied.files.append(entry)
        copied.calls += lines
    log.info("capture log: %d calls in %d segments copied", copied.calls, len(copied.files))
    return copied


def _adapter_source(version: StoredVersion, data_dir: Path) -> Path | None:
    """Where a version's files are: the path its row names, else its place in this data directory's store
    (a row written by a process whose working directory or data directory was elsewhere)."""
    for candidate in (Path(version.path), adapter_dir(data_dir, version.policy, version.version)):
        if candidate.is_dir():
            return candidate
    return None


def _tree_size(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size if path.is_file() else 0
    return total


def _copy_adapters(
    contents: Contents, data_dir: Path, work: Path
) -> tuple[list[BackupAdapter], list[BackupFile]]:
    sources: list[tuple[StoredVersion, Path | None]] = []
    for version in contents.versions:
        safe = version.policy not in ("", ".", "..") and "/" not in version.policy
        sources.append((version, _adapter_source(version, data_dir) if safe else None))
    total = sum(_tree_size(source) for _, source in sources if source is not None)
    log.info("copying the files of %d adapter versions (%s)", len(sources), mib(total))
    meter = Meter("copying adapter files", total)
    adapters: list[BackupAdapter] = []
    files: list[BackupFile] = []
    for version, source in sources:
        target = work / ADAPTERS / version.policy / str(version.version)
        copied: list[BackupFile] = []
        try:
            if source is None:
                raise FileNotFoundError(version.path)
            target.mkdir(parents=True, exist_ok=True)
            for path in sorted(source.rglob("*")):
                if path.is_file():
                    copied.append(copy_file(path, target / path.relative_to(source), work)[0])
                    meter.add(copied[-1].bytes)
        except FileNotFoundError:
            shutil.rmtree(target, ignore_errors=True)
            active = contents.active_versions.get(version.policy) == version.version
            log.warning(
                "%s@%d%s: no files at %s (pruned while the backup ran?): its row is backed up without them",
                version.policy,
                version.version,
                " (the active version)" if active else "",
                version.path,
            )
            adapters.append(BackupAdapter(version.policy, version.version, version.status, in_backup=False))
            continue
        files.extend(copied)
        adapters.append(BackupAdapter(version.policy, version.version, version.status, in_backup=True))
    return adapters, files


def _copy_data_files(data_dir: Path, work: Path) -> list[BackupFile]:
    return [
        copy_file(data_dir / name, work / DATA / name, work)[0]
        for name in DATA_FILES
        if (data_dir / name).is_file()
    ]


def _start(destination: Path) -> Path:
    """The hidden directory the backup is written into, beside `destination`."""
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise BackupError(f"{destination} exists and is not empty: back up into a new directory")
    destination.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent))


def _finish(work: Path, destination: Path, manifest: Manifest) -> None:
    write_manifest(work, manifest)
    if destination.exists():
        destination.rmdir()
    work.rename(destination)


async def take_backup(settings: Settings, destination: Path) -> Manifest:
    """Back up the database, adapter store and capture log `settings` name into the new directory `destination`."""
    kind = database_kind(settings.database_url)
    if kind == "postgresql":
        find_tool("pg_dump", settings.pg_bin_dir)  # missing: say so before copying anything
    work = await asyncio.to_thread(_start, destination)
    try:
        taken_at = datetime.now(UTC)
        capture = await asyncio.to_thread(_copy_capture_log, settings.data_dir, work)
        database_file = work / DATABASE_FILES[kind]
        if kind == "sqlite":
            contents = await snapshot_sqlite(settings.database_url, database_file)
        else:
            contents = await snapshot_postgres(settings.database_url, database_file, settings.pg_bin_dir)
        database = await asyncio.to_thread(describe, database_file, work)
        adapters, adapter_files = await asyncio.to_thread(_copy_adapters, contents, settings.data_dir, work)
        data_files = await asyncio.to_thread(_copy_data_files, settings.data_dir, work)
        manifest = Manifest(
            format=FORMAT,
            kaizen_version=importlib.metadata.version("kaizen"),
            schema_revision=contents.revision,
            created_at=taken_at.isoformat(),
            database=kind,
            database_file=database.path,
            active_versions=contents.active_versions,
            adapters=adapters,
            capture_calls=capture.calls,
            files=[database, *adapter_files, *capture.files, *data_files],
        )
        await asyncio.to_thread(_finish, work, destination, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info(
        "backup written to %s: %s, schema %s, %d adapter versions, %d calls from the capture log, %s",
        destination,
        kind,
        manifest.schema_revision,
        len(adapters),
        manifest.capture_calls,
        mib(sum(entry.bytes for entry in manifest.files)),
    )
    return manifest
