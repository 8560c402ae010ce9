"""`map_status`: what a client gets for an engine's error answer."""

from __future__ import annotations

import json

import pytest

from gateway.engines.http import map_status


def vllm_error(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's error body: its type is the status phrase and its code the integer status."""
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}}
    ).encode()


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_an_engine_4xx_keeps_its_status_and_its_param(status: int) -> None:
    # The SDKs pick their exception by status (404 NotFoundError, 422 UnprocessableEntityError), and
    # `param` names the field (vLLM's context-length refusals name `max_tokens` or `input_tokens`).
    error = map_status(status, vllm_error(status, "too long for this model", "max_tokens"))
    assert (error.status_code, error.param, error.error_type) == (
        status,
        "max_tokens",
        "invalid_request_error",
    )
    assert error.code == f"engine_{status}" and "too long for this model" in error.message


def test_an_engine_code_of_its_own_is_kept() -> None:
    body = json.dumps(
        {"error": {"message": "too long", "param": "messages", "code": "context_length_exceeded"}}
    )
    error = map_status(400, body.encode())
    assert (error.code, error.param) == ("context_length_exceeded", "messages")


@pytest.mark.parametrize("status", [401, 403])
def test_an_engine_that_refuses_the_gateways_own_credentials_is_a_502(status: int) -> None:
    # The upstream key is the gateway's (KAIZEN_UPSTREAM_API_KEY), not the client's: relayed as a 401, the
    # client would take its own key for the wrong one.
    error = map_status(status, vllm_error(status, "invalid api key"))
    assert (error.status_code, error.code, error.error_type) == (502, "engine_auth_failed", "api_error")
