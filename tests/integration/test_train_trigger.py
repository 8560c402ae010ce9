"""The admin API's train trigger with a body: one run's `TrainConfig` overrides and data window, validated before
anything starts, and handed to the training child in its job."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import create_policy
from tests.conftest import query
from tests.support.polling import wait_until

ADMIN = {"Authorization": "Bearer admin-key"}


def test_a_train_body_is_validated_then_applied_to_the_run(
    make_gateway: Callable[..., Any], database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key="admin-key")

    async def setup() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                await create_policy(session, "trig", "base", {"train": {"grouping": "key"}})
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(setup())
    url = gw.url + "/admin/policies/trig/train"
    bad = httpx.post(url, headers=ADMIN, json={"overrides": {"mode": "dance", "lerning_rate": 1}}, timeout=30)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert (error["param"], error["code"]) == ("overrides", "invalid_policy_config")
    assert "train.mode" in error["message"] and "train.lerning_rate: unknown key" in error["message"]
    assert query(database_url, "SELECT count(*) AS n FROM training_runs")[0]["n"] == 0

    body = {"overrides": {"mode": "sft", "sft_min_reward": 0.5}, "since": "2026-02-03T04:05:06"}
    started = httpx.post(url, headers=ADMIN, json=body, timeout=60)
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]

    def finished() -> bool:
        run = httpx.get(f"{gw.url}/admin/runs/{run_id}", headers=ADMIN, timeout=10).json()
        return bool(run["status"] != "running")

    wait_until(finished, "the training child to finish", timeout_s=300, every_s=0.5)
    run = httpx.get(f"{gw.url}/admin/runs/{run_id}", headers=ADMIN, timeout=10).json()
    # Nothing to train on: the child ran with the overrides and the window, and said so.
    assert run["status"] == "skipped", run
    assert (run["config"]["mode"], run["config"]["sft_min_reward"]) == ("sft", 0.5)
    assert datetime.fromisoformat(run["config"]["data_since"]) == datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)
    [audit] = query(database_url, "SELECT details FROM audit WHERE action = 'run.train'")
    assert "sft_min_reward" in str(audit["details"])
