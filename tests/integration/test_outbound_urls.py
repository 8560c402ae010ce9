"""URLs a policy names (its scoring webhook, its judge's `api_base`): http(s) only, global addresses only unless the
operator opts in (KAIZEN_OUTBOUND_PRIVATE_NETWORKS), checked when the policy is created and at every call, where
the request connects to the address that was checked and follows no redirect. Real HTTP on loopback throughout."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gateway.commands.main import main
from gateway.settings import Settings
from storage.episodes import EpisodeTranscript
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_judge import ScriptedJudge
from trainer.control.outbound import Address, OutboundRefused, PinnedTransport, non_global, url_problem
from trainer.control.policy_config import InvalidPolicyConfig, load_policy_config
from trainer.control.ruler import JudgeSettings
from trainer.control.scoring import GroupScore, Scorer
from trainer.control.training_job import TrainingJob, decode_job

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge() as server:
        yield server


@pytest.fixture
def elsewhere() -> Iterator[ScriptedJudge]:
    """A second listener, where a redirect points: it must never be reached."""
    with ScriptedJudge() as server:
        yield server


def hook_url(judge: ScriptedJudge, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{judge.port}/score"


def trajectories() -> list[EpisodeTranscript]:
    return [
        EpisodeTranscript(
            episode_id=f"ep-{i}",
            messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": f"good {i}"}],
        )
        for i in range(2)
    ]


def score(rewards: dict[str, Any], *, private_networks: bool, secret: str = "") -> GroupScore:
    config = load_policy_config({"rewards": rewards}).rewards
    judge = JudgeSettings(model="judge-model", max_retries=0, private_networks=private_networks)

    async def run() -> GroupScore:
        async with Scorer(config, judge, webhook_secret=secret) as scorer:
            return await scorer.score(trajectories())

    return asyncio.run(run())


def connections_to(port: int) -> list[int]:
    """The local ports of this process's established connections to `port` on loopback."""
    return sorted(
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://scorer.example/x",
        "gopher://h/",
        "scorer.example:8080/score",
        "http:///score",
    ],
)
def test_only_http_urls_with_a_host_are_accepted_in_a_policy(url: str) -> None:
    assert url_problem(url) is not None
    with pytest.raises(InvalidPolicyConfig) as refused:
        load_policy_config({"rewards": {"scorer": {"webhook_url": url}, "judge": {"api_base": url}}})
    message = str(refused.value)
    assert "rewards.scorer.webhook_url: must" in message and "rewards.judge.api_base: must" in message
    assert url_problem("https://scorer.example/score") is None
    assert load_policy_config({"rewards": {"scorer": {"webhook_url": ""}}}).rewards.scorer.kind == "judge"


def test_the_judge_setting_must_be_http_when_the_settings_load() -> None:
    with pytest.raises(ValueError, match="KAIZEN_JUDGE_API_BASE must be an http:// or https:// URL"):
        Settings.load(judge_api_base="file:///var/run/judge")
    assert (
        Settings.load(judge_api_base="http://127.0.0.1:8000/v1").judge().api_base
        == "http://127.0.0.1:8000/v1"
    )


def test_the_opt_in_reaches_every_scorer_with_the_judge_settings() -> None:
    # The judge job, the gate and the training child all build their scorer from `Settings.judge()`; the child
    # gets it in its job line.
    assert Settings.load().judge().private_networks is False
    judge = Settings.load(outbound_private_networks=True).judge()
    job = TrainingJob(
        policy="p", database_url="sqlite+aiosqlite://", data_dir="d", base_model="b", judge=judge
    )
    assert decode_job(job.encode()).judge.private_networks is True


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        ("100.64.0.1", "reserved or shared"),
        ("0.0.0.0", "private"),
        ("224.0.0.1", "multicast"),
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
    ],
)
def test_what_counts_as_a_non_global_address(address: str, kind: str | None) -> None:
    found = non_global(ipaddress.ip_address(address))
    assert (found is None) if kind is None else (found is not None and kind in found)


def test_the_pinned_transport_connects_to_the_address_it_resolved(judge: ScriptedJudge) -> None:
    # A name resolved once, by the check itself: the request goes to that address, with its own Host header.
    looked_up: list[str] = []

    async def resolve(host: str, port: int) -> list[Address]:
        looked_up.append(host)
        return [ipaddress.ip_address("127.0.0.1")]

    async def post() -> httpx.Response:
        transport = PinnedTransport(private_networks=True, resolve=resolve)
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.post(hook_url(judge, "scorer.example"), json={})

    response = asyncio.run(post())
    assert response.status_code == 200 and response.json()["score"] == 0.7
    assert response.request.url.host == "scorer.example"
    assert looked_up == ["scorer.example"]
    [(_, headers)] = judge.webhook_calls
    assert headers["Host"] == f"scorer.example:{judge.port}"


