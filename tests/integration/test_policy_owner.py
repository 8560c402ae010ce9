"""Per-project policies on SQLite and PostgreSQL: a policy owned by a project answers only that project's keys,
and another project's episodes never reach its training data, its judge or its export; a shared one (stated as
such) keeps calling and training on every project."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.commands.main import main
from gateway.policies import InvalidOwner, policy_owner
from gateway.scheduling import runner_config
from gateway.settings import Settings, async_database_url
from migrations.runner import upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.episodes import scoring_candidates
from storage.export import ExportFilter, count_episodes
from storage.jobs import count_rewarded_episodes
from storage.models import Episode, Reward
from storage.policies import create_policy, get_policy, set_policy_owner
from storage.records import CallRecord
from storage.training import rewarded_episodes, unrewarded_episodes
from tests.conftest import query
from tests.integration.test_mcp_endpoint import session_calls
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.scripted_judge import ScriptedJudge
from trainer.control.policy_config import load_policy_config
from trainer.control.scheduler import OwnerUnreachable, TrainOptions
from trainer.learner.dataset import DataReport
from trainer.learner.job import TrainRequest, _load_trajectories

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}
MODEL = "scripted-1"  # the scripted upstream's model, and the policy its calls are stored under


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


# ------------------------------------------------------------------------------------------- the owner's rules


def add_policy(
    url: str,
    name: str,
    config: dict[str, Any] | None = None,
    *,
    project: str | None = None,
    migrate: bool = False,
) -> None:
    """Create `name` on base model `base` straight in the database (`migrate`: on a database not yet created)."""

    async def seed() -> None:
        if migrate:
            await upgrade_database(async_database_url(url))
        database = Database(async_database_url(url))
        async with database.session() as session:
            await create_policy(session, name, "base", config, project=project)
            await session.commit()
        await database.dispose()

    asyncio.run(seed())


def test_a_policy_belongs_to_its_creators_project_unless_shared_or_given() -> None:
    assert policy_owner(None, False, "shop") == "shop"
    assert policy_owner("ops", False, "shop") == "ops"
    assert policy_owner(None, True, "shop") is None
    with pytest.raises(InvalidOwner, match="either owned by a project or shared"):
        policy_owner("ops", True, "shop")
    for bad in ("", "x" * 129, "a\x01b"):
        with pytest.raises(InvalidOwner, match="1-128 characters"):
            policy_owner(bad, False, "shop")


def test_the_gate_and_resampling_call_another_owners_policy_with_the_admin_key(tmp_path: Path) -> None:
    """The environment's keys are the built-in project's: an owned policy of another project refuses them."""
    config = runner_config(Settings.load(data_dir=tmp_path, api_keys=["sk-env"], admin_key="adm"))
    assert config.gateway_key(None) == config.gateway_key("default") == "sk-env"
    assert config.gateway_key("shop") == "adm"
    options = TrainOptions({}, None, None)
    assert config.training_job("bot", "base", options, project="shop").engine_api_key == "adm"
    assert config.training_job("bot", "base", options).engine_api_key == "sk-env"
    # Without an admin key nothing the trainer holds is answered: refused at once, not waited out as a 404.
    without_admin = runner_config(Settings.load(data_dir=tmp_path, api_keys=["sk-env"]))
    assert without_admin.gateway_key(None) == "sk-env"
    with pytest.raises(OwnerUnreachable, match="set KAIZEN_ADMIN_KEY"):
        without_admin.training_job("bot", "base", options, project="shop")


# ------------------------------------------------------------------------------------------ every SQL selector
def record(call_id: str, project: str, policy: str, created_at: float) -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=f"e-{call_id}",
        episode_resolved=True,
        policy=policy,
        model=policy,
        project=project,
        request={"messages": [{"role": "user", "content": f"question of {project}"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "an answer"}}]},
        prompt_token_ids=[1, 2],
        completion_token_ids=[[3, 2]],
        completion_logprobs=[[-0.5, -0.1]],
        created_at=created_at,
        group_key="same-task",
    )


async def selections(database: Database, policy: str) -> dict[str, set[str]]:
    """The episodes of `policy` every training, judging and export query selects, by query."""
    until = datetime.now(UTC)
    async with database.session() as session:
        rewarded = {e.id for e in await rewarded_episodes(session, policy, since=None, until=until)}
        unrewarded = {
            e.id
            for e in await unrewarded_episodes(session, policy, sources=["traffic"], since=None, until=until)
        }
        judged = {c.episode_id for c in await scoring_candidates(session, policy, source="judge")}
        counted = await count_rewarded_episodes(session, policy, None)
        exported = await count_episodes(session, ExportFilter(policy=policy))
    return {
        "rewarded": rewarded,
        "unrewarded": unrewarded,
        "judged": judged,
        "counted": {str(counted)},
        "exported": {str(exported)},
    }


def test_only_the_owners_episodes_are_selected_for_training_judging_and_export(database_url: str) -> None:
    url = async_database_url(database_url)

    async def scenario() -> None:
        await upgrade_database(url)
        database = Database(url)
        try:
            now = time.time()
            async with database.session() as session:
                owned = await create_policy(session, "owned", "base", project="alpha")
                await create_policy(session, "shared", "base")
                await session.commit()
                await write_calls(
                    session,
                    [
                        record(f"{policy}-{project}-{n}", project, policy, now - 60 + n)
                        for policy in ("owned", "shared")
                        for project in ("alpha", "beta")
                        for n in range(3)  # 0 and 1 rewarded (by row, by derived reward), 2 not
                    ],
                )
                for policy in ("owned", "shared"):
                    for project in ("alpha", "beta"):
                        session.add(Reward(call_id=f"{policy}-{project}-0", source="feedback", value=1.0))
                        episode = await session.get(Episode, f"e-{policy}-{project}-1")
                        assert episode is not None
                        episode.reward = 0.5
                await session.commit()

            found = await selections(database, "owned")
            assert found == {
                "rewarded": {"e-owned-alpha-0", "e-owned-alpha-1"},
                "unrewarded": {"e-owned-alpha-2"},
                "judged": {"e-owned-alpha-0", "e-owned-alpha-1", "e-owned-alpha-2"},
                "counted": {"1"},  # the derived reward only (the threshold trigger)
                "exported": {"3"},
            }
            shared = await selections(database, "shared")
            assert shared["rewarded"] == {f"e-shared-{p}-{n}" for p in ("alpha", "beta") for n in (0, 1)}
            assert shared["unrewarded"] == {"e-shared-alpha-2", "e-shared-beta-2"}
            assert len(shared["judged"]) == 6 and shared["counted"] == {"2"} and shared["exported"] == {"6"}

            # The owner is read with each selection: sharing the policy, or giving it to another project,
            # changes its training data at once, past episodes included.
            async with database.session() as session:
                await set_policy_owner(session, owned.id, None)
                await session.commit()
            assert len((await selections(database, "owned"))["rewarded"]) == 4
            async with database.session() as session:
                await set_policy_owner(session, owned.id, "beta")
                await session.commit()
                policy = await get_policy(session, "owned")
                assert policy is not None and (policy.project, policy.shared) == ("beta", False)
            assert (await selections(database, "owned"))["judged"] == {f"e-owned-beta-{n}" for n in range(3)}
        finally:
            await database.dispose()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------- over real HTTP
def create_key(gw: GatewayServer, name: str, project: str) -> str:
    body = {"name": name, "scopes": ["chat", "feedback", "read"], "project": project}
    response = httpx.post(gw.url + "/admin/keys", json=body, headers=ADMIN)
    assert response.status_code == 201, response.text
    return str(response.json()["secret"])


def call(gw: GatewayServer, secret: str, text: str, model: str = MODEL) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "metadata": {"group_key": "g"},
        },
        headers=bearer(secret),
        timeout=10,
    )


def converse(gw: GatewayServer, secret: str, text: str) -> str:
    response = call(gw, secret, text)
    assert response.status_code == 200, response.text
    return response.headers["x-episode-id"]


def set_owner(gw: GatewayServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{gw.url}/admin/policies/{MODEL}/owner", json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    return dict(response.json())


def training_data(url: str, data_dir: Path) -> set[str]:
    """The episodes a training run of the policy would learn from: what the learner loads as its examples."""

    async def run() -> set[str]:
        database = Database(async_database_url(url))
        try:
            async with database.session() as session:
                policy = await get_policy(session, MODEL)
                rows = await rewarded_episodes(session, MODEL, since=None, until=datetime.now(UTC))
            assert policy is not None
            config = load_policy_config({"gate": {"holdout_fraction": 0}})
            request = TrainRequest(MODEL, data_dir, "base", since=datetime(2000, 1, 1, tzinfo=UTC))
            examples, _, _ = await _load_trajectories(database, policy, config, request, DataReport())
        finally:
            await database.dispose()
        # Every rewarded episode of the selection becomes an example (one call each, tokens captured).
        assert {e.episode_id for e in examples} == {row.id for row in rows}
        return {row.id for row in rows}

    return asyncio.run(run())


def models(gw: GatewayServer, secret: str) -> list[str]:
    response = httpx.get(gw.url + "/v1/models", headers=bearer(secret))
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def test_an_owned_policy_refuses_other_projects_and_never_learns_from_them(
    make_gateway: MakeGateway,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    gw = make_gateway(database_url, api_keys=["sk-env"], admin_key="adm", policy_refresh_s=0.2)
    alpha = create_key(gw, "alpha-app", "alpha")
    beta = create_key(gw, "beta-app", "beta")

    add_policy(database_url, MODEL)  # shared, as every policy before owners existed
    # Shared: both projects call it, both projects' episodes are its.
    alpha_episodes = [converse(gw, alpha, "good alpha one"), converse(gw, alpha, "good alpha two")]
    beta_episodes = [converse(gw, beta, "beta-secret one"), converse(gw, beta, "beta-secret two")]
    gw.flush()

    listed = httpx.get(gw.url + "/admin/policies", headers=ADMIN).json()
    assert [(p["name"], p["project"], p["shared"]) for p in listed] == [(MODEL, None, True)]
    view = set_owner(gw, {"project": "alpha"})
    assert (view["project"], view["shared"]) == ("alpha", False)

    # (a) Another project's key meets the answer for a model that does not exist, once the gateway re-read
    # its policies; the owner's key goes on as before.
    wait_until(lambda: call(gw, beta, "again").status_code == 404, "beta refused")
    refused = call(gw, beta, "beta-secret three").json()["error"]
    missing = call(gw, beta, "hi", model="no-such-model").json()["error"]
    assert refused["code"] == missing["code"] == "model_not_found"
    assert refused["message"] == missing["message"].replace("no-such-model", MODEL)
    assert httpx.get(f"{gw.url}/v1/models/{MODEL}", headers=bearer(beta)).status_code == 404
    assert MODEL not in models(gw, beta) and MODEL in models(gw, alpha)
    assert httpx.get(f"{gw.url}/v1/models/{MODEL}", headers=bearer(alpha)).status_code == 200
    alpha_episodes.append(converse(gw, alpha, "good alpha three"))
    # The environment's keys are the built-in project's: refused too. The admin key sees every project: its
    # call is recorded under the owner (how a bootstrap calls its policy).
    assert call(gw, "sk-env", "hello").status_code == 404
    by_admin = converse(gw, "adm", "good from the admin")
    gw.flush()
    assert query(database_url, "SELECT project FROM episodes WHERE id = :id", id=by_admin) == [
        {"project": "alpha"}
    ]
    alpha_episodes.append(by_admin)

    # (b) The judge sees the owner's episodes only.
    with ScriptedJudge() as judge:
        monkeypatch.setenv("KAIZEN_JUDGE_MODEL", "judge-x")
        monkeypatch.setenv("KAIZEN_JUDGE_API_BASE", judge.url)
        assert main(["judge", "--policy", MODEL, "--database-url", database_url]) == 0
        prompts = judge.prompts()
    assert prompts and all("beta-secret" not in p for p in prompts)
    assert all(f"good alpha {n}" in "".join(prompts) for n in ("one", "two", "three"))
    judged = {r["episode_id"] for r in query(database_url, "SELECT episode_id FROM rewards")}
    assert judged == set(alpha_episodes)

    # Beta still rewards its own episodes, and they still do not reach the policy's training data.
    for episode_id in beta_episodes:
        reward = httpx.post(
            gw.url + "/v1/feedback", json={"episode_id": episode_id, "value": 1}, headers=bearer(beta)
        )
        assert reward.status_code == 200, reward.text
    assert training_data(database_url, tmp_path) == set(alpha_episodes)

    # (c) Shared again, stated explicitly: every project calls it and trains it.
    view = set_owner(gw, {"shared": True})
    assert (view["project"], view["shared"]) == (None, True)
    assert training_data(database_url, tmp_path) == {*alpha_episodes, *beta_episodes}
    wait_until(lambda: call(gw, beta, "back").status_code == 200, "beta let in again")

    audit = httpx.get(gw.url + "/admin/audit", params={"target": MODEL}, headers=ADMIN).json()
    owners = [(e["action"], e["details"]["project"]) for e in audit if e["action"] == "policy.owner"]
    assert sorted(owners, key=str) == sorted([("policy.owner", "alpha"), ("policy.owner", None)], key=str)


def test_an_owner_is_either_a_project_or_shared(make_gateway: MakeGateway, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/owner.db"
    gw = make_gateway(url, admin_key="adm")
    both = httpx.post(
        gw.url + "/admin/policies",
        json={"name": "bot", "project": "shop", "shared": True},
        headers=ADMIN,
    )
    assert (both.status_code, both.json()["error"]["param"]) == (400, "project"), both.text
    assert query(url, "SELECT id FROM policies") == []
    assert httpx.post(f"{gw.url}/admin/policies/nope/owner", json={}, headers=ADMIN).status_code == 400
    missing = httpx.post(f"{gw.url}/admin/policies/nope/owner", json={"shared": True}, headers=ADMIN)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "policy_not_found")


def test_the_cli_gives_a_policy_to_a_project_and_shares_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    add_policy(url, "bot", project="shop", migrate=True)
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["policy", "list", *flags]) == 0
    assert "\tproject=shop\t" in capsys.readouterr().out
    assert main(["policy", "owner", "bot", "--shared", *flags]) == 0
    assert main(["policy", "list", *flags]) == 0
    assert "\tshared\t" in capsys.readouterr().out
    assert main(["policy", "owner", "nope", "--project", "ops", *flags]) == 2
    with pytest.raises(SystemExit):  # one of --project and --shared is required
        main(["policy", "owner", "bot", *flags])
    assert query(url, "SELECT actor, action FROM audit") == [{"actor": "cli", "action": "policy.owner"}]


def test_an_import_lands_in_the_owners_project(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/import.db"
    add_policy(url, "bot", project="shop", migrate=True)
    conversation = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps(conversation) + "\n")
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    # Another project's episodes would never train it: refused, nothing stored.
    assert main(["import", str(path), "--policy", "bot", "--project", "ops", *flags]) == 2
    assert query(url, "SELECT project FROM episodes") == []
    assert main(["import", str(path), "--policy", "bot", *flags]) == 0
    assert query(url, "SELECT project FROM episodes") == [{"project": "shop"}]


def test_an_owned_policys_tools_answer_only_its_project_and_admin_keys(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/tools.db"
    gw = make_gateway(url, admin_key="adm", api_keys="sk-env")
    tools = {"tools": {"functions": ["tests.support.tool_functions:capital"]}}
    add_policy(url, "agent", tools, project="shop")
    shop = create_key(gw, "shop-app", "shop")
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "capital", "arguments": {"country": "zorland"}},
    }
    headers = {"Accept": "application/json, text/event-stream", **bearer("sk-env")}
    refused = httpx.post(gw.url + "/mcp/agent", json=body, headers=headers, timeout=30)
    assert (refused.status_code, refused.json()["error"]["code"]) == (404, "policy_not_found")
    assert refused.json()["error"]["message"] == "no policy named 'agent'"

    call = [("capital", {"country": "zorland"})]
    for key in (shop, "adm"):
        names, answers = asyncio.run(session_calls(f"{gw.url}/mcp/agent", key, None, call))
        assert names == ["capital"] and answers == [("Quix", False)]
    rows = query(url, "SELECT project FROM tool_calls")
    assert [r["project"] for r in rows] == ["shop", "shop"]  # the admin key's call is the owner's


def built_version_0(data_dir: Path, *names: str) -> None:
    """Version 0 of each policy as an interrupted create leaves it: complete, so creating the policy keeps it
    and loads no base model."""
    for name in names:
        version_0 = data_dir / "adapters" / name / "0"
        version_0.mkdir(parents=True)
        (version_0 / "adapter_config.json").write_text('{"r": 16}')


def owners(url: str) -> dict[str, str | None]:
    return {r["name"]: r["project"] for r in query(url, "SELECT name, project FROM policies")}


def test_a_new_policy_belongs_to_its_creators_project_unless_shared(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/create.db"
    built_version_0(tmp_path, "cli-default", "cli-shop", "cli-shared")
    flags = ["--database-url", url, "--data-dir", str(tmp_path), "--base-model", "/no/such/model"]
    assert main(["policy", "create", "cli-default", *flags]) == 0
    assert main(["policy", "create", "cli-shop", "--project", "shop", *flags]) == 0
    assert main(["policy", "create", "cli-shared", "--shared", *flags]) == 0
    assert main(["policy", "create", "cli-bad", "--project", "a\x01b", *flags]) == 2
    assert owners(url) == {"cli-default": "default", "cli-shop": "shop", "cli-shared": None}

    gw = make_gateway(url, admin_key="adm")
    built_version_0(gw.settings.data_dir, "by-ops", "named", "everyone")
    created = httpx.post(
        gw.url + "/admin/keys",
        json={"name": "ops-admin", "scopes": ["admin"], "project": "ops"},
        headers=ADMIN,
    )
    ops_admin = bearer(created.json()["secret"])
    for name, fields, headers in (
        ("by-ops", {}, ops_admin),  # the creating key's project
        ("named", {"project": "shop"}, ops_admin),
        ("everyone", {"shared": True}, ADMIN),
    ):
        body = {"name": name, "base_model": "/no/such/model", **fields}
        answer = httpx.post(gw.url + "/admin/policies", json=body, headers=headers, timeout=60)
        assert answer.status_code == 201, answer.text
    assert {k: v for k, v in owners(url).items() if not k.startswith("cli-")} == {
        "by-ops": "ops",
        "named": "shop",
        "everyone": None,
    }
    audit = httpx.get(gw.url + "/admin/audit", params={"action": "policy.create"}, headers=ADMIN).json()
    shared = {e["target"]: e["details"]["shared"] for e in audit}
    assert shared == {name: project is None for name, project in owners(url).items()}
