"""The trainer's entry point, as the scheduler and an operator run it: `python -m trainer` in its own process,
and `kaizen train`, which builds the same inputs from the gateway's settings."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from storage.database import Database
from storage.policies import create_policy, get_policy, list_adapters
from storage.schema import upgrade_database
from tests.support.training_data import NO_COLLAPSE_BOUNDS, RewardedReply, write_rewarded_groups

REPO = Path(__file__).resolve().parents[2]
POLICY = "by-hand"
TRAIN = {
    "grouping": "key",
    "group_size": 3,
    "epochs": 1,
    "micro_batch_size": 3,
    "grad_accumulation": 1,
    "max_length": 64,
    "collapse_check_every": 0,
    "collapse_prompts": 1,
    "collapse_samples": 2,
    "collapse_max_new_tokens": 4,
    "collapse_bounds": NO_COLLAPSE_BOUNDS,
}


def _env() -> dict[str, str]:
    """This process's environment without any KAIZEN_* setting: the child gets only what the test passes."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}


def test_python_m_trainer_writes_a_candidate_and_kaizen_train_finds_nothing_new(
    tmp_path: Path, embedded_model: Path
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    async def setup() -> None:
        await upgrade_database(url)
        database = Database(url)
        try:
            async with database.session() as session:
                config = {"train": TRAIN, "gate": {"holdout_fraction": 0.0}}
                await create_policy(session, POLICY, str(embedded_model), config)
                await session.commit()
            groups = [
                ("Say hi.", [RewardedReply("hi", 1.0), RewardedReply("hello", 0.5), RewardedReply("", 0.0)])
            ]
            await write_rewarded_groups(database, POLICY, groups, "fixed")
        finally:
            await database.dispose()

    asyncio.run(setup())
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--policy",
            POLICY,
            "--data-dir",
            str(tmp_path / "data"),
            "--device",
            "cpu",
        ],
        env={**_env(), "KAIZEN_DATABASE_URL": url},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert trained.returncode == 0, trained.stderr[-4000:]

    async def adapters() -> list[tuple[int, str, str]]:
        database = Database(url)
        try:
            async with database.session() as session:
                policy = await get_policy(session, POLICY)
                assert policy is not None
                return [(a.version, a.status, a.path) for a in await list_adapters(session, policy.id)]
        finally:
            await database.dispose()

    [(version, status, path)] = asyncio.run(adapters())
    assert status == "candidate"
    assert Path(path).is_relative_to(tmp_path / "data") and (Path(path) / "adapter_config.json").is_file()

    # The same data again: `kaizen train` (settings from flags) runs, finds nothing new and exits 3.
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "train",
            "--policy",
            POLICY,
            "--database-url",
            f"sqlite:///{tmp_path / 'kaizen.db'}",
            "--data-dir",
            str(tmp_path / "data"),
            "--train-sampler",
            "local",
        ],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert again.returncode == 3, again.stderr[-4000:]
    assert "skipped" in again.stderr
    assert [v for v, _, _ in asyncio.run(adapters())] == [version]
