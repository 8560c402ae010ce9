"""Rollouts and pins through a real gateway over a scripted vLLM-like engine, on SQLite and PostgreSQL: a split
serves its share sticky per user and per episode, pins win over it, the canary monitor promotes a version that
is no worse and rolls back one that is worse (on reward, and at once on health), every decision lands in the
audit log, the rollout row and the run's record, and a switch by hand settles a running rollout."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.commands.main import main
from gateway.settings import async_database_url
from storage.calls import write_calls
from storage.database import Database
from storage.jobs import get_run
from storage.policies import (
    activate_version,
    adapter_dir,
    add_adapter,
    create_policy,
    get_adapter,
    get_policy,
)
from storage.records import CallRecord
from storage.retention import prune_adapters
from storage.rollouts import (
    RolloutRefused,
    end_rollout,
    list_rollouts,
    running_rollout,
    set_pin,
    start_rollout,
)
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.sql import fetch_rows, in_session
from tests.support.upstream_process import UpstreamProcess
from trainer.control.canary import gather, judge, watch
from trainer.control.policy_config import InvalidPolicyConfig, RolloutConfig, load_policy_config

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}


def register_versions(url: str, data_dir: Path, versions: int, config: dict[str, Any] | None = None) -> None:
    """Policy `bot` with versions 0..versions-1, version 0 active."""

    async def register(session: AsyncSession) -> None:
        policy = await create_policy(
            session, "bot", "scripted-1", {"schedule": {"paused": True}, **(config or {})}
        )
        for version in range(versions):
            path = adapter_dir(data_dir, "bot", version)
            path.mkdir(parents=True, exist_ok=True)
            await add_adapter(session, policy.id, version, str(path), status="candidate")
        await activate_version(session, policy.id, 0)

    in_session(url, register)


@pytest.fixture
def engine() -> Iterator[UpstreamProcess]:
    """A scripted engine of this test's own (adapters loaded by another test's gateway would collide)."""
    process = UpstreamProcess().start()
    yield process
    process.kill()


def rollout_gateway(
    make_gateway: MakeGateway, url: str, engine: UpstreamProcess, **overrides: Any
) -> GatewayServer:
    return make_gateway(
        url,
        engine="vllm",
        vllm_url=engine.url,
        base_model="scripted-1",
        admin_key="adm",
        policy_refresh_s=0.2,
        **overrides,
    )


def chat(gateway: GatewayServer, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "bot", "messages": [{"role": "user", "content": "hi"}], **body},
        headers=headers or {},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


def served(response: httpx.Response) -> str:
    return str(response.headers["x-kaizen-model"])


def serves(gateway: GatewayServer, model: str, headers: dict[str, str] | None = None, **body: Any) -> bool:
    """Whether a call is served by `model` now (False while the gateway has not read the policy yet)."""
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "bot", "messages": [{"role": "user", "content": "hi"}], **body},
        headers=headers or {},
        timeout=30,
    )
    return response.status_code == 200 and response.headers.get("x-kaizen-model") == model


def start(gateway: GatewayServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(gateway.url + "/admin/policies/bot/rollouts", json=body, headers=ADMIN, timeout=10)
    assert response.status_code == 201, response.text
    return dict(response.json())


def wait_for_trial(gateway: GatewayServer, version: int | None) -> None:
    """Until the router holds the rollout (or none): a call with a user in the trial's share is served by it."""

    def holds() -> bool:
        state = gateway.services.router.policies.get("bot")
        trial = state.trial if state is not None else None
        return (trial.version if trial is not None else None) == version

    wait_until(holds, f"the router to hold trial version {version}")


