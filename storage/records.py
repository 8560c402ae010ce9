"""Plain records that cross from the gateway into storage (and through the spool file) without ORM objects."""

from __future__ import annotations

from typing import Any

import msgspec

from storage.models import DEFAULT_PROJECT, EPISODE_SOURCE_TRAFFIC


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
