"""PII sent through a real gateway for a policy with redaction on reaches no byte on disk, no log line and
nothing the judge or an export sees, while the app still gets the model's answer as it was."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.engines.upstream import UpstreamEngine
from gateway.routing import ModelRouter, PoliciesUnavailable
from gateway.settings import Settings, async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.episodes import get_transcript
from storage.policies import create_policy
from tests.conftest import query
from tests.integration.test_chat_capture import client
from tests.integration.test_feedback import add_policy
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until

MakeGateway = Callable[..., GatewayServer]

PEM_BODY = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun"
PII = {
    "email": "jane.roe@example.org",
    "phone": "+44 20 7946 0958",
    "card": "4111 1111 1111 1111",
    "iban": "DE89 3704 0044 0532 0130 00",
    "ipv4": "203.0.113.42",
    "ipv6": "2001:db8::8a2e:370:7334",
    "openai": "sk-proj-Abc123def456GHI789jkl012",
    "github": "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "bearer": "Bearer eyJhbGciOiJIUzI1NiJ9.e30.c2lnbmF0dXJl",
    "pem": f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----",
    "hook": "CUST-123456",
}
# What must not appear anywhere: each value, its distinctive core, and the spaceless forms of the numbers.
NEEDLES = [v for k, v in PII.items() if k != "pem"] + [
    PEM_BODY,
    "jane.roe",
    "7946 0958",
    "4111111111111111",
    "1111 1111",
    "DE89370400440532013000",
    "0532 0130",
    "8a2e:370",
    "Abc123def456",
    "IOSFODNN7",
    "c2lnbmF0dXJl",
]


def leaks(data: bytes | str) -> list[str]:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return [needle for needle in NEEDLES if needle in text or json.dumps(needle)[1:-1] in text]


def files_under(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


def trajectory(url: str, episode_id: str) -> dict[str, Any]:
    """The trajectory as the scorers get it (RULER, a scoring function, a webhook): read back from storage."""

    async def run() -> dict[str, Any]:
        database = Database(async_database_url(url))
        async with database.session() as session:
            found = await get_transcript(session, episode_id)
        await database.dispose()
        assert found is not None
        return found.as_dict()

    return asyncio.run(run())


def test_pii_is_redacted_before_storage_and_the_app_gets_the_original(
    make_gateway: MakeGateway, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    db_path = tmp_path / "pii.db"
    url = f"sqlite:///{db_path}"
    # A long flush window and batches of two keep the first call in the capture log until the second arrives.
    gw = make_gateway(url, policy_refresh_s=0.1, capture_flush_ms=60_000.0, capture_batch_size=2)
    add_policy(
        url,
        "scripted-1",
        {"privacy": {"mode": "hash", "hook": "tests.support.redaction_hooks:customer_ids"}},
    )
    wait_until(lambda: gw.services.router.redactor("scripted-1") is not None, "the policy's redactor")

    text = " ; ".join(PII.values())
    openai_client = client(gw)
    raw = openai_client.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[{"role": "user", "content": text}],
        metadata={"contact": PII["email"]},
        user=PII["email"],
    )
    reply = raw.parse()
    # The scripted model echoes the words of the message: the app sees them as sent.
    assert reply.choices[0].message.content == "echo: " + " ".join(text.split())
    episode_id = raw.headers["x-episode-id"]
    log_dir = gw.settings.capture_log_dir
    wait_until(lambda: b"[EMAIL:" in files_under(log_dir), "the capture log to hold the record")
    assert leaks(files_under(gw.settings.data_dir / "spool")) == []

    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in openai_client.chat.completions.create(
            model="scripted-1", messages=[{"role": "user", "content": PII["card"]}], stream=True
        )
        if chunk.choices
    )
    assert streamed == "echo: " + PII["card"]

    gw.flush()
    feedback = httpx.post(
        gw.url + "/v1/feedback",
        json={
            "request_id": raw.headers["x-request-id"],
            "value": False,
            "comment": f"wrong, mail {PII['email']} or call {PII['phone']}",
            "metadata": {"reporter": PII["email"]},
        },
        timeout=10,
    )
    assert feedback.status_code == 200, feedback.text

    episode = httpx.get(f"{gw.url}/v1/episodes/{episode_id}", timeout=10)
    assert episode.status_code == 200
    assert leaks(episode.text) == [] and "[EMAIL:" in episode.text and "[CUSTOMER]" in episode.text
    judged = json.dumps(trajectory(url, episode_id))
    assert leaks(judged) == [] and "[CARD:" in judged and "[SECRET:" in judged

    [call] = query(url, "SELECT * FROM calls WHERE episode_id = :e", e=episode_id)
    stored = json.loads(call["request"]) if isinstance(call["request"], str) else call["request"]
    content = stored["messages"][0]["content"]
    for kind in ("EMAIL", "PHONE", "CARD", "IBAN", "IP", "SECRET"):
        assert f"[{kind}:" in content, (kind, content)
    # Token ids of redacted text are not kept: the trainer re-tokenises the redacted text.
    assert call["prompt_token_ids"] in (None, "null")
    assert json.loads(call["completion_token_ids"]) == [None]

    # Every byte the database holds, the write-ahead file included, and every log line.
    assert leaks(db_path.read_bytes()) == []
    wal = Path(f"{db_path}-wal")
    assert leaks(wal.read_bytes() if wal.exists() else b"") == []
    assert leaks(files_under(gw.settings.data_dir)) == []
    assert leaks(caplog.text) == []
    gw.stop()
    assert leaks(db_path.read_bytes()) == []
    assert leaks(files_under(gw.settings.data_dir)) == []


def test_policies_without_privacy_store_verbatim(make_gateway: MakeGateway, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    gw = make_gateway(url, policy_refresh_s=0.1)
    add_policy(url, "scripted-1", {})
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": PII["email"]}]
    )
    gw.flush()
    assert gw.services.router.redactor("scripted-1") is None
    [call] = query(url, "SELECT request FROM calls WHERE episode_id = :e", e=raw.headers["x-episode-id"])
    assert PII["email"] in str(call["request"])


def test_a_capture_only_gateway_serves_nothing_before_it_has_read_the_privacy_sections(
    tmp_path: Path,
) -> None:
    # A capture-only gateway passes any model name to its upstream, and the policy of that name decides what is
    # masked: with the policies unread, a call would be stored verbatim. Here the database cannot be opened yet
    # (its directory is missing), as when it is unreachable at start-up.
    url = f"sqlite:///{tmp_path / 'later' / 'kaizen.db'}"
    settings = Settings.load(data_dir=tmp_path, database_url=url, engine="upstream", port=0)

    async def run() -> None:
        database = Database(settings.database_url)
        router = ModelRouter(UpstreamEngine(settings), 60.0, database=database, policy_refresh_s=60.0)
        try:
            await router.refresh_policies()
            for read in (router.resolve, router.redactor):
                with pytest.raises(PoliciesUnavailable) as refused:
                    read("scripted-1")
                assert (refused.value.status_code, refused.value.code) == (503, "policies_unavailable")
            await upgrade_database(settings.database_url)
            async with database.session() as session:
                await create_policy(session, "scripted-1", "base", {"privacy": {"mode": "mask"}})
                await session.commit()
            await router.refresh_policies()
            assert router.resolve("scripted-1").policy == "scripted-1"
            redactor = router.redactor("scripted-1")
            assert redactor is not None and PII["email"] not in redactor.text(PII["email"])
        finally:
            await router.engine.close()
            await database.dispose()

    asyncio.run(run())


def test_what_a_client_writes_about_an_episode_later_is_redacted_too(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    # Metadata and tags set with PUT /v1/episodes/{id}, and a feedback item's name, reach the database as much
    # as the call itself does.
    url = f"sqlite:///{tmp_path / 'later.db'}"
    gw = make_gateway(url, policy_refresh_s=0.1)
    add_policy(url, "scripted-1", {"privacy": {"mode": "mask"}})
    wait_until(lambda: gw.services.router.redactor("scripted-1") is not None, "the policy's redactor")
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "hello"}]
    )
    episode_id = raw.headers["x-episode-id"]
    gw.flush()
    edit = {"metadata": {"owner": PII["email"], "notes": [PII["phone"]]}, "tags": [PII["email"], "plain"]}
    edited = httpx.put(f"{gw.url}/v1/episodes/{episode_id}", json=edit, timeout=10)
    assert edited.status_code == 200, edited.text
    assert edited.json()["metadata"] == {"owner": "[EMAIL]", "notes": ["[PHONE]"]}
    assert edited.json()["tags"] == ["[EMAIL]", "plain"]
    named = {"request_id": raw.headers["x-request-id"], "value": 1, "name": f"csat {PII['email']}"}
    assert httpx.post(gw.url + "/v1/feedback", json=named, timeout=10).status_code == 200
    [row] = query(url, "SELECT metadata, tags FROM episodes WHERE id = :e", e=episode_id)
    [reward] = query(url, "SELECT name FROM rewards")
    assert leaks(json.dumps([row, reward], default=str)) == [] and reward["name"] == "csat [EMAIL]"