def test_a_split_serves_its_share_sticky_per_user_and_episode(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    register_versions(database_url, gateway.settings.data_dir, 2)
    wait_until(lambda: serves(gateway, "bot@0"), "bot@0 to be served")
    rollout = start(gateway, version=1, share=0.3, mode="split")
    assert (rollout["mode"], rollout["baseline_version"], rollout["status"]) == ("split", 0, "running")
    wait_for_trial(gateway, 1)

    by_user = {f"user-{i}": served(chat(gateway, user=f"user-{i}")) for i in range(200)}
    share = sum(1 for v in by_user.values() if v == "bot@1") / len(by_user)
    assert 0.2 <= share <= 0.4, share  # 0.3 ± 3.5 standard deviations of 200 draws
    # Sticky: the same users, asked again, get the same versions.
    assert all(served(chat(gateway, user=user)) == version for user, version in list(by_user.items())[:40])
    # Without a user, an episode's calls stay on one version.
    for i in range(20):
        header = {"x-episode-id": f"ep-{i}"}
        assert len({served(chat(gateway, header)) for _ in range(3)}) == 1
    # A conversation the gateway stitches (no user, no episode id) stays on one version turn after turn.
    versions = set()
    for i in range(30):
        turns = [{"role": "user", "content": f"conversation {i}"}]
        first = chat(gateway, messages=turns)
        answer = first.json()["choices"][0]["message"]
        follow = chat(gateway, messages=[*turns, {"role": "assistant", "content": answer["content"]}, *turns])
        assert follow.headers["x-episode-id"] == first.headers["x-episode-id"]
        assert served(follow) == served(first)
        versions.add(served(first))
    assert versions == {"bot@0", "bot@1"}  # random episode ids: all 30 on one side once in 40,000 runs
    # Each call is stored with the version that served it.
    rows = asyncio.run(
        fetch_rows(database_url, 'SELECT "user", adapter_version FROM calls WHERE "user" IS NOT NULL')
    )
    assert rows and all(f"bot@{r['adapter_version']}" == by_user[r["user"]] for r in rows)


def test_pins_of_a_key_and_a_project_win_over_the_active_version_and_a_split(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    register_versions(database_url, gateway.settings.data_dir, 3)
    keys = {}
    for name, project in (("shop-a", "shop"), ("shop-b", "shop"), ("ops", "ops")):
        response = httpx.post(
            gateway.url + "/admin/keys",
            json={"name": name, "scopes": ["chat"], "project": project},
            headers=ADMIN,
            timeout=10,
        )
        assert response.status_code == 201, response.text
        keys[name] = response.json()
    as_key = {name: {"authorization": f"Bearer {key['secret']}"} for name, key in keys.items()}
    wait_until(lambda: serves(gateway, "bot@0", as_key["ops"]), "bot@0 to be served")

    pin = httpx.post(
        gateway.url + "/admin/policies/bot/pins",
        json={"scope": "project", "subject": "shop", "version": 1},
        headers=ADMIN,
        timeout=10,
    )
    assert pin.status_code == 200, pin.text
    by_key = httpx.post(
        gateway.url + "/admin/policies/bot/pins",
        json={"scope": "key", "subject": keys["shop-b"]["id"], "version": 2},
        headers=ADMIN,
        timeout=10,
    )
    assert by_key.status_code == 200, by_key.text
    wait_until(lambda: serves(gateway, "bot@1", as_key["shop-a"]), "the project pin")
    wait_until(lambda: serves(gateway, "bot@2", as_key["shop-b"]), "the key pin")
    start(gateway, version=2, share=1.0, mode="split")
    wait_for_trial(gateway, 2)
    page = login(gateway.url, "adm").get("/dashboard/policies/bot").text
    assert "<td>project shop</td><td>v1</td>" in page and 'class="rollout-state">running<' in page
    assert served(chat(gateway, as_key["ops"])) == "bot@2"  # the split takes every unpinned call
    assert served(chat(gateway, as_key["shop-a"])) == "bot@1"  # the pin wins over it
    listed = httpx.get(gateway.url + "/admin/policies/bot/pins", headers=ADMIN, timeout=10).json()
    assert {(p["scope"], p["version"]) for p in listed} == {("project", 1), ("key", 2)}

    gone = httpx.delete(gateway.url + "/admin/policies/bot/pins/project/shop", headers=ADMIN, timeout=10)
    assert gone.status_code == 204, gone.text
    wait_until(lambda: serves(gateway, "bot@2", as_key["shop-a"]), "the pin to be dropped")
    again = httpx.delete(gateway.url + "/admin/policies/bot/pins/project/shop", headers=ADMIN, timeout=10)
    assert again.status_code == 404 and again.json()["error"]["code"] == "pin_not_found"
    audit = httpx.get(gateway.url + "/admin/audit", headers=ADMIN, timeout=10).json()
    actions = [entry["action"] for entry in audit]
    assert {"pin.set", "pin.remove", "rollout.start"} <= set(actions)


def test_bad_rollouts_and_pins_get_clear_4xx_and_write_nothing(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    register_versions(database_url, gateway.settings.data_dir, 2)
    url = gateway.url + "/admin/policies/bot/rollouts"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"version": 0, "share": 0.1}, 400, "invalid_value"),  # the active version
        ({"version": 7, "share": 0.1}, 404, "version_not_found"),
        ({"version": 1, "share": 0}, 400, ""),
        ({"version": 1, "share": 1.5}, 400, ""),
        ({"version": 1, "share": 0.1, "mode": "blue-green"}, 400, ""),
        ({"version": 1, "share": 0.1, "rule": {"alpha": 2}}, 400, "invalid_policy_config"),
        ({"version": 1, "share": 0.1, "rule": {"nope": 1}}, 400, "invalid_policy_config"),
        ({"version": 1, "share": 0.1, "surprise": True}, 400, ""),
    ]
    for body, status, code in cases:
        response = httpx.post(url, json=body, headers=ADMIN, timeout=10)
        assert response.status_code == status, (body, response.text)
        assert "error" in response.json() and (not code or response.json()["error"]["code"] == code), (
            response.text
        )
    assert (
        httpx.post(
            gateway.url + "/admin/policies/nobody/rollouts",
            json={"version": 1, "share": 0.1},
            headers=ADMIN,
            timeout=10,
        ).status_code
        == 404
    )
    assert httpx.post(url, json={"version": 1, "share": 0.1}, timeout=10).status_code == 401
    assert asyncio.run(fetch_rows(database_url, "SELECT id FROM rollouts")) == []
    start(gateway, version=1, share=0.1)
    busy = httpx.post(url, json={"version": 1, "share": 0.2}, headers=ADMIN, timeout=10)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "rollout_running"
    pin = httpx.post(
        gateway.url + "/admin/policies/bot/pins",
        json={"scope": "team", "subject": "x", "version": 1},
        headers=ADMIN,
        timeout=10,
    )
    assert pin.status_code == 400
    assert asyncio.run(fetch_rows(database_url, "SELECT id FROM version_pins")) == []


