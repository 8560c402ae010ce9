"""Files of the adapter store (`<data_dir>/adapters/<policy>/<version>`): a version's directory is there complete,
or not at all, whatever happens while it is written (a full disk, a kill, a power loss).

A directory is filled under a temporary name beside its place (the same file system, so the rename is atomic),
its files and itself are fsynced, and only then is it renamed into place and the parent fsynced: a version's row,
committed after that, never names files still in the page cache only. A write that fails removes its temporary
directory. What a killed write leaves (a temporary directory, or a directory whose row was never committed) is
removed by the next writer of that version, which holds the policy's job lock (`remove_leftovers`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from storage.database import Database
from storage.policies import PolicyInfo, adapter_dir, get_adapter, next_version

log = logging.getLogger(__name__)


async def publish_version(
    db: Database,
    policy: PolicyInfo,
    data_dir: Path,
    save: Callable[[Path], None],
    record: Callable[[AsyncSession, int, Path], Awaitable[None]],
) -> tuple[int, Path]:
    """Add the policy's next version: `save` writes its directory (with `write_directory`, in a thread), then
    `record` adds its rows, committed together. Returns (version, directory).

    The caller holds the policy's job lock. Files and row appear together or not at all: a failed `save` leaves
    no directory and no row, and a row that cannot be committed (a full disk under SQLite, the database gone)
    takes the directory with it, unless the commit may have gone through after all. A directory left at that
    version by a run killed in between is replaced: no row names it (the version number says so), and the next
    run would otherwise find its place taken for good."""
    async with db.session() as session:
        version = await next_version(session, policy.id)
    target = adapter_dir(data_dir, policy.name, version)
    await asyncio.to_thread(remove_leftovers, target)
    await asyncio.to_thread(save, target)
    try:
        async with db.session() as session:
            await record(session, version, target)
            await session.commit()
    except Exception:
        if not await _maybe_recorded(db, policy.id, version):
            await asyncio.to_thread(shutil.rmtree, target, True)
        raise
    return version, target


async def _maybe_recorded(db: Database, policy_id: int, version: int) -> bool:
    """Whether a version's row may exist: True when the database cannot say (its files are kept then; the next
    run replaces them if no row names them)."""
    try:
        async with db.session() as session:
            return await get_adapter(session, policy_id, version) is not None
    except Exception:
        return True


def write_directory(target: Path, fill: Callable[[Path], None]) -> None:
    """Create `target` complete or not at all: `fill` writes into an empty temporary directory, which is made
    durable and renamed to `target`. Raises what `fill` or the file system raised (nothing is at `target` then),
    and FileExistsError if `target` exists."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    partial = Path(tempfile.mkdtemp(prefix=_partial_prefix(target), dir=target.parent))
    try:
        fill(partial)
        _sync_tree(partial)
        partial.chmod(0o755)
        os.rename(partial, target)
        _sync(target.parent)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def remove_leftovers(target: Path) -> None:
    """Remove what interrupted writes of `target` left: their temporary directories, and `target` itself, which
    the caller knows no row names. Only for the one writer of `target` (it holds the policy's job lock)."""
    if not target.parent.is_dir():
        return
    for partial in target.parent.glob(_partial_prefix(target) + "*"):
        log.warning("removing %s, left by an interrupted write of %s", partial, target)
        shutil.rmtree(partial, ignore_errors=True)
    if target.exists():
        log.warning("removing %s: no version row names it (a run stopped before recording it)", target)
        shutil.rmtree(target)


def _partial_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _sync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _sync(Path(directory) / name)
        _sync(Path(directory))


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
