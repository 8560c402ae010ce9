"""Plain records that cross from the gateway into storage (through the capture log) without ORM objects."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from storage.models import DEFAULT_PROJECT, EPISODE_SOURCE_TRAFFIC


class ResponseRecord(msgspec.Struct, kw_only=True):
    """A `/v1/responses` object stored beside its call (`store`), so `GET /v1/responses/{id}` and
    `previous_response_id` find it on any replica and after a restart."""

    id: str  # `resp_<call id>`
    body: dict[str, Any]  # the Response object as the client got it (without logprobs)
    input_items: list[dict[str, Any]]  # this request's input, as item resources with ids
    previous_response_id: str | None = None


class CallRecord(msgspec.Struct, kw_only=True):
    """A completed call as the gateway saw it, ready to be written (or spooled) without touching the database.

    `episode_resolved` is true when the episode id is final (explicit, or found in the gateway's stitch cache);
    otherwise the writer looks `stitch_lookup` (prefix hashes, longest first) up in the database first.
    """

    id: str  # server-generated, unique: what writes are idempotent by
    client_request_id: str | None = (
        None  # the client's `x-request-id`; retries repeat it, so it is not unique
    )
    episode_id: str
    episode_resolved: bool
    stitch_lookup: list[str] = []
    stitch_keys: list[str] = []
    policy: str | None = None
    model: str
    adapter_version: int | None = None
    engine_model: str | None = None
    stream: bool = False
    request: dict[str, Any]
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int] | None] | None = None
    completion_logprobs: list[list[float] | None] | None = None
    usage: dict[str, Any] | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    status: str = "ok"
    error: dict[str, Any] | None = None
    context_hash: str | None = None
    group_key: str | None = None
    user: str | None = None
    episode_metadata: dict[str, Any] = {}
    key_id: str | None = None  # the API key that sent it
    project: str = DEFAULT_PROJECT  # its key's project: a new episode belongs to it
    source: str = EPISODE_SOURCE_TRAFFIC  # what sent it (`X-Kaizen-Source`): a new episode records it
    created_at: float
    stored_response: ResponseRecord | None = None  # written to `responses` in the call's transaction


# What the capture writer only passes through to JSON columns of `calls`.
_STORED_AS_JSON = (
    "request",
    "response",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "error",
)

#: A `CallRecord` as the capture writer decodes it from the log: the fields above stay their JSON bytes
#: (`msgspec.Raw`, `null` included), which `storage.calls` stores as the columns' text. Decoding token ids and
#: logprobs into Python lists only to encode them again was a third of the writer's work per row. The fields'
#: static types say dict and list; only `storage.calls` reads them, and it takes either form.
LoggedCall = cast(
    type[CallRecord],
    msgspec.defstruct(
        "LoggedCall",
        [(name, msgspec.Raw, None) for name in _STORED_AS_JSON],
        bases=(CallRecord,),
        kw_only=True,
    ),
)