# ----------------------------------------------------------------------------------------------- the monitor

RULE = {"min_episodes": 10, "min_calls": 10, "margin": 0.05, "tau": 0.2, "alpha": 0.05}


def feedback(gateway: GatewayServer, request_id: str, value: float) -> None:
    response = httpx.post(
        gateway.url + "/v1/feedback", json={"request_id": request_id, "value": value}, timeout=10
    )
    assert response.status_code == 200, response.text


def rewarded_traffic(gateway: GatewayServer, reward: Callable[[str, int], float], users: int) -> None:
    """One call per user, rewarded by `reward(version, i)` (the scripted replies do not depend on the version)."""
    for i in range(users):
        response = chat(gateway, user=f"u-{uuid.uuid4().hex[:8]}")
        feedback(gateway, response.headers["x-request-id"], reward(served(response), i))


def rewarded(url: str) -> int:
    return len(asyncio.run(fetch_rows(url, "SELECT id FROM episodes WHERE reward IS NOT NULL")))


def looked(url: str, now: datetime | None = None) -> list[Any]:
    async def look() -> list[Any]:
        database = Database(async_database_url(url))
        try:
            return [verdict for _, verdict in await watch(database, now=now)]
        finally:
            await database.dispose()

    return asyncio.run(look())


def test_the_monitor_rolls_back_a_worse_canary_and_records_why_everywhere(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    register_versions(database_url, gateway.settings.data_dir, 2, {"rollout": RULE})
    wait_until(lambda: serves(gateway, "bot@0"), "bot@0 to be served")
    rollout = start(gateway, version=1, share=0.5)
    wait_for_trial(gateway, 1)
    assert looked(database_url)[0].decision == "continue"  # no evidence yet
    # The candidate's users are unhappy three times in four, the active version's one time in four.
    rewarded_traffic(gateway, lambda version, i: float((i % 4 == 0) == (version == "bot@1")), 120)
    wait_until(lambda: rewarded(database_url) == 120, "the rewards to reach their episodes")

    [verdict] = looked(database_url)
    assert verdict.decision == "rollback" and verdict.reason.startswith("worse: difference"), verdict
    stored = in_session(database_url, lambda s: list_rollouts(s, "bot"))[0]
    assert (stored.id, stored.status, stored.decided_at is not None) == (rollout["id"], "rolled_back", True)
    assert stored.stats["difference"]["high"] < -RULE["margin"]
    assert stored.stats["candidate"]["rewarded"] >= 10 and stored.stats["baseline"]["rewarded"] >= 10
    policy = in_session(database_url, lambda s: get_policy(s, "bot"))
    assert policy is not None and policy.active_version == 0
    assert in_session(database_url, lambda s: get_adapter(s, policy.id, 1)).status == "rejected"  # type: ignore[union-attr]
    audit = asyncio.run(
        fetch_rows(database_url, "SELECT actor, action FROM audit WHERE action LIKE 'rollout.%'")
    )
    assert {(a["actor"], a["action"]) for a in audit} >= {("canary", "rollout.rolled_back")}
    wait_for_trial(gateway, None)
    assert {served(chat(gateway, user=f"after-{i}")) for i in range(20)} == {"bot@0"}
    page = login(gateway.url, "adm").get("/dashboard/policies/bot")
    assert page.status_code == 200
    assert 'class="rollout-state">rolled_back<' in page.text and "worse: difference" in page.text


def test_the_monitor_promotes_a_canary_that_is_no_worse(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    rule = {**RULE, "margin": 0.1}
    register_versions(database_url, gateway.settings.data_dir, 2, {"rollout": rule})
    wait_until(lambda: serves(gateway, "bot@0"), "bot@0 to be served")
    start(gateway, version=1, share=0.5)
    wait_for_trial(gateway, 1)
    # Both versions earn the same rewards: 0.7 and 0.9 in turn, counted per version (counted over all calls, the
    # random split could hand one version more of the 0.7s and make the verdict a matter of chance).
    turns: Counter[str] = Counter()

    def in_turn(version: str, _: int) -> float:
        turns[version] += 1
        return 0.7 if turns[version] % 2 else 0.9

    rewarded_traffic(gateway, in_turn, 120)
    wait_until(lambda: rewarded(database_url) == 120, "the rewards to reach their episodes")
    [verdict] = looked(database_url)
    assert verdict.decision == "promote" and verdict.reason.startswith("no worse"), verdict
    assert verdict.interval is not None and verdict.interval.low > -rule["margin"]
    policy = in_session(database_url, lambda s: get_policy(s, "bot"))
    assert policy is not None and policy.active_version == 1
    wait_until(lambda: serves(gateway, "bot@1", user="anyone"), "the promoted version to serve")


def record(call_id: str, version: int, content: str, *, created_at: float, status: str = "ok") -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=f"e-{call_id}",
        episode_resolved=True,
        policy="bot",
        model="bot",
        adapter_version=version,
        request={"messages": [{"role": "user", "content": "what is the capital of France?"}]},
        response={"choices": [{"message": {"role": "assistant", "content": content}}]},
        status=status,
        created_at=created_at,
    )


def test_health_guards_roll_back_a_canary_that_answers_nothing_before_any_reward(
    database_url: str, tmp_path: Path
) -> None:
    """No feedback at all yet: the empty replies alone end the canary."""
    from migrations.runner import upgrade_database

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 2, {"rollout": RULE})
    rollout = in_session(
        database_url,
        lambda s: start_rollout(s, "bot", 1, mode="canary", share=0.5, actor="test", config=dict(RULE)),
    )
    now = datetime.now(UTC).timestamp()
    calls = [record(f"a{i}", 0, "Paris.", created_at=now + i / 1000) for i in range(30)]
    calls += [record(f"c{i}", 1, "" if i % 5 else "Paris.", created_at=now + i / 1000) for i in range(30)]

    in_session(database_url, lambda s: write_calls(s, calls))
    evidence = in_session(database_url, lambda s: gather(s, rollout))
    assert (evidence.candidate.health.calls, evidence.baseline.health.calls) == (30, 30)
    assert evidence.candidate.health.empty_share == pytest.approx(24 / 30)
    assert evidence.candidate.rewards.episodes == 0
    verdict = judge("canary", evidence, RolloutConfig.model_validate(RULE))
    assert verdict.decision == "rollback" and verdict.reason.startswith("health: empty_share"), verdict
    # A split is measured the same way and never decided by the monitor.
    assert judge("split", evidence, RolloutConfig.model_validate(RULE)).decision == "continue"


