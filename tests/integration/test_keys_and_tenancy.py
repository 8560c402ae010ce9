"""Managed keys (admin API and CLI), scopes, projects and the audit log, over real HTTP on SQLite and
PostgreSQL: the `openai` SDK for chat, httpx for the rest."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.commands.main import main
from tests.conftest import query
from tests.integration.test_policy_admin import seed_policy
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.postgres import PostgresServer

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}
USER = [{"role": "user", "content": "hello"}]


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def sdk(gw: GatewayServer, secret: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0, default_headers=headers)


def chat(gw: GatewayServer, secret: str, **headers: str) -> tuple[str, str]:
    """One call; (request id, episode id)."""
    raw = sdk(gw, secret, **headers).chat.completions.with_raw_response.create(
        model="scripted-1", messages=USER
    )
    return raw.headers["x-request-id"], raw.headers["x-episode-id"]


def create_key(gw: GatewayServer, name: str, **fields: Any) -> dict[str, Any]:
    body = {"name": name, "scopes": ["chat", "feedback", "read"], **fields}
    response = httpx.post(gw.url + "/admin/keys", json=body, headers=ADMIN)
    assert response.status_code == 201, response.text
    return dict(response.json())


def written(url: str, call_id: str) -> bool:
    return bool(query(url, "SELECT id FROM calls WHERE id = :id", id=call_id))


def gateway(make_gateway: MakeGateway, url: str, **overrides: Any) -> GatewayServer:
    return make_gateway(
        url, **{"api_keys": ["sk-env"], "admin_key": "adm", "policy_refresh_s": 0.2, **overrides}
    )


def test_a_managed_key_is_created_used_and_revoked_over_the_admin_api(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url)
    created = create_key(gw, "checkout-bot", project="shop")
    secret = created["secret"]
    assert secret.startswith(created["prefix"]) and len(secret) > 40
    stored = query(database_url, "SELECT * FROM api_keys")
    assert len(stored) == 1 and secret not in json.dumps(stored, default=str)
    listed = httpx.get(gw.url + "/admin/keys", headers=ADMIN).json()
    assert [(k["id"], k["name"], k["project"], k["revoked_at"]) for k in listed] == [
        (created["id"], "checkout-bot", "shop", None)
    ]
    assert "secret" not in listed[0] and "hash" not in listed[0]

    call_id, episode_id = chat(gw, secret)
    env_call, _ = chat(gw, "sk-env")  # the environment keys keep working
    wait_until(lambda: written(database_url, call_id) and written(database_url, env_call), "calls written")
    keys = {r["id"]: r["key_id"] for r in query(database_url, "SELECT id, key_id FROM calls")}
    assert keys == {call_id: created["id"], env_call: "env"}
    assert query(database_url, "SELECT project FROM episodes WHERE id = :id", id=episode_id) == [
        {"project": "shop"}
    ]
    reward = httpx.post(
        gw.url + "/v1/feedback", json={"request_id": call_id, "value": 1.0}, headers=bearer(secret)
    )
    assert reward.status_code == 200, reward.text
    assert query(database_url, "SELECT key_id FROM rewards") == [{"key_id": created["id"]}]

    revoked = httpx.delete(f"{gw.url}/admin/keys/{created['id']}", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):  # refused at once by the gateway that revoked it
        chat(gw, secret)
    missing = httpx.post(gw.url + "/admin/keys/key_nope/revoke", headers=ADMIN)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "key_not_found")
    audit = httpx.get(gw.url + "/admin/audit", params={"target": created["id"]}, headers=ADMIN).json()
    assert [(e["action"], e["actor"]) for e in audit] == [
        ("key.revoke", "admin-key"),
        ("key.create", "admin-key"),
    ]
    bad = httpx.post(gw.url + "/admin/keys", json={"name": "x", "scopes": ["root"]}, headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "scopes")
    assert len(query(database_url, "SELECT id FROM api_keys")) == 1


def test_a_cli_error_is_one_line_that_names_kaizen_once(tmp_path: Path) -> None:
    # The log format already names the logger ("ERROR kaizen: ..."): a message that starts with "kaizen:" again
    # doubles it.
    url = f"sqlite:///{tmp_path / 'k.db'}"
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    for args, message in [
        (["keys", "revoke", "key_nope"], "no key 'key_nope'"),
        (["policy", "rollback", "nobody"], "no policy named 'nobody'"),
    ]:
        command = [sys.executable, "-m", "gateway", *args, *flags]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and errors[0].endswith(f" ERROR kaizen: {message}"), done.stderr


def test_keys_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["keys", "create", "batch-job", "--scope", "feedback", "--project", "ops", *flags]) == 0
    created = json.loads(capsys.readouterr().out)
    assert (created["scopes"], created["project"]) == (["feedback"], "ops")
    assert created["secret"].startswith(created["prefix"]) and "hash" not in created
    assert main(["keys", "list", *flags]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [created["id"]]
    assert main(["keys", "revoke", created["id"], *flags]) == 0
    assert json.loads(capsys.readouterr().out)["revoked_at"] is not None
    assert main(["keys", "list", *flags]) == 0
    assert capsys.readouterr().out == ""  # revoked keys are listed with --all only
    assert main(["keys", "revoke", "key_nope", *flags]) == 2
    assert main(["keys", "create", "x", "--project", "bad\x01", *flags]) == 2
    assert main(["audit", *flags]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["action"], e["actor"], e["target"]) for e in entries] == [
        ("key.revoke", "cli", created["id"]),
        ("key.create", "cli", created["id"]),
    ]


def test_a_revocation_reaches_another_gateway_within_the_refresh_interval(
    make_gateway: MakeGateway, postgres: PostgresServer
) -> None:
    url = postgres.create_database("keys_replicas")
    first = gateway(make_gateway, url, policy_refresh_s=0.5)
    second = gateway(make_gateway, url, policy_refresh_s=0.5)
    created = create_key(first, "replicated")
    wait_until(
        lambda: httpx.get(second.url + "/v1/models", headers=bearer(created["secret"])).status_code == 200,
        "the second gateway to learn the new key",
        timeout_s=10,
    )
    started = time.monotonic()
    assert httpx.delete(f"{first.url}/admin/keys/{created['id']}", headers=ADMIN).status_code == 200
    wait_until(
        lambda: httpx.get(second.url + "/v1/models", headers=bearer(created["secret"])).status_code == 401,
        "the second gateway to refuse the revoked key",
        timeout_s=10,
    )
    # One refresh interval, plus slack for a loaded machine.
    assert time.monotonic() - started < 0.5 + 2.0


def test_scopes_and_model_restrictions_are_refused_with_403(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url)
    reader = create_key(gw, "reader", scopes=["read"])["secret"]
    writer = create_key(gw, "writer", scopes=["chat"])["secret"]
    narrow = create_key(gw, "narrow", models=["some-policy"])["secret"]
    operator = create_key(gw, "operator", scopes=["admin"])["secret"]

    with pytest.raises(openai.PermissionDeniedError) as refused:
        chat(gw, reader)
    assert refused.value.code == "insufficient_scope"
    models = httpx.get(gw.url + "/v1/models", headers=bearer(reader))
    assert models.status_code == 403
    assert models.json()["error"]["type"] == "permission_error"
    call_id, episode_id = chat(gw, writer)
    wait_until(lambda: written(database_url, call_id), "the call written")
    for response in (
        httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=bearer(writer)),
        httpx.put(f"{gw.url}/v1/episodes/{episode_id}", json={"tags": ["x"]}, headers=bearer(writer)),
        httpx.post(gw.url + "/v1/feedback", json={"request_id": call_id, "value": 1}, headers=bearer(writer)),
        httpx.get(gw.url + "/admin/policies", headers=bearer(writer)),
        httpx.get(gw.url + "/admin/policies", headers=bearer("sk-env")),
    ):
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "insufficient_scope"
    assert query(database_url, "SELECT id FROM rewards") == []

    with pytest.raises(openai.PermissionDeniedError) as not_allowed:
        chat(gw, narrow)
    assert not_allowed.value.code == "model_not_allowed"
    assert sdk(gw, narrow).models.list().data == []
    # An admin-scoped managed key works as the admin key, and the admin key reads every project.
    assert httpx.get(gw.url + "/admin/policies", headers=bearer(operator)).status_code == 200
    assert httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=ADMIN).status_code == 200
    assert httpx.get(gw.url + "/v1/models", headers=bearer("wrong")).status_code == 401


def test_one_project_cannot_read_edit_or_reward_another_projects_episodes(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url)
    alpha = create_key(gw, "alpha-app", project="alpha")["secret"]
    beta = create_key(gw, "beta-app", project="beta")["secret"]
    call_id, episode_id = chat(gw, alpha)
    wait_until(lambda: written(database_url, call_id), "alpha's call written")

    assert httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=bearer(alpha)).status_code == 200
    read = httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=bearer(beta))
    assert (read.status_code, read.json()["error"]["code"]) == (404, "episode_not_found")
    edit = httpx.put(f"{gw.url}/v1/episodes/{episode_id}", json={"tags": ["beta"]}, headers=bearer(beta))
    assert edit.status_code == 404
    for target in ({"request_id": call_id}, {"episode_id": episode_id}):
        reward = httpx.post(gw.url + "/v1/feedback", json={**target, "value": 0.0}, headers=bearer(beta))
        assert (reward.status_code, reward.json()["error"]["code"]) == (404, "unknown_target"), reward.text
    assert query(database_url, "SELECT id FROM rewards") == []
    assert query(database_url, "SELECT tags FROM episodes WHERE id = :id", id=episode_id)[0]["tags"] in (
        [],
        "[]",
    )

    # Naming alpha's episode does not add beta's call to it: beta's call gets an episode of its own.
    beta_call, _ = chat(gw, beta, **{"x-episode-id": episode_id})
    wait_until(lambda: written(database_url, beta_call), "beta's call written")
    [row] = query(database_url, "SELECT episode_id FROM calls WHERE id = :id", id=beta_call)
    assert row["episode_id"] != episode_id
    assert len(httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=bearer(alpha)).json()["turns"]) == 1

    ok = httpx.post(
        gw.url + "/v1/feedback", json={"request_id": call_id, "value": 1.0}, headers=bearer(alpha)
    )
    assert ok.status_code == 200 and ok.json()["items"][0]["status"] == "linked"
    # The environment keys are the built-in project: alpha's episode is not theirs either.
    assert httpx.get(f"{gw.url}/v1/episodes/{episode_id}", headers=bearer("sk-env")).status_code == 404


def test_admin_changes_are_written_to_the_audit_log(make_gateway: MakeGateway, database_url: str) -> None:
    seed_policy(database_url, 3)
    gw = gateway(make_gateway, database_url)
    operator = create_key(gw, "operator", scopes=["admin"])
    as_operator = bearer(operator["secret"])
    for path, body in (
        ("promote", {"version": 2}),
        ("rollback", None),
        ("pause", None),
        ("resume", None),
        ("retention", None),
    ):
        response = httpx.post(f"{gw.url}/admin/policies/bot/{path}", json=body, headers=as_operator)
        assert response.status_code in (200, 202), response.text
    refused = httpx.post(f"{gw.url}/admin/policies/bot/promote", json={"version": 9}, headers=as_operator)
    assert refused.status_code == 404  # refused: no entry
    entries = httpx.get(gw.url + "/admin/audit", params={"target": "bot"}, headers=ADMIN).json()
    actor = f"{operator['id']} (operator)"
    assert [(e["action"], e["actor"]) for e in reversed(entries)] == [
        ("policy.promote", actor),
        ("policy.rollback", actor),
        ("policy.pause", actor),
        ("policy.resume", actor),
        ("run.retention", actor),
    ]
    assert entries[-1]["details"] == {"version": 2}
    assert entries[0]["details"]["run_id"] >= 1
    only = httpx.get(gw.url + "/admin/audit", params={"action": "policy.pause", "limit": 1}, headers=ADMIN)
    assert [e["action"] for e in only.json()] == ["policy.pause"]


def test_a_gateway_without_keys_closes_with_its_first_managed_key(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key="adm", policy_refresh_s=0.2)
    assert httpx.get(gw.url + "/v1/models").status_code == 200  # open, as before keys existed
    created = create_key(gw, "first")
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    assert httpx.get(gw.url + "/v1/models", headers=bearer(created["secret"])).status_code == 200
    assert httpx.delete(f"{gw.url}/admin/keys/{created['id']}", headers=ADMIN).status_code == 200
    # Revoking the last key does not open the gateway again.
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    assert httpx.get(gw.url + "/v1/models", headers=bearer(created["secret"])).status_code == 401


def test_promotions_from_the_cli_are_audited_as_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    seed_policy(url, 2)
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["policy", "promote", "bot", "1", *flags]) == 0
    assert main(["policy", "rollback", "bot", *flags]) == 0
    assert main(["policy", "promote", "bot", "7", *flags]) == 2  # refused: no entry
    capsys.readouterr()
    assert main(["audit", "--target", "bot", *flags]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["action"], e["actor"], e["details"]) for e in entries] == [
        ("policy.rollback", "cli", {"from_version": 1}),
        ("policy.promote", "cli", {"version": 1}),
    ]


def test_early_feedback_from_another_project_never_reaches_the_episode(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url, feedback_link_interval_s=0.1)
    alpha = create_key(gw, "alpha-app", project="alpha")["secret"]
    beta = create_key(gw, "beta-app", project="beta")["secret"]
    # Beta guesses the ids alpha will choose and rewards them before they exist: accepted as pending.
    for guess in ("ep-guess", "ep-other"):
        early = httpx.post(
            gw.url + "/v1/feedback",
            json={"episode_id": guess, "value": 0.0, "comment": "beta-was-here"},
            headers=bearer(beta),
        )
        assert early.status_code == 200 and early.json()["items"][0]["status"] == "pending"
    own = httpx.post(
        gw.url + "/v1/feedback",
        json={"episode_id": "ep-guess", "value": 1.0, "comment": "alpha-own"},
        headers=bearer(alpha),
    )
    assert own.status_code == 200
    call_id, episode_id = chat(gw, alpha, **{"x-episode-id": "ep-guess"})
    assert episode_id == "ep-guess"
    assert chat(gw, alpha, **{"x-episode-id": "ep-other"})[1] == "ep-other"
    wait_until(
        lambda: bool(query(database_url, "SELECT id FROM rewards WHERE status = 'linked'")),
        "alpha's early feedback linked",
    )
    statuses = [r["status"] for r in query(database_url, "SELECT status FROM rewards ORDER BY id")]
    assert statuses == ["pending", "pending", "linked"]
    shown = httpx.get(f"{gw.url}/v1/episodes/ep-guess", headers=bearer(alpha)).json()
    assert [r["value"] for r in shown["rewards"]] == [1.0]
    assert shown["reward"] == 1.0
    assert written(database_url, call_id)
    # Nor does the dashboard show it as the episode's, or count it as feedback on it.
    dashboard = login(gw.url, "adm")
    page = dashboard.get("/dashboard/episodes/ep-guess").text
    assert "alpha-own" in page and "beta-was-here" not in page
    with_feedback = dashboard.get("/dashboard/episodes", params={"feedback": "yes"}).text
    assert "ep-guess" in with_feedback and "ep-other" not in with_feedback
    assert "ep-other" in dashboard.get("/dashboard/episodes", params={"feedback": "no"}).text
    dashboard.close()
