"""`/v1/responses` in front of the scripted upstream, called with the official `openai` SDK, on SQLite and
PostgreSQL: create (non-stream and stream), tools and their outputs, structured output, stored responses and
their chains across replicas, the calls and episodes they become, feedback, projects and bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel
from sqlalchemy import update

from gateway.settings import async_database_url
from storage.database import Database
from storage.models import Call
from storage.retention import prune_calls
from tests.conftest import query
from tests.integration.test_feedback import add_policy
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.polling import wait_until
from tests.support.scripted_upstream import REFUSAL, ScriptedUpstream, text_token_ids

MakeGateway = Callable[..., GatewayServer]
JSON_COLUMNS = ("request", "response", "completion_token_ids", "completion_logprobs", "body", "input_items")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}


@contextmanager
def refused_with(code: str) -> Iterator[None]:
    """The SDK raised a 400 whose OpenAI error names `code`. openai-python 3 puts only the error's message in the
    exception's text, and the code on `.code`."""
    with pytest.raises(openai.BadRequestError) as refused:
        yield
    assert refused.value.code == code


def sdk(gw: GatewayServer, key: str = "unused", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, default_headers=headers)


def rows(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    found = query(url, sql, **params)
    for row in found:  # JSON columns come back as text from SQLite
        for key in JSON_COLUMNS:
            if isinstance(row.get(key), str):
                row[key] = json.loads(row[key])
    return found


def calls(gw: GatewayServer, url: str) -> list[dict[str, Any]]:
    gw.flush()
    return rows(url, "SELECT * FROM calls ORDER BY created_at")


def events(body: str) -> list[dict[str, Any]]:
    """The events of a Responses stream; each is named (`event:`) by its type and validates."""
    parsed = []
    for block in body.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        validate("ResponseStreamEvent", event)
        parsed.append(event)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    return parsed


def stream(gw: GatewayServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=10) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return events(response.read().decode())


def test_create_is_conformant_and_captured_as_a_chat_call(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url)
    before = len(upstream.requests)
    raw = sdk(gw).responses.with_raw_response.create(
        model="scripted-1",
        instructions="Answer briefly.",
        input="hello there",
        temperature=0.5,
        max_output_tokens=64,
        metadata={"ticket": "T-1"},
        user="u-7",
        extra_body={"top_k": 5},
    )
    body = raw.http_response.json()
    validate("Response", body)
    response = raw.parse()
    assert response.output_text == "echo: hello there"
    assert (response.status, response.instructions, response.metadata) == (
        "completed",
        "Answer briefly.",
        {"ticket": "T-1"},
    )
    assert response.usage is not None and response.usage.output_tokens == 3
    call_id = raw.headers["x-request-id"]
    assert response.id == f"resp_{call_id}"

    sent = upstream.requests[before].body
    assert sent["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "hello there"},
    ]
    assert (sent["temperature"], sent["max_completion_tokens"], sent["user"], sent["top_k"]) == (
        0.5,
        64,
        "u-7",
        5,
    )
    assert sent["logprobs"] is True and sent["return_token_ids"] is True  # as for every chat call
    assert sent["metadata"] == {"ticket": "T-1"}

    [row] = calls(gw, database_url)
    assert (row["id"], row["episode_id"], row["status"], row["position"]) == (
        call_id,
        raw.headers["x-episode-id"],
        "ok",
        0,
    )
    assert row["request"]["messages"] == sent["messages"]
    assert row["response"]["choices"][0]["message"]["content"] == "echo: hello there"
    assert row["completion_token_ids"] == [text_token_ids("echo: hello there")]
    assert row["completion_logprobs"] == [[-0.0, -0.1, -0.2]]
    assert row["user"] == "u-7"
    [stored] = rows(database_url, "SELECT * FROM responses")
    assert (stored["id"], stored["call_id"], stored["previous_response_id"]) == (response.id, call_id, None)
    assert stored["body"] == body
    assert stored["input_items"] == [
        {
            "id": f"in_{call_id}_0",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hello there"}],
            "status": "completed",
        }
    ]


def test_stream_sends_the_typed_event_sequence(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    streamed = stream(gw, {"model": "scripted-1", "input": "#long 4", "stream": True})
    kinds = [e["type"] for e in streamed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert streamed[0]["response"]["status"] == "in_progress" and streamed[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "w0 w1 w2 w3"
    final = streamed[-1]["response"]
    validate("Response", final)
    assert final["output"][0]["content"][0]["text"] == "w0 w1 w2 w3"
    assert final["usage"]["output_tokens"] == 4
    # Stored before the last event was sent: readable at once, and as streamed.
    assert sdk(gw).responses.retrieve(final["id"]).model_dump(mode="json", exclude_none=True) == (
        openai.types.responses.Response.model_validate(final).model_dump(mode="json", exclude_none=True)
    )
    [row] = calls(gw, database_url)
    assert row["stream"] in (True, 1) and row["status"] == "ok"
    assert row["response"]["choices"][0]["message"]["content"] == "w0 w1 w2 w3"

    # The SDK's stream helper assembles the same text and hands over the final response.
    with sdk(gw).responses.stream(
        model="scripted-1", input="#long 3", previous_response_id=final["id"]
    ) as events_:
        deltas = [e.delta for e in events_ if e.type == "response.output_text.delta"]
        done = events_.get_final_response()
    assert "".join(deltas) == done.output_text == "w0 w1 w2"


def test_streamed_tool_calls_and_an_engine_failure(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    streamed = stream(gw, {"model": "scripted-1", "input": "#tools2", "tools": [WEATHER], "stream": True})
    added = [e["item"] for e in streamed if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["name"], i["status"]) for i in added] == [
        ("function_call", "get_weather", "in_progress")
    ] * 2
    done = {
        e["item_id"]: e["arguments"] for e in streamed if e["type"] == "response.function_call_arguments.done"
    }
    assert [json.loads(a)["city"] for a in done.values()] == ["Paris", "London"]
    final = streamed[-1]["response"]
    assert [(i["id"], i["arguments"]) for i in final["output"]] == list(done.items())

    # The engine sends garbage mid-stream: the stream ends with response.failed, the call is an error.
    failed = stream(gw, {"model": "scripted-1", "input": "#garbage", "stream": True})
    assert failed[-1]["type"] == "response.failed"
    assert (
        failed[-1]["response"]["status"] == "failed"
        and failed[-1]["response"]["error"]["code"] == "server_error"
    )
    assert [r["status"] for r in calls(gw, database_url)] == ["ok", "error"]
    assert len(rows(database_url, "SELECT id FROM responses")) == 1  # a failed response is not stored

    # An engine error before any output is the HTTP answer, in OpenAI's shape, with the call's ids.
    refused = httpx.post(gw.url + "/v1/responses", json={"model": "scripted-1", "input": "#error 503"})
    assert refused.status_code == 503 and refused.headers["x-request-id"]
    validate("ErrorResponse", refused.json())

    # A client that leaves mid-stream: the partial reply is recorded as such, and no response is stored.
    body = {"model": "scripted-1", "input": "#long 30 #slow 100", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=10) as response:
        left = response.headers["x-request-id"]
        for line in response.iter_lines():  # leave at the first text delta
            if line == "event: response.output_text.delta":
                break
    wait_until(
        lambda: bool(rows(database_url, "SELECT id FROM calls WHERE id = :id", id=left)), "the call row"
    )
    [row] = rows(database_url, "SELECT * FROM calls WHERE id = :id", id=left)
    assert row["status"] == "client_disconnected"
    assert row["response"]["choices"][0]["message"]["content"].startswith("w0")
    assert len(rows(database_url, "SELECT id FROM responses")) == 1


def test_a_function_call_loop_by_previous_response_id_is_one_episode(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url)
    client = sdk(gw)
    first = client.responses.with_raw_response.create(
        model="scripted-1",
        instructions="Use the tools.",
        input="#tool what is the weather?",
        tools=[WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    response = first.parse()
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    sent = upstream.requests[-1].body
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["parameters"],
                "strict": False,
            },
        }
    ]
    assert (sent["tool_choice"], sent["parallel_tool_calls"]) == ("auto", False)

    second = client.responses.with_raw_response.create(
        model="scripted-1",
        previous_response_id=response.id,
        instructions="Use the tools.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.parse().output_text == "echo: sunny"
    assert upstream.requests[-1].body["messages"] == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "#tool what is the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    third = client.responses.with_raw_response.create(
        model="scripted-1", previous_response_id=second.parse().id, input="thanks"
    )
    episode_ids = {r.headers["x-episode-id"] for r in (first, second, third)}
    assert len(episode_ids) == 1
    stored = calls(gw, database_url)
    assert [(r["id"], r["position"]) for r in stored] == [
        (r.headers["x-request-id"], k) for k, r in enumerate((first, second, third))
    ]
    assert {r["episode_id"] for r in stored} == episode_ids
    assert stored[2]["request"]["messages"][-2:] == [
        {"role": "assistant", "content": "echo: sunny"},
        {"role": "user", "content": "thanks"},
    ]  # the instructions of an earlier response are not carried over

    episode = httpx.get(f"{gw.url}/v1/episodes/{episode_ids.pop()}").json()
    assert [t["request_id"] for t in episode["turns"]] == [r["id"] for r in stored]
    # Feedback by the response id reaches its call, and through it the episode.
    reply = httpx.post(gw.url + "/v1/feedback", json={"request_id": third.parse().id, "value": True})
    assert reply.status_code == 200, reply.text
    [item] = reply.json()["items"]
    assert (item["request_id"], item["episode_id"], item["status"]) == (
        stored[2]["id"],
        stored[2]["episode_id"],
        "linked",
    )


def test_sending_the_whole_input_back_stitches_one_episode(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    """The Agents SDK's default: no stored state, the conversation sent back in full each turn."""
    gw = make_gateway(database_url)
    client = sdk(gw)
    conversation: list[Any] = [{"role": "user", "content": "#tool weather please"}]
    first = client.responses.with_raw_response.create(
        model="scripted-1", input=conversation, tools=[WEATHER], store=False
    )
    [call] = first.parse().output
    conversation += [item.model_dump(exclude_none=True) for item in first.parse().output]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "rain"})
    second = client.responses.with_raw_response.create(
        model="scripted-1", input=conversation, tools=[WEATHER], store=False
    )
    reply = second.parse()
    assert reply.output_text == "echo: rain"
    conversation += [item.model_dump(exclude_none=True) for item in reply.output]
    conversation.append({"role": "user", "content": [{"type": "input_text", "text": "and tomorrow?"}]})
    third = client.responses.with_raw_response.create(model="scripted-1", input=conversation, store=False)
    assert upstream.requests[-1].body["messages"][2:] == [
        {"role": "tool", "tool_call_id": call.call_id, "content": "rain"},
        {"role": "assistant", "content": "echo: rain"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
    ]
    stored = calls(gw, database_url)
    assert len({r["episode_id"] for r in stored}) == 1
    assert [r["position"] for r in stored] == [0, 1, 2]
    assert [r["id"] for r in stored] == [r.headers["x-request-id"] for r in (first, second, third)]
    assert rows(database_url, "SELECT id FROM responses") == []  # store=False: nothing to retrieve


class Forecast(BaseModel):
    city: str
    days: int


def test_structured_output(make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream) -> None:
    gw = make_gateway(database_url)
    parsed = sdk(gw).responses.parse(
        model="scripted-1", input='#json {"city": "Paris", "days": 3}', text_format=Forecast
    )
    assert parsed.output_parsed == Forecast(city="Paris", days=3)
    fmt = upstream.requests[-1].body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Forecast"
    assert fmt["json_schema"]["schema"]["properties"]["days"] == {"title": "Days", "type": "integer"}
    assert parsed.text is not None and parsed.text.format.type == "json_schema"

    raw = sdk(gw).responses.with_raw_response.create(
        model="scripted-1", input='#json {"ok": true}', text={"format": {"type": "json_object"}}
    )
    validate("Response", raw.http_response.json())
    assert json.loads(raw.parse().output_text) == {"ok": True}
    assert upstream.requests[-1].body["response_format"] == {"type": "json_object"}


def test_a_refusal_is_relayed_streamed_or_not_and_kept(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    created = sdk(gw).responses.create(model="scripted-1", input="#refuse the secret")
    [message] = created.output
    assert message.type == "message"
    assert [(p.type, getattr(p, "refusal", None)) for p in message.content] == [("refusal", REFUSAL)]

    streamed = stream(gw, {"model": "scripted-1", "input": "#refuse the secret", "stream": True})
    kinds = [e["type"] for e in streamed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.refusal.delta"] * len(REFUSAL.split()),
        "response.refusal.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert streamed[3]["part"] == {"type": "refusal", "refusal": ""}
    deltas = [e for e in streamed if e["type"] == "response.refusal.delta"]
    assert "".join(e["delta"] for e in deltas) == REFUSAL
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in deltas} == {
        (streamed[2]["item"]["id"], 0, 0)
    }
    assert streamed[-4]["refusal"] == REFUSAL
    assert streamed[-3]["part"] == {"type": "refusal", "refusal": REFUSAL}
    final = streamed[-1]["response"]
    assert final["output"][0]["content"] == [{"type": "refusal", "refusal": REFUSAL}]

    # Both are stored as they were answered, and both calls keep the refusal as the assistant's reply.
    for response_id in (created.id, final["id"]):
        [kept] = sdk(gw).responses.retrieve(response_id).output
        assert kept.model_dump()["content"] == [{"type": "refusal", "refusal": REFUSAL}]
    assert [r["response"]["choices"][0]["message"] for r in calls(gw, database_url)] == [
        {"role": "assistant", "content": None, "refusal": REFUSAL}
    ] * 2


def test_tool_choice_logprobs_and_what_agents_send(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url)
    client = sdk(gw)
    second_tool = {**WEATHER, "name": "get_time"}
    for choice, expected in (
        ("required", "required"),
        ("none", "none"),
        ({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}),
    ):
        raw = client.responses.with_raw_response.create(
            model="scripted-1",
            input="hi",
            tools=[WEATHER, second_tool],
            tool_choice=choice,  # type: ignore[arg-type]
        )
        validate("Response", raw.http_response.json())
        assert raw.http_response.json()["tool_choice"] == choice  # echoed as given
        assert upstream.requests[-1].body["tool_choice"] == expected
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    client.responses.create(model="scripted-1", input="hi", tools=[WEATHER, second_tool], tool_choice=allowed)  # type: ignore[arg-type]
    sent = upstream.requests[-1].body
    assert (sent["tool_choice"], [t["function"]["name"] for t in sent["tools"]]) == ("required", ["get_time"])

    # Logprobs when included, in the output text and in every text delta.
    raw = client.responses.with_raw_response.create(
        model="scripted-1", input="a b", include=["message.output_text.logprobs"], top_logprobs=2
    )
    body = raw.http_response.json()
    validate("Response", body)
    logprobs = body["output"][0]["content"][0]["logprobs"]
    assert [e["logprob"] for e in logprobs] == [-0.0, -0.1, -0.2] and len(logprobs[0]["top_logprobs"]) == 2
    assert body["top_logprobs"] == 2
    streamed = stream(
        gw,
        {"model": "scripted-1", "input": "a b", "stream": True, "include": ["message.output_text.logprobs"]},
    )
    deltas = [e for e in streamed if e["type"] == "response.output_text.delta"]
    assert [e["logprobs"][0]["logprob"] for e in deltas] == [-0.0, -0.1, -0.2]

    # What the OpenAI Agents SDK and the AI SDK send along, accepted (and echoed where the response has it).
    raw = client.responses.with_raw_response.create(
        model="scripted-1",
        input=[{"role": "user", "content": "hello"}],
        include=["reasoning.encrypted_content"],
        store=True,
        reasoning={"effort": "low", "summary": "auto"},
        truncation="auto",
        parallel_tool_calls=True,
        prompt_cache_key="agent-1",
        prompt_cache_retention="24h",
        safety_identifier="user-hash",
        service_tier="auto",
        max_tool_calls=3,
        text={"verbosity": "low"},
        stream_options={"include_obfuscation": False},  # type: ignore[call-overload]
        extra_body={"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
    )
    body = raw.http_response.json()
    validate("Response", body)
    assert (body["truncation"], body["reasoning"], body["prompt_cache_key"]) == (
        "auto",
        {"effort": "low", "summary": "auto"},
        "agent-1",
    )
    sent = upstream.requests[-1].body
    assert sent["prompt_cache_key"] == "agent-1" and "reasoning" not in sent and "include" not in sent


def test_stored_responses_get_input_items_and_delete(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, responses_read_wait_s=0.3)
    client = sdk(gw)
    created = client.responses.create(
        model="scripted-1",
        input=[
            {"role": "developer", "content": "Be kind."},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}],
            },
        ],
    )
    # Readable at once (before the capture writer stored it), then from SQL.
    first = httpx.get(f"{gw.url}/v1/responses/{created.id}")
    assert first.status_code == 200
    validate("Response", first.json())
    gw.flush()
    assert httpx.get(f"{gw.url}/v1/responses/{created.id}").json() == first.json()
    assert client.responses.retrieve(created.id).output_text == "echo: one two"
    listed = httpx.get(f"{gw.url}/v1/responses/{created.id}/input_items", params={"order": "asc"})
    validate("ResponseItemList", listed.json())
    assert [(i["role"], i["content"][0]["text"]) for i in listed.json()["data"]] == [
        ("developer", "Be kind."),
        ("user", "one"),
    ]
    page = client.responses.input_items.list(created.id, limit=1)
    assert [i.id for i in page.data] == [listed.json()["last_id"]] and page.has_more

    assert httpx.delete(f"{gw.url}/v1/responses/{created.id}").json() == {
        "id": created.id,
        "object": "response",
        "deleted": True,
    }
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{gw.url}/v1/responses/{created.id}")
        assert gone.status_code == 404
        validate("ErrorResponse", gone.json())
        assert gone.json()["error"]["code"] == "response_not_found"
    assert rows(database_url, "SELECT id FROM responses") == []
    assert len(calls(gw, database_url)) == 1  # the captured call stays (it is training data)
    with refused_with("previous_response_not_found"):
        client.responses.create(model="scripted-1", input="again", previous_response_id=created.id)

    # Deleted through the SDK right after the create: the delete waits for the writer, which stores nothing after.
    quick = client.responses.create(model="scripted-1", input="quick")
    client.responses.delete(quick.id)
    gw.flush()
    assert rows(database_url, "SELECT id FROM responses") == []

    # store=False: served and captured, never retrievable.
    unstored = client.responses.create(model="scripted-1", input="private", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert len(calls(gw, database_url)) == 3


def _item(item: dict[str, Any]) -> tuple[Any, ...]:
    if item["type"] == "message":
        return item["id"], item["role"], item["content"][0]["text"]
    return item["id"], item["type"], item["call_id"]


def test_input_items_list_the_whole_chain(make_gateway: MakeGateway, database_url: str) -> None:
    """As OpenAI lists them: the items a response was generated from, those of the responses it continues
    (their input and their output) included, oldest first with `order=asc`; instructions are not items."""
    gw = make_gateway(database_url)
    client = sdk(gw)
    first = client.responses.create(
        model="scripted-1", instructions="Be brief.", input="#tool weather?", tools=[WEATHER]
    )
    [call] = first.output
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(model="scripted-1", previous_response_id=first.id, input=[output])
    third = client.responses.create(model="scripted-1", previous_response_id=second.id, input="thanks")
    [answer] = second.output
    whole = [
        (f"in_{first.id[5:]}_0", "user", "#tool weather?"),
        (call.id, "function_call", call.call_id),
        (f"in_{second.id[5:]}_0", "function_call_output", call.call_id),
        (answer.id, "assistant", "echo: sunny"),
        (f"in_{third.id[5:]}_0", "user", "thanks"),
    ]

    def listed(gateway: GatewayServer, response_id: str, **params: Any) -> list[tuple[Any, ...]]:
        page = httpx.get(f"{gateway.url}/v1/responses/{response_id}/input_items", params=params)
        assert page.status_code == 200, page.text
        validate("ResponseItemList", page.json())
        return [_item(i) for i in page.json()["data"]]

    assert listed(gw, third.id, order="asc") == whole
    assert listed(gw, third.id) == whole[::-1]  # newest first by default
    assert listed(gw, second.id, order="asc") == whole[:3]
    assert listed(gw, first.id) == whole[:1]
    assert [i.id for i in client.responses.input_items.list(third.id, limit=2, after=whole[-2][0]).data] == [
        whole[2][0],
        whole[1][0],
    ]
    # Another replica reads the same from SQL.
    gw.flush()
    assert listed(make_gateway(database_url), third.id, order="asc") == whole


def test_a_chain_continues_on_another_replica_and_after_a_restart(
    make_gateway: MakeGateway, database_url: str
) -> None:
    first_gw = make_gateway(database_url)
    # The first replica's capture writer (a process of its own) may still be starting on a loaded machine: the
    # second replica waits for the stored response longer than the default.
    second_gw = make_gateway(database_url, responses_read_wait_s=15.0)
    first = sdk(first_gw).responses.with_raw_response.create(model="scripted-1", input="one")
    # At once on the other replica: the response may still be in the first one's capture queue.
    second = sdk(second_gw).responses.with_raw_response.create(
        model="scripted-1", input="two", previous_response_id=first.parse().id
    )
    first_gw.stop()
    second_gw.stop()
    third_gw = make_gateway(database_url)
    third = sdk(third_gw).responses.with_raw_response.create(
        model="scripted-1", input="three", previous_response_id=second.parse().id
    )
    assert third.parse().output_text == "echo: three"
    stored = calls(third_gw, database_url)
    assert [r["request"]["messages"] for r in stored][-1] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "echo: one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "echo: two"},
        {"role": "user", "content": "three"},
    ]
    assert [(r["episode_id"], r["position"]) for r in stored] == [
        (first.headers["x-episode-id"], k) for k in range(3)
    ]
    assert {r.headers["x-episode-id"] for r in (first, second, third)} == {first.headers["x-episode-id"]}


def test_a_response_deleted_on_another_replica_is_not_read_from_memory(
    make_gateway: MakeGateway, database_url: str
) -> None:
    """A replica that holds a response in memory checks SQL on a read once its copy is older than
    `KAIZEN_RESPONSES_RECHECK_S`: a delete on another replica is seen there within that interval."""
    first = make_gateway(database_url)
    second = make_gateway(database_url, responses_recheck_s=0.3)
    created = sdk(first).responses.create(model="scripted-1", input="one")
    first.flush()
    assert sdk(second).responses.retrieve(created.id).output_text == "echo: one"  # now in its memory
    sdk(first).responses.delete(created.id)
    wait_until(
        lambda: httpx.get(f"{second.url}/v1/responses/{created.id}").status_code == 404,
        "the other replica to see the delete",
    )
    listed = httpx.get(f"{second.url}/v1/responses/{created.id}/input_items")
    assert listed.status_code == 404 and listed.json()["error"]["code"] == "response_not_found"
    with refused_with("previous_response_not_found"):
        sdk(second).responses.create(model="scripted-1", input="two", previous_response_id=created.id)

    # A check that finds its call not written yet (still queued here) keeps the copy: it is not deleted.
    slow = make_gateway(database_url, responses_recheck_s=0.0, capture_flush_ms=3_000.0)
    queued = sdk(slow).responses.create(model="scripted-1", input="queued")
    assert sdk(slow).responses.retrieve(queued.id).output_text == "echo: queued"
    assert rows(database_url, "SELECT id FROM calls WHERE id = :id", id=queued.id[5:]) == []
    slow.flush()
    assert len(rows(database_url, "SELECT id FROM responses WHERE id = :id", id=queued.id)) == 1
    assert sdk(slow).responses.retrieve(queued.id).output_text == "echo: queued"


def test_item_references_and_no_log(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url, responses_read_wait_s=0.3)
    client = sdk(gw)
    first = client.responses.create(model="scripted-1", input="#tool", tools=[WEATHER])
    [call] = first.output
    # The AI SDK sends stored items back by reference.
    client.responses.create(
        model="scripted-1",
        input=[
            {"role": "user", "content": "#tool"},
            {"type": "item_reference", "id": call.id},
            {"type": "function_call_output", "call_id": call.call_id, "output": "fog"},
        ],
        tools=[WEATHER],
    )
    assert upstream.requests[-1].body["messages"][1]["tool_calls"][0]["id"] == call.call_id
    assert upstream.requests[-1].body["messages"][2] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "fog",
    }
    missing = f"fc_{'0' * 32}_0"
    with refused_with("item_not_found"):
        client.responses.create(model="scripted-1", input=[{"type": "item_reference", "id": missing}])
    # An input item, by the id `input_items` lists for it (one the gateway made: the client sent none).
    [listed] = client.responses.input_items.list(first.id).data
    assert listed.id.startswith("in_")
    again = client.responses.create(model="scripted-1", input=[{"type": "item_reference", "id": listed.id}])
    sent = upstream.requests[-1].body["messages"]
    assert sent == [{"role": "user", "content": [{"type": "text", "text": "#tool"}]}]
    assert again.status == "completed"

    # X-Kaizen-No-Log: served, stored nowhere but this replica's memory, so the chain still works here.
    quiet = sdk(gw, **{"X-Kaizen-No-Log": "true"})
    hidden = quiet.responses.create(model="scripted-1", input="secret")
    assert quiet.responses.retrieve(hidden.id).output_text == "echo: secret"
    follow = quiet.responses.create(model="scripted-1", input="more", previous_response_id=hidden.id)
    assert follow.output_text == "echo: more"
    gw.flush()
    assert len(rows(database_url, "SELECT id FROM responses")) == 3  # the logged creates' responses only
    assert len(calls(gw, database_url)) == 3


def test_another_projects_responses_are_not_found(make_gateway: MakeGateway, database_url: str) -> None:
    settings = {
        "api_keys": ["sk-env"],
        "admin_key": "adm",
        "responses_read_wait_s": 0.2,
        "policy_refresh_s": 0.2,
    }
    gw = make_gateway(database_url, **settings)
    created = httpx.post(
        gw.url + "/admin/keys",
        json={"name": "shop-bot", "scopes": ["chat", "feedback", "read"], "project": "shop"},
        headers={"authorization": "Bearer adm"},
    )
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    mine = sdk(gw, secret).responses.create(model="scripted-1", input="#tool", tools=[WEATHER])
    gw.flush()
    replica = make_gateway(database_url, **settings)  # reads SQL: it holds nothing in memory
    for server in (gw, replica):
        other = sdk(server, "sk-env")
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(mine.id)
        with refused_with("previous_response_not_found"):
            other.responses.create(model="scripted-1", input="x", previous_response_id=mine.id)
        with refused_with("item_not_found"):
            other.responses.create(
                model="scripted-1", input=[{"type": "item_reference", "id": mine.output[0].id}]
            )
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
        feedback = httpx.post(
            server.url + "/v1/feedback",
            json={"request_id": mine.id, "value": 1},
            headers={"authorization": "Bearer sk-env"},
        )
        assert feedback.status_code == 404, feedback.text
        assert sdk(server, secret).responses.retrieve(mine.id).id == mine.id
        assert sdk(server, "adm").responses.retrieve(mine.id).id == mine.id  # admin keys see every project


def test_stored_responses_are_redacted_like_their_calls(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, policy_refresh_s=0.1)
    add_policy(database_url, "scripted-1", {"privacy": {"mode": "mask"}})
    wait_until(lambda: gw.services.router.redactor("scripted-1") is not None, "the policy's redactor")
    client = sdk(gw)
    created = client.responses.create(model="scripted-1", input="mail jane.roe@example.org")
    assert created.output_text == "echo: mail jane.roe@example.org"  # the app gets the answer as it was
    assert "[EMAIL]" in client.responses.retrieve(created.id).output_text
    gw.flush()
    [stored] = rows(database_url, "SELECT * FROM responses")
    text = json.dumps([stored["body"], stored["input_items"]])
    assert "jane.roe" not in text and text.count("[EMAIL]") == 2
    follow = client.responses.create(model="scripted-1", input="and?", previous_response_id=created.id)
    assert follow.output_text == "echo: and?"


def test_retention_removes_a_stored_response_with_its_call(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url)
    old = sdk(gw).responses.create(model="scripted-1", input="old")
    new = sdk(gw).responses.create(model="scripted-1", input="new")
    gw.flush()

    async def prune() -> tuple[int, int]:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                long_ago = datetime.now(UTC) - timedelta(days=40)
                call_id = old.id.removeprefix("resp_")
                await session.execute(update(Call).where(Call.id == call_id).values(created_at=long_ago))
                pruned = await prune_calls(session, None, datetime.now(UTC) - timedelta(days=30))
                await session.commit()
                return pruned
        finally:
            await database.dispose()

    assert asyncio.run(prune())[0] == 1
    assert [r["id"] for r in rows(database_url, "SELECT id FROM responses")] == [new.id]


BAD_BODIES: list[tuple[str, dict[str, Any], str | None]] = [
    ("a chat-completions field", {"model": "scripted-1", "input": "x", "messages": []}, "messages"),
    ("no input", {"model": "scripted-1"}, "input"),
    ("empty input", {"model": "scripted-1", "input": []}, "input"),
    ("input of the wrong type", {"model": "scripted-1", "input": 5}, "input"),
    (
        "unknown item type",
        {"model": "scripted-1", "input": [{"type": "web_search_call", "id": "x"}]},
        "input[0].type",
    ),
    ("message without content", {"model": "scripted-1", "input": [{"role": "user"}]}, "input[0].content"),
    (
        "bad content part",
        {"model": "scripted-1", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    (
        "image in a system message",
        {
            "model": "scripted-1",
            "input": [
                {"role": "system", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
            ],
        },
        "input[0].content[0]",
    ),
    (
        "image by file id",
        {
            "model": "scripted-1",
            "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
        },
        "input[0].content[0].image_url",
    ),
    (
        "hosted tool",
        {"model": "scripted-1", "input": "x", "tools": [{"type": "web_search"}]},
        "tools[0].type",
    ),
    (
        "bad tool name",
        {"model": "scripted-1", "input": "x", "tools": [{"type": "function", "name": "a b"}]},
        "tools[0].name",
    ),
    (
        "tool_choice of an unknown function",
        {
            "model": "scripted-1",
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "nope"},
        },
        "tool_choice.name",
    ),
    (
        "tool_choice required without tools",
        {"model": "scripted-1", "input": "x", "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "max_output_tokens below 16",
        {"model": "scripted-1", "input": "x", "max_output_tokens": 8},
        "max_output_tokens",
    ),
    ("temperature out of range", {"model": "scripted-1", "input": "x", "temperature": 3}, "temperature"),
    (
        "json_schema without schema",
        {"model": "scripted-1", "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
        "text.format.schema",
    ),
    (
        "json_schema schema not a JSON Schema",
        {
            "model": "scripted-1",
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "x"}}},
        },
        "text.format.schema",
    ),
    (
        "function parameters not a JSON Schema",
        {
            "model": "scripted-1",
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "required": [{}]}}],
        },
        "tools[0].parameters",
    ),
    ("unknown include", {"model": "scripted-1", "input": "x", "include": ["everything"]}, "include[0]"),
    ("background", {"model": "scripted-1", "input": "x", "background": True}, "background"),
    (
        "unknown previous response",
        {"model": "scripted-1", "input": "x", "previous_response_id": "resp_nope"},
        "previous_response_id",
    ),
    ("unknown model", {"model": "no-such-model", "input": "x"}, "model"),
    (
        "function output without call id",
        {"model": "scripted-1", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
    ),
]


def test_bad_input_is_an_openai_shaped_400_and_reaches_nothing(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url, responses_read_wait_s=0.0)
    before = len(upstream.requests)
    failures = []
    for case, body, param in BAD_BODIES:
        response = httpx.post(gw.url + "/v1/responses", json=body)
        error = response.json().get("error") or {}
        if not 400 <= response.status_code < 500 or error.get("param") != param:
            failures.append(f"{case}: {response.status_code} {response.text[:300]}")
        validate("ErrorResponse", response.json())
    assert failures == []
    assert len(upstream.requests) == before
    gw.flush()
    assert gw.services.sink.snapshot()["queued"] == 0
    assert rows(database_url, "SELECT id FROM calls") == rows(database_url, "SELECT id FROM responses") == []