def test_an_undecided_canary_ends_as_on_timeout_says(database_url: str, tmp_path: Path) -> None:
    from migrations.runner import upgrade_database

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 2)
    rollout = in_session(
        database_url, lambda s: start_rollout(s, "bot", 1, mode="canary", share=0.1, actor="test", config={})
    )
    later = rollout.started_at.replace(tzinfo=UTC) + timedelta(hours=25)
    evidence = in_session(database_url, lambda s: gather(s, rollout, later))
    verdict = judge("canary", evidence, RolloutConfig())
    assert verdict.decision == "rollback" and "undecided after 24 h" in verdict.reason
    assert judge("canary", evidence, RolloutConfig(on_timeout="promote")).decision == "promote"


def test_a_switch_by_hand_settles_the_running_rollout_and_retention_keeps_trial_versions(
    make_gateway: MakeGateway, database_url: str, engine: UpstreamProcess
) -> None:
    gateway = rollout_gateway(make_gateway, database_url, engine)
    register_versions(database_url, gateway.settings.data_dir, 4)
    first = start(gateway, version=1, share=0.2)

    async def prune(session: AsyncSession) -> list[int]:
        policy = await get_policy(session, "bot")
        assert policy is not None
        await set_pin(session, "bot", "project", "shop", 2, actor="test")
        return [a.version for a in await prune_adapters(session, policy.id, 0, keep=1)]

    # keep=1 keeps the newest (3) and the active (0); the trial (1) and the pinned (2) stay as well.
    assert in_session(database_url, prune) == []
    promoted = httpx.post(
        gateway.url + "/admin/policies/bot/promote", json={"version": 1}, headers=ADMIN, timeout=10
    )
    assert promoted.status_code == 200, promoted.text
    ended = in_session(database_url, lambda s: list_rollouts(s, "bot"))[0]
    assert (ended.id, ended.status, ended.reason) == (first["id"], "promoted", "promoted by hand")
    second = start(gateway, version=3, share=0.2)
    rolled = httpx.post(gateway.url + "/admin/policies/bot/rollback", headers=ADMIN, timeout=10)
    assert rolled.status_code == 200, rolled.text
    stopped = in_session(database_url, lambda s: list_rollouts(s, "bot"))[0]
    assert (stopped.id, stopped.status) == (second["id"], "stopped")
    assert in_session(database_url, lambda s: running_rollout(s, "bot")) is None
    # Ending twice is refused, by hand as by a second monitor.
    with pytest.raises(RolloutRefused):
        in_session(
            database_url, lambda s: end_rollout(s, second["id"], "promoted", reason="again", actor="t")
        )
    again = httpx.post(
        gateway.url + f"/admin/policies/bot/rollouts/{second['id']}/end",
        json={"status": "promoted"},
        headers=ADMIN,
        timeout=10,
    )
    assert again.status_code == 409, again.text


