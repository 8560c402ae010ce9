"""Adapter versions appear complete or not at all (`storage.adapter_store`), on SQLite and PostgreSQL: a write the
disk refuses leaves no directory, temporary or final, and no version row; a row that cannot be committed takes
its files with it; what a killed run left at a version's place is replaced by the next run."""

from __future__ import annotations

import asyncio
import errno
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.adapter_store import publish_version, write_directory
from storage.database import Database
from storage.policies import PolicyInfo, adapter_dir, add_adapter, create_policy, list_adapters


def fill_adapter(directory: Path) -> None:
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(bytes(256 * 2**10))


def test_a_write_the_disk_refuses_leaves_nothing(tmp_path: Path) -> None:
    """The kernel refuses the process's writes past 64 KiB a file (`RLIMIT_FSIZE`, which needs no privileges,
    unlike filling a mounted file system): the small file is written, the weights are not."""
    target = tmp_path / "adapters" / "p" / "1"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from storage.adapter_store import write_directory
        from tests.integration.test_adapter_store import fill_adapter
        write_directory(Path({str(target)!r}), fill_adapter)
        """
    )

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 2**10, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        check=False,
    )
    assert done.returncode == 1 and "File too large" in done.stderr, done.stderr
    assert list(target.parent.iterdir()) == []  # neither the version nor its temporary directory


def test_a_complete_write_is_renamed_into_place(tmp_path: Path) -> None:
    target = tmp_path / "adapters" / "p" / "1"
    write_directory(target, fill_adapter)
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["1"]
    with pytest.raises(FileExistsError):
        write_directory(target, fill_adapter)


async def _policy(url: str) -> tuple[Database, PolicyInfo]:
    await upgrade_database(url)
    db = Database(url)
    async with db.session() as session:
        policy = await create_policy(session, "p", "base")
        await add_adapter(session, policy.id, 0, "v0", status="active")
        await session.commit()
    return db, policy


async def _versions(db: Database, policy: PolicyInfo) -> list[int]:
    async with db.session() as session:
        return [adapter.version for adapter in await list_adapters(session, policy.id)]


def test_a_version_is_files_and_row_together_or_neither(tmp_path: Path, database_url: str) -> None:
    url = async_database_url(database_url)
    data_dir = tmp_path / "data"

    def full_disk(target: Path) -> None:
        def fill(directory: Path) -> None:
            (directory / "adapter_config.json").write_text("{}")
            raise OSError(errno.ENOSPC, "No space left on device")

        write_directory(target, fill)

    policy_id = 1  # the first policy of a fresh database

    async def record(session: AsyncSession, version: int, target: Path) -> None:
        await add_adapter(session, policy_id, version, str(target))

    async def row_refused(session: AsyncSession, version: int, target: Path) -> None:
        await record(session, version, target)
        raise RuntimeError("the database refused the row")

    def save(target: Path) -> None:
        write_directory(target, fill_adapter)

    async def scenario() -> None:
        db, policy = await _policy(url)
        assert policy.id == policy_id
        try:
            with pytest.raises(OSError, match="No space left"):
                await publish_version(db, policy, data_dir, full_disk, record)
            assert await _versions(db, policy) == [0]
            assert list(adapter_dir(data_dir, "p", 1).parent.iterdir()) == []

            with pytest.raises(RuntimeError, match="refused the row"):
                await publish_version(db, policy, data_dir, save, row_refused)
            assert await _versions(db, policy) == [0]
            assert list(adapter_dir(data_dir, "p", 1).parent.iterdir()) == []

            # A run killed after renaming its directory in, before its row: the next run takes the place.
            left = adapter_dir(data_dir, "p", 1)
            left.mkdir()
            (left / "stale").write_text("from the killed run")
            (left.parent / ".1.tmp-killed").mkdir()
            version, target = await publish_version(db, policy, data_dir, save, record)
            assert (version, target) == (1, left)
            assert await _versions(db, policy) == [0, 1]
            assert sorted(p.name for p in left.parent.iterdir()) == ["1"]
            assert sorted(p.name for p in left.iterdir()) == [
                "adapter_config.json",
                "adapter_model.safetensors",
            ]
        finally:
            await db.dispose()

    asyncio.run(scenario())
