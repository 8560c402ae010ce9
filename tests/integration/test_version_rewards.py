"""Live reward per version and the comparison of two versions: admin API, CLI, the dashboard's policy page and
/metrics, on SQLite and PostgreSQL.

The numbers are those of tests/unit/test_version_rewards.py: version 0 served rewards [0, 1, 1, 0], version 1
[1, 1, 1, 0, 1] (the 0 three days ago), version 2 nothing rewarded yet."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from gateway.commands.main import main
from gateway.settings import async_database_url
from storage.database import Database
from storage.models import Call, Episode
from tests.integration.test_metrics import scrape, value
from tests.integration.test_policy_admin import seed_policy
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}


def seed_episodes(url: str) -> datetime:
    """Episodes of `bot` (and one of another policy) served by known versions; returns a time between the old
    episode and the recent ones."""
    now = datetime.now(UTC)
    # (versions of its calls in order, reward, age)
    episodes: list[tuple[list[int | None], float | None, timedelta]] = [
        ([0], 0.0, timedelta(minutes=5)),
        ([0], 1.0, timedelta(minutes=5)),
        ([0], 1.0, timedelta(minutes=5)),
        ([0, 1], 0.0, timedelta(minutes=4)),  # counts for the version of its first call
        ([0], None, timedelta(minutes=4)),  # not rewarded: not counted
        ([1], 1.0, timedelta(minutes=3)),
        ([1], 1.0, timedelta(minutes=3)),
        ([1], 1.0, timedelta(minutes=3)),
        ([1], 1.0, timedelta(minutes=3)),
        ([1], 0.0, timedelta(days=3)),
        ([2], None, timedelta(minutes=1)),
    ]

    async def run() -> None:
        database = Database(async_database_url(url))
        async with database.session() as session:
            other: tuple[list[int | None], float | None, timedelta] = ([1], 0.0, timedelta(minutes=2))
            for n, (versions, reward, age) in enumerate([*episodes, other]):
                policy = "bot" if n < len(episodes) else "other"
                at = now - age
                session.add(Episode(id=f"ep{n}", policy=policy, reward=reward, created_at=at, updated_at=at))
                await session.flush()
                for position, version in enumerate(versions):
                    session.add(
                        Call(
                            id=f"call{n}-{position}",
                            episode_id=f"ep{n}",
                            position=position,
                            policy=policy,
                            model=policy,
                            adapter_version=version,
                            request={"messages": []},
                            latency_ms=1.0,
                            status="ok",
                            created_at=at + timedelta(seconds=position),
                        )
                    )
            await session.commit()
        await database.dispose()

    asyncio.run(run())
    return now - timedelta(days=1)


def test_version_rewards_and_comparison_over_the_admin_api(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy(database_url, 3)
    since = seed_episodes(database_url)
    gw = make_gateway(database_url, admin_key="adm")
    base = gw.url + "/admin/policies/bot/versions"
    assert httpx.get(base + "/rewards").status_code == 401

    listed = httpx.get(base + "/rewards", headers=ADMIN).json()
    assert (listed["policy"], listed["since"], listed["confidence"]) == ("bot", None, 0.95)
    rows = {v["version"]: v for v in listed["versions"]}
    assert [v["version"] for v in listed["versions"]] == [0, 1, 2]
    assert (rows[0]["status"], rows[0]["episodes"], rows[0]["mean"]) == ("active", 4, 0.5)
    assert rows[0]["std"] == pytest.approx(0.577350, abs=1e-6)
    assert (rows[0]["ci_low"], rows[0]["ci_high"]) == (
        pytest.approx(-0.065793, abs=1e-6),
        pytest.approx(1.065793, abs=1e-6),
    )
    assert (rows[1]["episodes"], rows[1]["mean"]) == (5, pytest.approx(0.8))
    assert rows[2] == {
        "version": 2,
        "status": "candidate",
        "episodes": 0,
        "mean": None,
        "std": None,
        "ci_low": None,
        "ci_high": None,
    }

    compared = httpx.get(base + "/compare", params={"a": 0, "b": 1}, headers=ADMIN)
    assert compared.status_code == 200
    body = compared.json()
    assert (body["a"]["version"], body["b"]["version"]) == (0, 1)
    assert body["difference"]["diff"] == pytest.approx(0.3)
    assert (body["difference"]["ci_low"], body["difference"]["ci_high"]) == (
        pytest.approx(-0.388317, abs=1e-6),
        pytest.approx(0.988317, abs=1e-6),
    )
    assert body["difference"]["excludes_zero"] is False

    # Since yesterday: version 1's old 0 drops out, leaving four 1s.
    recent = httpx.get(
        base + "/compare", params={"a": 1, "b": 0, "since": since.isoformat()}, headers=ADMIN
    ).json()
    assert (recent["b"]["episodes"], recent["a"]["episodes"], recent["a"]["mean"]) == (4, 4, 1.0)
    assert recent["difference"]["diff"] == pytest.approx(-0.5)
    naive = since.replace(tzinfo=None).isoformat()  # read as UTC
    assert (
        httpx.get(base + "/rewards", params={"since": naive}, headers=ADMIN).json()["versions"][1]["episodes"]
        == 4
    )
    # Nothing rewarded on version 2: the difference is undefined, not an error.
    empty = httpx.get(base + "/compare", params={"a": 0, "b": 2}, headers=ADMIN).json()
    assert empty["difference"] == {"diff": None, "ci_low": None, "ci_high": None, "excludes_zero": False}

    for params, code, param in (
        ({"a": 0, "b": 9}, "version_not_found", "b"),
        ({"a": 7, "b": 1}, "version_not_found", "a"),
    ):
        missing = httpx.get(base + "/compare", params=params, headers=ADMIN)
        assert missing.status_code == 404
        assert (missing.json()["error"]["code"], missing.json()["error"]["param"]) == (code, param)
    for route in ("rewards", "compare?a=0&b=1"):
        unknown = httpx.get(f"{gw.url}/admin/policies/nobody/versions/{route}", headers=ADMIN)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "policy_not_found"
    bad_params: list[dict[str, str | int]] = [
        {"a": 0},
        {"a": "x", "b": 1},
        {"a": -1, "b": 1},
        {"a": 0, "b": 1, "since": "soon"},
    ]
    for bad_query in bad_params:
        bad = httpx.get(base + "/compare", params=bad_query, headers=ADMIN)
        assert bad.status_code == 400, bad_query
        assert bad.json()["error"]["type"] == "invalid_request_error"


def test_compare_from_the_cli(database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed_policy(database_url, 3)
    seed_episodes(database_url)
    flags = ["--database-url", database_url, "--data-dir", str(tmp_path)]
    assert main(["policy", "compare", "bot", "0", "1", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[1:3]] == [["0", "4", "0.5000"], ["1", "5", "0.8000"]]
    assert "[-0.0658, 1.0658]" in lines[1]
    assert lines[3].split()[:3] == ["1", "-", "0"]
    assert "+0.3000  [-0.3883, +0.9883]  no clear difference" in lines[3]
    assert main(["policy", "compare", "bot", "0", "9", *flags]) == 2
    assert main(["policy", "compare", "nobody", "0", "1", *flags]) == 2
    # --since reads like every other command's: a relative age leaves out version 1's three-day-old 0.0.
    assert main(["policy", "compare", "bot", "0", "1", "--since", "1d", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:3] == ["1", "4", "1.0000"]
    assert main(["policy", "compare", "bot", "0", "1", "--since", "lately", *flags]) == 2


def test_the_policy_page_shows_each_versions_live_reward(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy(database_url, 3)
    seed_episodes(database_url)
    gw = make_gateway(database_url, admin_key="adm")
    page = login(gw.url, "adm").get("/dashboard/policies/bot")
    assert page.status_code == 200
    table = re.search(r'<table class="list" id="live-reward">(.*?)</table>', page.text, re.S)
    assert table is not None
    rows = {
        version: [
            re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        ]
        for version, row in re.findall(r'<tr data-version="(\w+)">(.*?)</tr>', table.group(1), re.S)
    }
    assert list(rows) == ["2", "1", "0"]  # newest first, like the versions table
    assert rows["0"] == ["v0", "active", "4", "0.5", "0.577", "-0.0658 – 1.07"]
    assert rows["1"][:4] == ["v1", "candidate", "5", "0.8"]
    assert rows["2"] == ["v2", "candidate", "0", "–", "–", "–"]
    chart = re.search(r'id="live-reward-chart">(.*?)</section>', page.text, re.S)
    assert chart is not None and "<svg" in chart.group(1)
    assert all(name in chart.group(1) for name in ("mean", "95% upper", "95% lower", ">v0<", ">v1<"))


def test_metrics_report_the_last_days_live_reward_per_version(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy(database_url, 3)
    seed_episodes(database_url)
    gw = make_gateway(database_url, admin_key="adm", metrics_db_interval_s=0.05)
    samples = scrape(gw, ADMIN)
    assert value(samples, "kaizen_live_reward_episodes", policy="bot", version="0") == 4
    assert value(samples, "kaizen_live_reward_mean", policy="bot", version="0") == 0.5
    half = value(samples, "kaizen_live_reward_ci95_half_width", policy="bot", version="0")
    assert half == pytest.approx(0.565793, abs=1e-6)
    # The last 24 hours: version 1's reward of three days ago is not in them.
    assert value(samples, "kaizen_live_reward_episodes", policy="bot", version="1") == 4
    assert value(samples, "kaizen_live_reward_mean", policy="bot", version="1") == 1.0
    assert value(samples, "kaizen_live_reward_episodes", policy="other", version="1") == 1
    labelled = {
        (dict(labels)["policy"], dict(labels)["version"])
        for name, labels in samples
        if name == "kaizen_live_reward_ci95_half_width"
    }
    assert labelled == {("bot", "0"), ("bot", "1")}  # none for one episode, nor for a version with no reward