def test_a_decision_lands_in_the_run_that_made_the_version(database_url: str, tmp_path: Path) -> None:
    from migrations.runner import upgrade_database
    from storage.training import start_run

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 2)

    async def begin(session: AsyncSession) -> tuple[int, int]:
        policy = await get_policy(session, "bot")
        assert policy is not None
        run_id = await start_run(session, policy.id, 0, {})
        rollout = await start_rollout(
            session,
            "bot",
            1,
            mode="canary",
            share=0.1,
            actor="gate",
            run_id=run_id,
            config={"max_hours": 1},
        )
        return run_id, rollout.id

    run_id, rollout_id = in_session(database_url, begin)
    [verdict] = looked(database_url, datetime.now(UTC) + timedelta(hours=2))  # undecided at max_hours
    assert verdict.decision == "rollback"
    run = in_session(database_url, lambda s: get_run(s, run_id))
    assert run is not None and run.metrics["rollout"]["id"] == rollout_id
    assert run.metrics["rollout"]["status"] == "rolled_back"


def test_the_cli_starts_lists_and_ends_rollouts_and_sets_pins(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from migrations.runner import upgrade_database

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 3)
    monkeypatch.setenv("KAIZEN_DATABASE_URL", database_url)
    monkeypatch.setenv("KAIZEN_DATA_DIR", str(tmp_path))
    assert (
        main(["policy", "rollout", "start", "bot", "1", "--share", "0.25", "--rule", '{"alpha": 0.01}']) == 0
    )
    running = in_session(database_url, lambda s: running_rollout(s, "bot"))
    assert running is not None and (running.mode, running.share, running.config["alpha"]) == (
        "canary",
        0.25,
        0.01,
    )
    assert main(["policy", "rollout", "start", "bot", "2", "--share", "0.25"]) == 2  # one at a time
    assert main(["policy", "rollout", "start", "bot", "1", "--share", "0.25", "--rule", "[1]"]) == 2
    capsys.readouterr()
    assert main(["policy", "rollout", "list", "bot"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:6] == ["id", "mode", "version", "vs", "share", "status"]
    assert listing[1].split()[:6] == [str(running.id), "canary", "1", "0", "0.25", "running"]
    assert main(["policy", "rollout", "end", "bot", str(running.id), "--as", "stopped"]) == 0
    assert main(["policy", "rollout", "end", "bot", str(running.id), "--as", "stopped"]) == 2
    assert main(["policy", "pin", "bot", "2", "--project", "shop"]) == 0
    capsys.readouterr()
    assert main(["policy", "pins", "bot"]) == 0
    assert capsys.readouterr().out == "project\tshop\t2\n"
    assert main(["policy", "unpin", "bot", "--project", "shop"]) == 0
    assert main(["policy", "unpin", "bot", "--project", "shop"]) == 2
    assert main(["policy", "pin", "bot", "9", "--key", "k1"]) == 2


def test_late_rewards_count_for_the_version_that_served(database_url: str, tmp_path: Path) -> None:
    """A reward that arrives after the rollout ended still counts for the version that served the call."""
    from migrations.runner import upgrade_database
    from storage.version_rewards import version_rewards

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 2)
    now = datetime.now(UTC).timestamp()

    in_session(database_url, lambda s: write_calls(s, [record("late", 1, "Paris.", created_at=now)]))

    async def reward(session: AsyncSession) -> None:
        from storage.models import Episode

        episode = await session.get(Episode, "e-late")
        assert episode is not None
        episode.reward = 0.75

    # The active version moved on to 0 long before the reward came.
    in_session(database_url, reward)
    stats = in_session(database_url, lambda s: version_rewards(s, "bot"))
    assert stats[1].episodes == 1 and stats[1].mean == 0.75 and 0 not in stats


