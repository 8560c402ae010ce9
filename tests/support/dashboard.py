"""Helpers of the dashboard tests: log in like the login page does, read a page's CSRF token, and store the
rows a training and a judging run leave behind (running real ones is other tests' business), and a run of a
shape the dashboard has never seen."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.jobs import start_job_run, update_run
from storage.policies import activate_version, add_adapter, create_policy, get_policy
from storage.rewards import record_judge_group

_CSRF = re.compile(r'<meta name="csrf-token" content="([^"]+)">')


def login(base_url: str, key: str) -> httpx.Client:
    """A client holding a dashboard session, with the CSRF header its pages' script would send."""
    client = httpx.Client(base_url=base_url, timeout=30)
    answer = client.post("/dashboard/session", json={"key": key})
    assert answer.status_code == 200, answer.text
    page = client.get("/dashboard/policies")
    assert page.status_code == 200, page.text
    client.headers["x-kaizen-csrf"] = csrf_token(page.text)
    return client


def csrf_token(html: str) -> str:
    found = _CSRF.search(html)
    assert found is not None, "the page has no CSRF token"
    return found.group(1)


def seed_policy_runs(url: str, policy: str, versions: int, adapter_root: str | None = None) -> None:
    """A policy with versions 0..versions-1 (0 active), a train run per later version with gate numbers and
    per-step loss, a failed train run, and two judge groups (one failed)."""

    async def run() -> None:
        await upgrade_database(async_database_url(url))
        database = Database(async_database_url(url))
        now = datetime.now(UTC)
        async with database.session() as session:
            info = await create_policy(session, policy, "base", {"schedule": {"judge_interval_s": 3600}})
            for version in range(versions):
                path = f"{adapter_root}/{version}" if adapter_root else f"/adapters/{policy}/{version}"
                await add_adapter(
                    session,
                    info.id,
                    version,
                    path,
                    parent_version=version - 1 if version else None,
                    metrics={"reward_mean": 0.2 + 0.1 * version, "loss": 0.5 / (version + 1)},
                )
            await activate_version(session, info.id, 0)
            for version in range(1, versions):
                run_id = await start_job_run(session, info.id, "train", version - 1, {"trigger": "manual"})
                metrics: dict[str, Any] = {
                    "groups": 4,
                    "samples": 32,
                    "reward_mean": 0.2 + 0.1 * version,
                    "loss": 0.5 / (version + 1),
                    "data": {"episodes": 16, "groups_kept": 4, "no_variance": 1},
                    "history": [{"step": s, "loss": 0.5 / (s + version)} for s in range(1, 5)],
                    "collapse": [{"step": s, "distinct_share": 1.0, "empty_share": 0.0} for s in (0, 4)],
                    "gate": {
                        "decision": "promote",
                        "candidate_version": version,
                        "active_version": version - 1,
                        "reasons": ["candidate is no worse"],
                        "groups": 8,
                        "candidate_reward": 0.3 + 0.1 * version,
                        "active_reward": 0.2 + 0.1 * version,
                        "tolerance": 0.02,
                        "collapse_problems": [],
                        "wall_s": 3.5,
                    },
                }
                await update_run(
                    session,
                    run_id,
                    status="succeeded",
                    to_version=version,
                    metrics=metrics,
                    finished_at=now - timedelta(minutes=10 * (versions - version)),
                )
            failed = await start_job_run(session, info.id, "train", 0, {"trigger": "schedule"})
            await update_run(
                session, failed, status="failed", error="collapse guard stopped the run", finished_at=now
            )
            for status in ("judged", "failed"):
                await record_judge_group(
                    session,
                    policy=policy,
                    group_key=f"prompt:{status}",
                    episode_ids=["e1", "e2"],
                    scorer="judge",
                    model="judge-model",
                    status=status,
                    attempts=1 if status == "judged" else 3,
                    error=None if status == "judged" else "judge timed out",
                    latency_ms=120.0,
                    cost_usd=0.0012 if status == "judged" else None,
                )
            await session.commit()
        await database.dispose()

    asyncio.run(run())


def seed_unusual_run(url: str, policy: str) -> int:
    """A run and a version whose metrics the dashboard has never seen: another training mode, new counters,
    a gate that is a word, a history without steps, collapse checks as an object."""

    async def run() -> int:
        database = Database(async_database_url(url))
        async with database.session() as session:
            info = await get_policy(session, policy)
            assert info is not None
            await add_adapter(
                session, info.id, 9, "/adapters/x/9", metrics={"mode": "sft", "loss": [0.3], "examples": 12}
            )
            run_id = await start_job_run(session, info.id, "train", 0, {"trigger": "manual", "mode": "sft"})
            await update_run(
                session,
                run_id,
                status="succeeded",
                to_version=9,
                metrics={
                    "mode": "sft",
                    "examples": 12,
                    "loss": "n/a",
                    "data": {"resampled": {"rare_successes": 3, "copies": 6}, "kept": 12},
                    "gate": "skipped",
                    "history": [{"loss": 0.4, "learning_rate": 1e-5}, {"loss": 0.3, "learning_rate": 2e-5}],
                    "collapse": {"checked": False},
                    "tags": ["bootstrap", "first"],
                },
                finished_at=datetime.now(UTC),
            )
            await session.commit()
        await database.dispose()
        return run_id

    return asyncio.run(run())