def test_a_name_with_any_non_global_address_is_refused_before_connecting(judge: ScriptedJudge) -> None:
    async def resolve(host: str, port: int) -> list[Address]:
        return [ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("127.0.0.1")]

    async def post() -> httpx.Response:
        transport = PinnedTransport(private_networks=False, resolve=resolve)
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.post(hook_url(judge, "rebound.example"), json={})

    with pytest.raises(OutboundRefused, match=r"rebound.example resolves to 127.0.0.1, which is a loopback"):
        asyncio.run(post())
    assert judge.webhook_calls == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433"])
def test_the_scorer_refuses_a_loopback_webhook_without_the_opt_in(judge: ScriptedJudge, host: str) -> None:
    # `localhost` and 2130706433 (127.0.0.1 as one number) are names: only resolving them shows where they lead.
    result = score({"scorer": {"webhook_url": hook_url(judge, host)}}, private_networks=False)
    assert result.scores is None and result.error is not None
    assert "OutboundRefused" in result.error and "loopback" in result.error
    assert "KAIZEN_OUTBOUND_PRIVATE_NETWORKS=true" in result.error
    assert judge.webhook_calls == []


def test_with_the_opt_in_the_webhook_is_called_and_an_unsigned_one_is_warned_about(
    judge: ScriptedJudge, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.control.scoring"):
        result = score({"scorer": {"webhook_url": hook_url(judge)}}, private_networks=True)
    assert result.error is None and [s.value for s in result.scores or []] == [0.7, 0.7]
    assert len(judge.webhook_calls) == 2
    unsigned = [r for r in caplog.records if "called unsigned" in r.getMessage()]
    assert len(unsigned) == 1 and "KAIZEN_FEEDBACK_SECRET" in unsigned[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.control.scoring"):
        signed = score({"scorer": {"webhook_url": hook_url(judge)}}, private_networks=True, secret="s")
    assert signed.error is None and not [r for r in caplog.records if "called unsigned" in r.getMessage()]


def test_a_webhook_redirect_is_not_followed(judge: ScriptedJudge, elsewhere: ScriptedJudge) -> None:
    judge.redirect_to = hook_url(elsewhere)
    result = score({"scorer": {"webhook_url": hook_url(judge), "webhook_retries": 0}}, private_networks=True)
    assert result.scores is None and result.error is not None and "307" in result.error
    assert len(judge.webhook_calls) == 1 and elsewhere.webhook_calls == []


def test_a_judge_the_policy_names_on_loopback_is_not_called_without_the_opt_in(judge: ScriptedJudge) -> None:
    result = score({"judge": {"api_base": judge.url}}, private_networks=False)
    assert result.scores is None and result.error is not None
    assert result.error.startswith("judge not called: 127.0.0.1 is a loopback address")
    assert judge.requests == []


def test_a_judge_the_policy_names_is_called_through_the_pinned_client(
    judge: ScriptedJudge, elsewhere: ScriptedJudge
) -> None:
    # Through litellm with Kaizen's own HTTP client: judged as usual, and a redirect is not followed (litellm's own
    # client would follow it, and post the trajectories wherever it points).
    rewards = {"judge": {"api_base": judge.url, "model": "hosted_vllm/judge-model"}}
    judged = score(rewards, private_networks=True)
    assert judged.error is None and [s.value for s in judged.scores or []] == [0.9, 0.9]
    assert [r["model"] for r in judge.requests] == ["judge-model"]

    judge.redirect_to = elsewhere.url + "/chat/completions"
    redirected = score(rewards, private_networks=True)
    assert redirected.scores is None and redirected.error is not None
    assert len(judge.requests) == 2 and elsewhere.requests == []


@pytest.mark.parametrize("target", ["judge", "webhook"])
def test_a_scorer_calls_the_policys_url_over_one_client_until_it_is_closed(
    judge: ScriptedJudge, target: str
) -> None:
    # Every group a scorer sends to the policy's judge or webhook goes through one pinned client (its connection
    # is kept), each request still checked where it connects; closing the scorer closes it.
    rewards = (
        {"judge": {"api_base": judge.url}}
        if target == "judge"
        else {"scorer": {"webhook_url": hook_url(judge)}}
    )
    config = load_policy_config({"rewards": rewards}).rewards
    settings = JudgeSettings(model="judge-model", max_retries=0, private_networks=True)

    async def scenario() -> tuple[list[list[int]], list[GroupScore]]:
        seen, results = [], []
        async with Scorer(config, settings, webhook_secret="s") as scorer:
            for _ in range(3):
                results.append(await scorer.score(trajectories()))
                seen.append(connections_to(judge.port))
        return seen, results

    seen, results = asyncio.run(scenario())
    assert [r.error for r in results] == [None, None, None]
    # A judge gets one request per group, a webhook one per trajectory (two in each group).
    assert (len(judge.requests), len(judge.webhook_calls)) == ((3, 0) if target == "judge" else (0, 6))
    assert len(seen[0]) == 1 and seen == [seen[0]] * 3
    assert connections_to(judge.port) == []


def test_the_operator_judge_setting_may_be_on_loopback(judge: ScriptedJudge) -> None:
    # KAIZEN_JUDGE_API_BASE is the operator's own configuration, like the engine's URL: never refused.
    config = load_policy_config({}).rewards
    settings = JudgeSettings(model="judge-model", api_base=judge.url, max_retries=0, private_networks=False)
    result = asyncio.run(Scorer(config, settings).score(trajectories()))
    assert result.error is None and len(judge.requests) == 1


def version_0_in_place(gw: GatewayServer, name: str) -> None:
    """A complete version 0 on disk, which creating the policy keeps instead of loading a base model."""
    directory = gw.settings.data_dir / "adapters" / name / "0"
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text('{"r": 16}')


@pytest.mark.parametrize(
    ("url", "found"),
    [
        ("file:///etc/passwd", "must be an http:// or https:// URL"),
        ("http://127.0.0.1:9/score", "127.0.0.1 is a loopback address"),
        ("http://localhost:9/score", "localhost resolves to"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.0.0.8/score", "a private address"),
    ],
)
def test_the_admin_api_refuses_such_a_policy_and_writes_nothing(
    make_gateway: MakeGateway, tmp_path: Path, url: str, found: str
) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    gw = make_gateway(db, admin_key="adm")
    for config in ({"rewards": {"scorer": {"webhook_url": url}}}, {"rewards": {"judge": {"api_base": url}}}):
        refused = httpx.post(
            gw.url + "/admin/policies", json={"name": "bot", "config": config}, headers=ADMIN, timeout=30
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "config",
            "invalid_policy_config",
        )
        assert found in error["message"], error["message"]
    assert query(db, "SELECT name FROM policies") == []
    assert not (gw.settings.data_dir / "adapters").exists()


def test_with_the_opt_in_the_admin_api_creates_it_and_warns_of_an_unsigned_webhook(
    make_gateway: MakeGateway, tmp_path: Path, judge: ScriptedJudge
) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    gw = make_gateway(db, admin_key="adm", outbound_private_networks=True, base_model="/no/such/model")
    version_0_in_place(gw, "bot")
    config = {"rewards": {"scorer": {"webhook_url": hook_url(judge)}}}
    created = httpx.post(gw.url + "/admin/policies", json={"name": "bot", "config": config}, headers=ADMIN)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["name"] == "bot" and body["config"] == config
    [warning] = body["warnings"]
    assert warning.startswith("rewards.scorer.webhook_url: KAIZEN_FEEDBACK_SECRET is not set")

    # Signed, nothing to warn of.
    signed = make_gateway(
        db, admin_key="adm", outbound_private_networks=True, base_model="/no/such/model", feedback_secret="s"
    )
    version_0_in_place(signed, "bot2")
    again = httpx.post(signed.url + "/admin/policies", json={"name": "bot2", "config": config}, headers=ADMIN)
    assert again.status_code == 201, again.text
    assert again.json()["warnings"] == []


def test_the_cli_refuses_it_the_same_way(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    config = tmp_path / "policy.json"
    config.write_text('{"rewards": {"scorer": {"webhook_url": "http://[::1]:9/score"}}}')
    flags = ["--database-url", db, "--data-dir", str(tmp_path), "--policy-config", str(config)]
    assert main(["policy", "create", "bot", *flags]) == 2
    assert "::1 is a loopback address" in caplog.text
    assert not (tmp_path / "adapters").exists()

    monkeypatch.setenv("KAIZEN_OUTBOUND_PRIVATE_NETWORKS", "true")
    (tmp_path / "adapters" / "bot" / "0").mkdir(parents=True)
    (tmp_path / "adapters" / "bot" / "0" / "adapter_config.json").write_text('{"r": 16}')
    caplog.clear()
    assert main(["policy", "create", "bot", *flags, "--base-model", "/no/such/model"]) == 0
    assert "called unsigned" not in caplog.text and "KAIZEN_FEEDBACK_SECRET is not set" in caplog.text
    assert query(db, "SELECT name FROM policies") == [{"name": "bot"}]