def test_a_candidate_that_passed_the_gate_goes_on_trial_when_the_policy_asks(
    database_url: str, tmp_path: Path
) -> None:
    """`ship`: promoted at once by default; a canary with `rollout.canary_share`, superseding an older trial."""
    from migrations.runner import upgrade_database
    from storage.training import start_run
    from trainer.control.scheduler import ship

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 4)

    async def shipped(session: AsyncSession, version: int, config: dict[str, Any]) -> tuple[str, int]:
        from storage.policies import update_policy_config

        policy = await get_policy(session, "bot")
        assert policy is not None
        await update_policy_config(session, policy.id, config)
        policy = await get_policy(session, "bot")
        assert policy is not None
        run_id = await start_run(session, policy.id, policy.active_version, {})
        return await ship(session, policy, run_id, version), run_id

    assert in_session(database_url, lambda s: shipped(s, 1, {}))[0] == "promoted"
    canary = {"rollout": {"canary_share": 0.2, "min_episodes": 50}}
    mode, run_id = in_session(database_url, lambda s: shipped(s, 2, canary))
    assert mode == "canary"
    trial = in_session(database_url, lambda s: running_rollout(s, "bot"))
    assert trial is not None and (trial.version, trial.baseline_version, trial.share) == (2, 1, 0.2)
    assert (trial.actor, trial.run_id, trial.config["min_episodes"]) == ("canary", run_id, 50)
    run = in_session(database_url, lambda s: get_run(s, run_id))
    assert run is not None and run.metrics["rollout"] == {
        "id": trial.id,
        "mode": "canary",
        "share": 0.2,
        "status": "running",
    }
    policy = in_session(database_url, lambda s: get_policy(s, "bot"))
    assert policy is not None and policy.active_version == 1  # still the old one while the canary runs

    assert in_session(database_url, lambda s: shipped(s, 3, canary))[0] == "canary"
    newest, older = in_session(database_url, lambda s: list_rollouts(s, "bot"))[:2]
    assert (newest.version, newest.status) == (3, "running")
    assert (older.version, older.status, older.reason) == (
        2,
        "stopped",
        f"superseded by version 3 (run {run_id + 1})",
    )
    shadow = {"rollout": {"shadow_share": 0.3}}
    with pytest.raises(InvalidPolicyConfig, match="canary_share or shadow_share"):
        load_policy_config({"rollout": {"canary_share": 0.1, "shadow_share": 0.1}})
    assert in_session(database_url, lambda s: shipped(s, 2, shadow))[0] == "shadow"


