"""`/metrics`: what a real scrape reports after real traffic, read with prometheus_client's own parser, on
SQLite and PostgreSQL; who may scrape; the Grafana dashboard's queries name metrics the gateway exposes."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import async_database_url
from storage.database import Database
from storage.jobs import start_job_run, update_run
from storage.policies import activate_version, add_adapter, create_policy
from storage.rewards import record_judge_group
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.unit.test_monitoring_stack import grafana_panel

MakeGateway = Callable[..., GatewayServer]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ADMIN = "admin-metrics"
CLIENT = "client-metrics"
DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards" / "kaizen.json"


def scrape(gw: GatewayServer, headers: dict[str, str] | None = None) -> Samples:
    response = httpx.get(gw.url + "/metrics", headers=headers or {}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


async def _seed_database_figures(url: str) -> None:
    """What other processes write: a policy with an active version, a finished training run, judge groups."""
    database = Database(async_database_url(url))
    try:
        async with database.session() as session:
            policy = await create_policy(session, "bot", "base")
            for version in (0, 1):
                await add_adapter(session, policy.id, version, f"/adapters/bot/{version}")
            await activate_version(session, policy.id, 1)
            run = await start_job_run(session, policy.id, "train", 0, {})
            started = datetime.now(UTC) - timedelta(seconds=90)
            await update_run(
                session,
                run,
                status="succeeded",
                started_at=started,
                finished_at=started + timedelta(seconds=60),
            )
            await start_job_run(session, policy.id, "judge", 1, {})  # still running
            for status, cost in (("judged", 0.25), ("judged", 0.5), ("failed", None)):
                await record_judge_group(
                    session,
                    policy="bot",
                    group_key="g",
                    episode_ids=["e1", "e2"],
                    scorer="judge",
                    model="openai/gpt-x",
                    status=status,
                    attempts=3 if status == "failed" else 1,
                    error=None,
                    latency_ms=10.0,
                    cost_usd=cost,
                )
            await session.commit()
    finally:
        await database.dispose()


def test_a_scrape_reports_calls_capture_feedback_and_database_figures(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN, metrics_db_interval_s=0.05)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT, max_retries=0)
    usages = []
    for text in ("one", "two words"):
        usages.append(
            client.chat.completions.create(
                model="scripted-1", messages=[{"role": "user", "content": text}]
            ).usage
        )
    stream = client.chat.completions.create(
        model="scripted-1",
        messages=[{"role": "user", "content": "#long 5"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    reply = client.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[{"role": "user", "content": "not stored"}],
        extra_headers={"X-Kaizen-No-Log": "true"},
    )
    usages.append(reply.parse().usage)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model="scripted-1", messages=[{"role": "user", "content": "#error 500"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "x"}], n=0)
    stored = client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "rate me"}]
    )
    usages.append(stored.parse().usage)
    gw.flush()
    feedback = httpx.post(
        gw.url + "/v1/feedback",
        json={"request_id": stored.headers["x-request-id"], "value": True},
        headers={"authorization": f"Bearer {CLIENT}"},
    )
    assert feedback.status_code == 200, feedback.text
    asyncio.run(_seed_database_figures(database_url))

    samples = scrape(gw, {"authorization": f"Bearer {ADMIN}"})  # keys configured: a key, even on loopback
    # Calls, counted on the request path.
    assert value(samples, "kaizen_requests_total", model="scripted-1", served="scripted-1", status="ok") == 5
    assert value(samples, "kaizen_requests_total", status="error") == 1
    assert value(samples, "kaizen_requests_rejected_total", code="invalid_value") == 1
    assert value(samples, "kaizen_request_duration_seconds_count", stream="true") == 1
    assert value(samples, "kaizen_request_duration_seconds_count", stream="false") == 5
    assert value(samples, "kaizen_time_to_first_token_seconds_count", model="scripted-1") == 1
    assert value(samples, "kaizen_tokens_total", type="input") == sum(u.prompt_tokens for u in usages)
    assert value(samples, "kaizen_tokens_total", type="output") == sum(u.completion_tokens for u in usages)
    stored_tokens = query(database_url, "SELECT sum(prompt_tokens) AS n FROM calls")[0]["n"]
    assert stored_tokens == sum(u.prompt_tokens for u in usages) - reply.parse().usage.prompt_tokens
    # Capture: the same numbers as /admin/capture.
    capture = httpx.get(gw.url + "/admin/capture", headers={"authorization": f"Bearer {ADMIN}"}).json()
    for name in ("queued", "written", "spooled", "dropped", "opted_out"):
        assert value(samples, f"kaizen_capture_{name}_total") == capture[name], name
    assert capture["written"] == 5 and capture["opted_out"] == 1
    assert value(samples, "kaizen_capture_database_up") == 1
    assert value(samples, "kaizen_capture_queue_depth") == 0
    # Feedback: received here, and stored in the database.
    assert value(samples, "kaizen_feedback_items_total", status="linked") == 1
    assert value(samples, "kaizen_rewards_stored", source="feedback", status="linked") == 1
    # Written by other processes, read from the database.
    assert value(samples, "kaizen_metrics_database_ok") == 1
    assert value(samples, "kaizen_policy_active_version", policy="bot") == 1
    assert value(samples, "kaizen_runs", policy="bot", kind="train", status="succeeded") == 1
    assert value(samples, "kaizen_runs", policy="bot", kind="judge", status="running") == 1
    assert value(samples, "kaizen_run_duration_seconds_count", policy="bot", kind="train") == 1
    assert value(samples, "kaizen_run_duration_seconds_sum", policy="bot", kind="train") == pytest.approx(
        60, abs=0.01
    )
    assert value(samples, "kaizen_run_duration_seconds_count", policy="bot", kind="judge") == 0
    assert value(samples, "kaizen_judge_groups_total", policy="bot", status="judged") == 2
    assert value(samples, "kaizen_judge_groups_total", policy="bot", status="failed") == 1
    assert value(samples, "kaizen_judge_calls_total", policy="bot") == 5
    assert value(samples, "kaizen_judge_cost_usd_total", policy="bot") == pytest.approx(0.75)
    # The engine, and the process.
    assert value(samples, "kaizen_engine_up") == 1
    assert value(samples, "kaizen_engine_restarts_total") == 0
    assert value(samples, "process_resident_memory_bytes") > 0


def test_only_the_metrics_key_or_an_admin_key_may_scrape_a_public_gateway(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    # Bound to every address (as in docker): /metrics is not open.
    gw = make_gateway(url, host="0.0.0.0", api_keys=[CLIENT], admin_key=ADMIN, metrics_key="scrape-me")
    for headers in ({}, {"authorization": f"Bearer {CLIENT}"}, {"authorization": "Bearer scrape-m"}):
        refused = httpx.get(gw.url + "/metrics", headers=headers)
        assert refused.status_code == 401, refused.text
        validate("ErrorResponse", refused.json())
        assert refused.json()["error"]["code"] == "invalid_metrics_key"
    assert value(scrape(gw, {"authorization": "Bearer scrape-me"}), "kaizen_engine_up") == 1
    assert value(scrape(gw, {"authorization": f"Bearer {ADMIN}"}), "kaizen_engine_up") == 1
    # Without a metrics key, only an admin key opens it.
    other = make_gateway(url, host="0.0.0.0", api_keys=[CLIENT], admin_key=ADMIN)
    assert httpx.get(other.url + "/metrics", headers={"authorization": "Bearer scrape-me"}).status_code == 401
    assert value(scrape(other, {"authorization": f"Bearer {ADMIN}"}), "kaizen_engine_up") == 1


def test_on_loopback_too_any_configured_key_closes_metrics(make_gateway: MakeGateway, tmp_path: Path) -> None:
    # A TLS proxy on the gateway's own host makes a loopback bind public: the bind address decides nothing.
    url = f"sqlite:///{tmp_path / 'k.db'}"
    for keys in (
        {"api_keys": [CLIENT]},
        {"admin_key": ADMIN},
        {"metrics_key": "scrape-me"},
        {"api_keys": [CLIENT], "admin_key": ADMIN, "metrics_key": "scrape-me"},
    ):
        gw = make_gateway(url, host="127.0.0.1", **keys)
        for headers in ({}, {"authorization": f"Bearer {CLIENT}"}, {"authorization": "Bearer wrong"}):
            refused = httpx.get(gw.url + "/metrics", headers=headers)
            assert refused.status_code == 401, (keys, headers, refused.text)
            validate("ErrorResponse", refused.json())
            assert refused.json()["error"]["code"] == "invalid_metrics_key"
        if "admin_key" in keys:
            assert value(scrape(gw, {"authorization": f"Bearer {ADMIN}"}), "kaizen_engine_up") == 1
        if "metrics_key" in keys:
            assert value(scrape(gw, {"authorization": "Bearer scrape-me"}), "kaizen_engine_up") == 1


def test_a_gateway_without_any_key_serves_metrics_as_openly_as_v1(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    # Development (`make run`): no client, admin or metrics key. /v1 answers anyone who reaches it, and so does
    # /metrics; the loopback-host check against DNS rebinding applies to both.
    gw = make_gateway(f"sqlite:///{tmp_path / 'k.db'}")
    chat = {"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat).status_code == 200
    assert value(scrape(gw), "kaizen_requests_total", status="ok") == 1
    rebound = httpx.get(gw.url + "/metrics", headers={"host": "attacker.example"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"


def test_metrics_off_serves_no_route_and_counts_nothing(make_gateway: MakeGateway, tmp_path: Path) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path / 'off.db'}", metrics=False)
    reply = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200
    assert httpx.get(gw.url + "/metrics").status_code == 404
    assert gw.services.metrics is None and gw.services.chat.metrics is None


def test_openmetrics_is_served_to_scrapers_that_ask_for_it(make_gateway: MakeGateway, tmp_path: Path) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path / 'om.db'}")
    response = httpx.get(
        gw.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")


def _dashboard_metrics() -> set[str]:
    """What the compose dashboard and the panel docs/operations.md offers query."""
    panels = [*json.loads(DASHBOARD.read_text())["panels"], *grafana_panel()["panels"]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\b((?:kaizen|process)_[a-z0-9_]+)\b", expr)}


def test_every_metric_the_dashboard_queries_is_exposed(make_gateway: MakeGateway, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dash.db'}"
    gw = make_gateway(url, admin_key=ADMIN, metrics_db_interval_s=0.05)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):  # a histogram has no series before its first observation
        client.chat.completions.create(
            model="scripted-1", messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "x"}], n=0)
    gw.flush()
    reply = query(url, "SELECT id FROM calls LIMIT 1")[0]["id"]
    httpx.post(gw.url + "/v1/feedback", json={"request_id": reply, "value": 1.0})
    asyncio.run(_seed_database_figures(url))
    response = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 200, response.text
    families = list(text_string_to_metric_families(response.text))
    # A family with nothing to report yet (no call in flight) is still described.
    exposed = {f.name for f in families} | {s.name for f in families for s in f.samples}
    missing = sorted(n for n in _dashboard_metrics() if n not in exposed)
    assert missing == [], f"the dashboard queries metrics the gateway does not expose: {missing}"


def test_every_route_counts_its_answers_by_template_method_and_status(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    gw = make_gateway(
        f"sqlite:///{tmp_path / 'routes.db'}",
        api_keys=[CLIENT],
        admin_key=ADMIN,
        rate_limit_rpm=2,
        rate_limit_window_s=3600,
    )
    client = {"authorization": f"Bearer {CLIENT}"}
    chat = {"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}
    answers = [
        httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=client).status_code,
        httpx.get(gw.url + "/v1/episodes/no-such-episode", headers=client).status_code,
        # The third /v1 request of the hour is over the limit: the rate limiter answers it, no handler.
        httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=client).status_code,
        httpx.post(
            gw.url + "/v1/feedback", json={"request_id": "nope", "value": 1.0}, headers=client
        ).status_code,
        httpx.post(
            gw.url + "/v1/feedback", content=b"x", headers={**client, "content-type": "text/plain"}
        ).status_code,
        httpx.get(gw.url + "/admin/capture", headers={"authorization": f"Bearer {ADMIN}"}).status_code,
        httpx.get(gw.url + "/admin/capture").status_code,
        httpx.get(gw.url + "/dashboard/episodes/ep-1").status_code,
    ]
    assert answers == [200, 404, 429, 200, 415, 200, 401, 303]
    samples = scrape(gw, {"authorization": f"Bearer {ADMIN}"})

    def answered(route: str, method: str, status: int) -> float:
        return value(samples, "kaizen_http_requests_total", route=route, method=method, status=str(status))

    assert answered("/v1/chat/completions", "POST", 200) == 1
    assert answered("/v1/chat/completions", "POST", 429) == 1
    assert answered("/v1/episodes/{episode_id}", "GET", 404) == 1  # the template, not the raw path
    assert answered("/v1/feedback", "POST", 200) == 1
    assert answered("/v1/feedback", "POST", 415) == 1
    assert answered("/admin/capture", "GET", 200) == 1
    assert answered("/admin/capture", "GET", 401) == 1
    assert answered("/dashboard/episodes/{episode_id}", "GET", 303) == 1
    routes = {dict(labels)["route"] for name, labels in samples if name == "kaizen_http_requests_total"}
    assert not any("no-such-episode" in r or "ep-1" in r for r in routes)
