"""`/v1/responses` on the real vLLM engine (CPU build) with the embedded model: served through vLLM's chat
completions, captured with the sampled token ids and behaviour logprobs of chat traffic, conformant to the spec."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import VLLMServer
from tests.integration.test_vllm_engine import client, stored
from tests.support.openai_schema import validate

pytestmark = pytest.mark.vllm

COLOUR = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def stored_call(server: VLLMServer, call_id: str) -> dict[str, Any]:
    row = stored(server, call_id)
    row["request"] = json.loads(row["request"]) if isinstance(row["request"], str) else row["request"]
    return row


def assert_trainable(row: dict[str, Any]) -> None:
    """Captured as chat traffic is: the exact sampled tokens with one behaviour logprob each."""
    [tokens] = row["completion_token_ids"]
    [logprobs] = row["completion_logprobs"]
    assert tokens and len(tokens) == len(logprobs) and all(lp <= 0 for lp in logprobs)
    assert row["prompt_token_ids"]


def test_responses_on_vllm_are_captured_like_chat(vllm_server: VLLMServer) -> None:
    sdk = client(vllm_server)
    raw = sdk.responses.with_raw_response.create(
        model=vllm_server.model,
        instructions="You answer in one short sentence.",
        input="Name a colour of the rainbow.",
        max_output_tokens=24,
        temperature=0,
        prompt_cache_key="rainbow",  # sent by agent frameworks; vLLM takes it as it takes unknown fields
    )
    body = raw.http_response.json()
    validate("Response", body)
    first = raw.parse()
    assert first.output_text and first.status in ("completed", "incomplete")
    assert first.usage is not None and first.usage.output_tokens == len(
        stored_call(vllm_server, raw.headers["x-request-id"])["completion_token_ids"][0]
    )
    row = stored_call(vllm_server, raw.headers["x-request-id"])
    assert row["request"]["messages"] == [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a colour of the rainbow."},
    ]
    assert row["response"]["choices"][0]["message"]["content"] == first.output_text
    assert_trainable(row)

    # Streamed continuation of the chain: the typed events, the same episode, token ids captured again.
    with httpx.stream(
        "POST",
        vllm_server.gateway.url + "/v1/responses",
        json={
            "model": vllm_server.model,
            "input": "And another one?",
            "previous_response_id": first.id,
            "max_output_tokens": 24,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        call_id, episode_id = response.headers["x-request-id"], response.headers["x-episode-id"]
        blocks = response.read().decode().strip().split("\n\n")
    events = [json.loads(block.split("\n")[1][len("data: ") :]) for block in blocks]
    for event in events:
        validate("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert episode_id == raw.headers["x-episode-id"]
    row = stored_call(vllm_server, call_id)
    assert (row["episode_id"], row["position"]) == (episode_id, 1)
    assert row["request"]["messages"] == [  # the first response's instructions are not carried over
        {"role": "user", "content": "Name a colour of the rainbow."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"},
    ]
    assert row["response"]["choices"][0]["message"]["content"] == text
    assert_trainable(row)


def test_structured_output_on_vllm(vllm_server: VLLMServer) -> None:
    """`text.format` becomes chat's `response_format`, which vLLM's structured outputs enforce."""
    response = client(vllm_server).responses.create(
        model=vllm_server.model,
        input="Pick a colour.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": COLOUR, "strict": True}},
        max_output_tokens=32,
        temperature=0,
    )
    assert json.loads(response.output_text)["colour"] in ("red", "green", "blue")