def test_the_monitor_decides_a_shadow_on_its_scored_pairs(database_url: str, tmp_path: Path) -> None:
    """A shadow serves nobody: its scored pairs (shadow minus served reward, paired on the same call) decide."""
    from migrations.runner import upgrade_database
    from storage.shadows import NewPair, add_pairs, set_scores, unscored_pairs

    asyncio.run(upgrade_database(async_database_url(database_url)))
    register_versions(database_url, tmp_path, 3)
    rule = {"min_episodes": 20, "margin": 0.05, "tau": 0.1}

    def shadow_with(version: int, served: Callable[[int], float], shadow: Callable[[int], float]) -> Any:
        async def seed(session: AsyncSession) -> Any:
            rollout = await start_rollout(
                session, "bot", version, mode="shadow", share=0.5, actor="t", config=rule
            )
            now = datetime.now(UTC)
            reply = {"role": "assistant", "content": "Paris."}
            pairs = [NewPair(rollout.id, f"c{version}-{i}", [], reply, reply, now) for i in range(40)]
            await add_pairs(session, pairs)
            stored = await unscored_pairs(session, rollout.id, 100)
            await set_scores(session, [(p.id, served(i), shadow(i)) for i, p in enumerate(stored)])
            return rollout

        return in_session(database_url, seed)

    # The candidate loses 0.4 on every other call: rolled back on the pairs alone, no call was ever served by it.
    worse = shadow_with(1, lambda i: 0.8, lambda i: 0.8 - 0.4 * (i % 2))
    [verdict] = looked(database_url)
    assert verdict.decision == "rollback" and "40 scored pairs" in verdict.reason, verdict
    ended = in_session(database_url, lambda s: list_rollouts(s, "bot"))[0]
    assert (ended.id, ended.status, ended.stats["paired"]["n"]) == (worse.id, "rolled_back", 40)
    assert ended.stats["candidate"]["health"]["calls"] == 0
    # Equal on every pair but noise of ±0.05: promoted.
    shadow_with(2, lambda i: 0.7, lambda i: 0.7 + 0.05 * (-1) ** i)
    [verdict] = looked(database_url)
    assert verdict.decision == "promote", verdict
    policy = in_session(database_url, lambda s: get_policy(s, "bot"))
    assert policy is not None and policy.active_version == 2
