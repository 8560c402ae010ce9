"""Promotion and rollback of policy versions: admin API and CLI (serving the switch is in test_vllm_engine)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.commands.main import main
from migrations.runner import upgrade_database
from storage.database import Database
from storage.models import POLICY_NAME_LENGTH
from storage.policies import activate_version, add_adapter, create_policy, get_policy, update_policy_config
from tests.conftest import query
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]


def seed_policy(url: str, versions: int) -> None:
    """A policy with versions 0..versions-1 and version 0 active (rows only: the upstream engine loads none)."""

    async def run() -> None:
        from gateway.settings import async_database_url

        await upgrade_database(async_database_url(url))
        database = Database(async_database_url(url))
        async with database.session() as session:
            policy = await create_policy(session, "bot", "base")
            for version in range(versions):
                await add_adapter(session, policy.id, version, f"/adapters/bot/{version}")
            await activate_version(session, policy.id, 0)
            await session.commit()
        await database.dispose()

    asyncio.run(run())


def active(url: str) -> list[tuple[int, str]]:
    rows = query(url, "SELECT a.version, a.status FROM adapters a ORDER BY a.version")
    return [(r["version"], r["status"]) for r in rows]


def test_promote_and_rollback_over_the_admin_api(make_gateway: MakeGateway, database_url: str) -> None:
    seed_policy(database_url, 3)
    gw = make_gateway(database_url, admin_key="adm")
    admin = {"authorization": "Bearer adm"}
    assert httpx.post(gw.url + "/admin/policies/bot/promote", json={"version": 2}).status_code == 401
    promoted = httpx.post(gw.url + "/admin/policies/bot/promote", json={"version": 2}, headers=admin)
    assert promoted.status_code == 200
    assert promoted.json()["active_version"] == 2
    assert active(database_url) == [(0, "retired"), (1, "candidate"), (2, "active")]
    back = httpx.post(gw.url + "/admin/policies/bot/rollback", headers=admin)
    assert back.json()["active_version"] == 0
    missing = httpx.post(gw.url + "/admin/policies/bot/promote", json={"version": 9}, headers=admin)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "version_not_found"
    for action, body in (("promote", {"version": 1}), ("rollback", None)):
        unknown = httpx.post(f"{gw.url}/admin/policies/nobody/{action}", json=body, headers=admin)
        assert unknown.status_code == 404
        assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
            "policy_not_found",
            "name",
        )
    listed = httpx.get(gw.url + "/admin/policies", headers=admin).json()
    assert [(p["name"], [v["version"] for v in p["versions"]]) for p in listed] == [("bot", [0, 1, 2])]


def test_promote_and_rollback_from_the_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    seed_policy(url, 2)
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["policy", "promote", "bot", "1", *flags]) == 0
    assert active(url) == [(0, "retired"), (1, "active")]
    assert main(["policy", "rollback", "bot", *flags]) == 0
    assert active(url)[0] == (0, "active")
    assert main(["policy", "rollback", "bot", *flags]) == 2  # nothing earlier than version 0
    assert main(["policy", "promote", "nobody", "1", *flags]) == 2


def test_a_bad_policy_configuration_is_refused_whole_and_nothing_is_written(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key="adm")
    admin = {"authorization": "Bearer adm"}
    bad = {
        "train": {"lerning_rate": 1e-4, "group_size": "eight"},
        "rewards": {"rule": {"kind": "median"}},
        "schedule": {"train_cron": "nightly"},
        "gate": {"holdout_fraction": 1.5},
        "extra": True,
    }
    refused = httpx.post(gw.url + "/admin/policies", json={"name": "bot", "config": bad}, headers=admin)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "config",
        "invalid_policy_config",
    )
    for path in (
        "train.lerning_rate: unknown key",
        "train.group_size",
        "rewards.rule.kind",
        "schedule.train_cron",
        "gate.holdout_fraction",
        "extra: unknown key",
    ):
        assert path in error["message"], error["message"]
    assert query(database_url, "SELECT name FROM policies") == []
    assert httpx.get(gw.url + "/admin/policies", headers=admin).json() == []


def test_pausing_a_policy_whose_stored_configuration_is_invalid_names_the_problems(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy(database_url, 1)

    async def break_config() -> None:
        from gateway.settings import async_database_url

        database = Database(async_database_url(database_url))
        async with database.session() as session:
            policy = await get_policy(session, "bot")
            assert policy is not None
            await update_policy_config(session, policy.id, {"gate": {"samples": 0}, "schedule": {"x": 1}})
            await session.commit()
        await database.dispose()

    asyncio.run(break_config())
    gw = make_gateway(database_url, admin_key="adm")
    paused = httpx.post(gw.url + "/admin/policies/bot/pause", headers={"authorization": "Bearer adm"})
    assert paused.status_code == 400, paused.text
    message = paused.json()["error"]["message"]
    assert "gate.samples" in message and "schedule.x: unknown key" in message


def test_the_cli_refuses_a_bad_policy_configuration_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    config = tmp_path / "policy.json"
    config.write_text(json.dumps({"train": {"epochs": 0}, "gate": {"tolerance": "low"}}))
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["policy", "create", "bot", "--policy-config", str(config), *flags]) == 2
    assert "train.epochs" in caplog.text and "gate.tolerance" in caplog.text
    assert query(url, "SELECT name FROM policies") == []


@pytest.mark.parametrize(
    "kind",
    [
        "not a repo id",
        "a directory with no model",
        "too long for a path",
        "an unknown user's home",
        "a hub id this machine cannot fetch",
    ],
)
def test_a_base_model_that_cannot_be_loaded_is_a_400_and_nothing_is_written(
    make_gateway: MakeGateway, database_url: str, tmp_path: Path, kind: str
) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    base_model = {
        "not a repo id": "/no/such/model",
        "a directory with no model": str(empty),
        "too long for a path": "m" * 5000,
        "an unknown user's home": "~no-such-user-here/model",
        "a hub id this machine cannot fetch": "NaN",
    }[kind]
    gw = make_gateway(database_url, admin_key="adm")
    # The first policy built in a process imports torch, transformers and PEFT (the gateway runs in this one): when
    # this test runs first, that is 10-60 s on a busy 2-core machine.
    refused = httpx.post(
        gw.url + "/admin/policies",
        json={"name": "bot", "base_model": base_model},
        headers={"authorization": "Bearer adm"},
        timeout=180,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "base_model",
        "base_model_unavailable",
    )
    assert base_model[:100] in error["message"] and len(error["message"]) < 2000
    assert query(database_url, "SELECT name FROM policies") == []
    adapters = gw.settings.data_dir / "adapters"
    assert not adapters.exists() or not any(adapters.rglob("*"))


def test_the_cli_refuses_a_base_model_that_cannot_be_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    flags = ["--database-url", url, "--data-dir", str(tmp_path), "--base-model", "/no/such/model"]
    assert main(["policy", "create", "bot", *flags]) == 2
    assert "base model '/no/such/model' could not be loaded" in caplog.text
    assert query(url, "SELECT name FROM policies") == []


@pytest.mark.parametrize("name", ["..", "."])
def test_a_policy_name_that_is_a_path_step_is_refused(
    make_gateway: MakeGateway, tmp_path: Path, name: str
) -> None:
    # Versions live at adapters/<name>/<version>: `..` would put them beside the adapter store, `.` among other
    # policies' directories.
    url = f"sqlite:///{tmp_path / 'names.db'}"
    gw = make_gateway(url, admin_key="adm")
    refused = httpx.post(
        gw.url + "/admin/policies", json={"name": name}, headers={"authorization": "Bearer adm"}
    )
    assert refused.status_code == 400, refused.text
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == ("name", "invalid_value")
    assert query(url, "SELECT name FROM policies") == []
    assert sorted(p.name for p in gw.settings.data_dir.iterdir() if p.is_dir() and p.name.isdigit()) == []
    assert (
        not (gw.settings.data_dir / "adapters").exists()
        or list((gw.settings.data_dir / "adapters").iterdir()) == []
    )


def test_the_cli_refuses_a_policy_name_its_column_cannot_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The admin API's body type bounds the name; the CLI reaches the same creation function without it, and
    # must not build version 0 for a name the database then refuses.
    url = f"sqlite:///{tmp_path / 'k.db'}"
    flags = ["--database-url", url, "--data-dir", str(tmp_path)]
    assert main(["policy", "create", "p" * (POLICY_NAME_LENGTH + 1), *flags]) == 2
    assert f"1 to {POLICY_NAME_LENGTH} characters" in caplog.text
    assert query(url, "SELECT name FROM policies") == []
    assert not (tmp_path / "adapters").exists()


def test_an_interrupted_create_is_finished_by_running_it_again(tmp_path: Path) -> None:
    # Stopped after version 0 was renamed into place and before its rows were written: the directory is complete,
    # so the next run keeps it (the builder does not load the base model, which here could not be loaded) and
    # writes the rows.
    url = f"sqlite:///{tmp_path / 'k.db'}"
    version_0 = tmp_path / "adapters" / "bot" / "0"
    version_0.mkdir(parents=True)
    (version_0 / "adapter_config.json").write_text('{"r": 16}')
    flags = ["--database-url", url, "--data-dir", str(tmp_path), "--base-model", "/no/such/model"]

    assert main(["policy", "create", "bot", *flags]) == 0
    assert query(url, "SELECT name, base_model FROM policies") == [
        {"name": "bot", "base_model": "/no/such/model"}
    ]
    assert active(url) == [(0, "active")]
    assert (version_0 / "adapter_config.json").read_text() == '{"r": 16}'
    assert main(["policy", "create", "bot", "--exist-ok", *flags]) == 0
    assert main(["policy", "create", "bot", *flags]) == 2  # it exists
    assert active(url) == [(0, "active")]


def test_a_hub_id_nobody_can_fetch_is_refused_at_once(make_gateway: MakeGateway, tmp_path: Path) -> None:
    """A name that could be a hub id, neither cached nor on a reachable hub, is refused by the gateway itself:
    no child process imports the training stack to find out (the fuzzing found that taking 30 s and more)."""
    gw = make_gateway(f"sqlite:///{tmp_path / 'hub.db'}", admin_key="adm")
    started = time.monotonic()
    refused = httpx.post(
        gw.url + "/admin/policies",
        json={"name": "bot", "base_model": "no-such-org/no-such-model"},
        headers={"authorization": "Bearer adm"},
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "base_model_unavailable"
    assert "neither a local directory nor in the local model cache" in refused.json()["error"]["message"]
    assert time.monotonic() - started < 10
