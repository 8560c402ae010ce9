"""Repository functions for stored `/v1/responses` objects (table `responses`).

Rows are written by the capture writer together with their call (`storage.calls.write_calls`); here they are
read, with the call's conversation, episode and project, and deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, select
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import Call, Episode, StoredResponse

_BY_ID = (
    select(
        StoredResponse.body,
        StoredResponse.input_items,
        Call.episode_id,
        Episode.project,
        Call.request,
        Call.response,
    )
    .join(Call, Call.id == StoredResponse.call_id)
    .join(Episode, Episode.id == Call.episode_id)
    .where(StoredResponse.id == bindparam("id"))
)


@dataclass(frozen=True)
class StoredResponseInfo:
    """A stored response with what continuing it needs from its call."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    episode_id: str
    project: str
    messages: list[dict[str, Any]]  # the chat messages the call sent the engine
    reply: dict[str, Any] | None  # the assistant message it got back


async def get_response(session: AsyncSession, response_id: str) -> StoredResponseInfo | None:
    """The stored response with this id, or None when it is not stored (yet, or any more)."""
    row = (await session.execute(_BY_ID, {"id": response_id})).first()
    if row is None:
        return None
    body, input_items, episode_id, project, request, response = row
    choices = (response or {}).get("choices") or []
    reply = choices[0].get("message") if choices else None
    return StoredResponseInfo(body, input_items, episode_id, project, request.get("messages") or [], reply)


_STORED = (
    select(StoredResponse.id)
    .select_from(Call)
    .outerjoin(StoredResponse, StoredResponse.call_id == Call.id)
    .where(Call.id == bindparam("call_id"))
)


async def response_stored(session: AsyncSession, call_id: str) -> bool | None:
    """Whether the response of this call is stored: None when the call itself is not in SQL (not written yet,
    or removed by retention), False when the call is but its response is not (deleted)."""
    row = (await session.execute(_STORED, {"call_id": call_id})).first()
    return None if row is None else row[0] is not None


async def delete_response(session: AsyncSession, response_id: str) -> bool:
    """Delete a stored response (its call stays captured); False when none was stored. The caller commits."""
    result = await session.execute(delete(StoredResponse).where(StoredResponse.id == response_id))
    return isinstance(result, CursorResult) and result.rowcount > 0
