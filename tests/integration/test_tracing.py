"""OpenTelemetry traces of chat calls, observed where they arrive: a real OTLP/HTTP receiver decodes what the
gateway's exporter sends (protobuf, `opentelemetry-proto`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import create_policy
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.scripted_upstream import REFUSAL, ScriptedUpstream

MakeGateway = Callable[..., GatewayServer]
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2
APP_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
APP_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def _by_call(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.attributes["kaizen.call_id"]: s for s in spans}


def test_each_captured_call_is_a_genai_span(
    make_gateway: MakeGateway, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'traced.db'}"
    gw = make_gateway(
        url,
        otel_traces=True,
        otel_endpoint=receiver.url,
        otel_headers="Authorization=Bearer%20otlp-secret",
        otel_service_name="kaizen-test",
    )
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    plain = client.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[{"role": "user", "content": "hello there"}],
        temperature=0.5,
        max_tokens=50,
        seed=3,
        extra_headers={"traceparent": f"00-{APP_TRACE}-{APP_SPAN}-01"},
    )
    streamed = client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "#long 4"}], stream=True
    )
    list(streamed.parse())
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(
            model="scripted-1", messages=[{"role": "user", "content": "#error 500"}]
        )
    client.chat.completions.create(
        model="scripted-1",
        messages=[{"role": "user", "content": "secret"}],
        extra_headers={"X-Kaizen-No-Log": "1"},
    )
    assert gw.services.tracer is not None and gw.services.tracer.flush()
    spans = _by_call(receiver.wait_for(3))
    assert len(spans) == 3  # the call sent with X-Kaizen-No-Log is not traced
    gw.flush()
    stored = {
        row["id"]: row
        for row in query(url, "SELECT id, latency_ms, prompt_tokens, completion_tokens FROM calls")
    }
    assert set(spans) == set(stored)

    first = spans[plain.headers["x-request-id"]]
    assert first.name == "chat scripted-1"
    assert first.kind == SPAN_KIND_CLIENT
    assert (first.trace_id, first.parent_span_id) == (APP_TRACE, APP_SPAN)  # a child of the app's own span
    a = first.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai"  # the upstream engine speaks OpenAI's API
    assert a["gen_ai.request.model"] == "scripted-1"
    assert a["gen_ai.response.model"] == "scripted-1"
    assert a["gen_ai.response.id"] == f"chatcmpl-{plain.headers['x-request-id']}"
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"], a["gen_ai.request.seed"]) == (
        0.5,
        50,
        3,
    )
    assert a["gen_ai.request.stream"] is False
    row = stored[plain.headers["x-request-id"]]
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        row["prompt_tokens"],
        row["completion_tokens"],
    )
    assert a["gen_ai.conversation.id"] == a["kaizen.episode_id"] == plain.headers["x-episode-id"]
    assert "gen_ai.input.messages" not in a  # content is opt-in
    assert first.end_ns - first.start_ns == pytest.approx(row["latency_ms"] * 1e6, rel=0.01, abs=2e5)
    assert first.status_code == 0
    assert first.resource["service.name"] == "kaizen-test"
    assert first.headers["authorization"] == "Bearer otlp-secret"

    stream = spans[streamed.headers["x-request-id"]]
    assert stream.attributes["gen_ai.request.stream"] is True
    assert (
        0 < stream.attributes["gen_ai.response.time_to_first_chunk"] < (stream.end_ns - stream.start_ns) / 1e9
    )
    assert stream.parent_span_id == ""  # no traceparent: a trace of its own

    error = spans[failed.value.response.headers["x-request-id"]]
    assert error.status_code == STATUS_ERROR
    assert error.attributes["kaizen.status"] == "error"
    assert error.attributes["error.type"]
    assert "gen_ai.response.id" not in error.attributes


async def _policy_with_redaction(url: str) -> None:
    await upgrade_database(async_database_url(url))
    database = Database(async_database_url(url))
    async with database.session() as session:
        await create_policy(session, "scripted-1", "base", {"privacy": {"mode": "mask"}})
        await session.commit()
    await database.dispose()


def test_content_goes_on_spans_only_when_asked_and_redacted_as_stored(
    make_gateway: MakeGateway, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'content.db'}"
    asyncio.run(_policy_with_redaction(url))
    gw = make_gateway(url, otel_traces=True, otel_endpoint=receiver.url, otel_content=True)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    client.chat.completions.create(
        model="scripted-1",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "write to jane@example.com #tool"},
        ],
        tools=tools,  # type: ignore[arg-type]
    )
    assert gw.services.tracer is not None and gw.services.tracer.flush()
    (span,) = receiver.wait_for(1)
    sent = json.loads(span.attributes["gen_ai.input.messages"])
    assert sent == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "write to [EMAIL] #tool"}]},
    ]
    (reply,) = json.loads(span.attributes["gen_ai.output.messages"])
    assert reply["role"] == "assistant" and reply["finish_reason"] == "tool_calls"
    (call,) = [p for p in reply["parts"] if p["type"] == "tool_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert json.loads(span.attributes["gen_ai.tool.definitions"]) == tools
    assert "jane@example.com" not in json.dumps(span.attributes)


def test_a_refusal_goes_on_the_span_as_the_replys_text(
    make_gateway: MakeGateway, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """An engine's refusal is the reply a trace viewer should show (here of a Responses call, which is
    captured and traced as the chat call it was translated into)."""
    gw = make_gateway(
        f"sqlite:///{tmp_path / 'refusal.db'}",
        otel_traces=True,
        otel_endpoint=receiver.url,
        otel_content=True,
    )
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model="scripted-1", input="#refuse")
    assert [part.type for item in response.output for part in getattr(item, "content", [])] == ["refusal"]
    assert gw.services.tracer is not None and gw.services.tracer.flush()
    (span,) = receiver.wait_for(1)
    assert span.attributes["gen_ai.response.id"] == response.id.replace("resp_", "chatcmpl-")
    assert json.loads(span.attributes["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": REFUSAL}], "finish_reason": "stop"}
    ]


_SERVE = textwrap.dedent(
    """
    import asyncio, json, sys
    from litestar.testing import AsyncTestClient
    from gateway.app import build_services, create_app
    from gateway.settings import Settings
    from migrations.runner import upgrade_database

    async def serve() -> int:
        settings = Settings.load(None)
        await upgrade_database(settings.database_url)
        # An open gateway answers loopback host names only (not the test client's `testserver.local`).
        async with AsyncTestClient(create_app(build_services(settings)), base_url="http://localhost") as client:
            reply = await client.post(
                "/v1/chat/completions", json={"model": "scripted-1", "messages": [{"role": "user", "content": "a"}]}
            )
        return reply.status_code

    status = asyncio.run(serve())
    sdk = {"opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
    print(json.dumps({"status": status, "loaded": sorted(sdk & set(sys.modules))}))
    """
)


@pytest.mark.parametrize("traces", [False, True])
def test_the_opentelemetry_sdk_is_imported_only_when_traces_are_on(
    tmp_path: Path, upstream: ScriptedUpstream, receiver: OtlpReceiver, traces: bool
) -> None:
    env = {
        **os.environ,
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream.url,
        "KAIZEN_DATA_DIR": str(tmp_path),
        "KAIZEN_DATABASE_URL": "",
        "KAIZEN_SCHEDULER": "false",
        "KAIZEN_OTEL_TRACES": "true" if traces else "false",
        "KAIZEN_OTEL_ENDPOINT": receiver.url,
    }
    done = subprocess.run(
        [sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # (Litestar imports the small `opentelemetry` API package whenever it is installed; the SDK and the
    # exporter, which do the work, are Kaizen's to import.)
    loaded = ["opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk.trace"]
    assert seen == {"status": 200, "loaded": loaded if traces else []}
    if traces:  # shutting the app down exported the call's span
        assert len(receiver.wait_for(1)) == 1
