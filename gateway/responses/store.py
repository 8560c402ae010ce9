"""Stored responses: the recent ones in memory, every one in SQL.

A stored response is written by the capture writer together with its call, so it is durable (in the capture
log) before its answer goes out, and reaches SQL a few milliseconds later. This replica keeps the responses it
created (and those it read) in a bounded in-memory map: it continues a `previous_response_id` chain and answers
`GET` without the database, at once after the create returned. A response another replica created a moment ago
may still be in that replica's capture queue, so a read that finds nothing in SQL retries for a short while
(`KAIZEN_RESPONSES_READ_WAIT_S`) before answering 404. Another replica may delete a response this one holds: a
`GET` of a copy older than `KAIZEN_RESPONSES_RECHECK_S` checks SQL first (creates do not: they never wait on the
database for a response this replica holds).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.auth import Principal
from gateway.errors import APIError
from storage.database import Database
from storage.responses import StoredResponseInfo, delete_response, get_response, response_stored

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_FIRST_RETRY_S = 0.01
_LONGEST_RETRY_S = 0.2


@dataclass(frozen=True)
class KnownResponse:
    """A stored response with what continuing it needs."""

    body: dict[str, Any]  # the Response object
    input_items: list[dict[str, Any]]  # those of the whole chain, oldest first
    conversation: list[dict[str, Any]]  # its call's chat messages (instructions left out) and the reply
    episode_id: str
    episode_resolved: (
        bool  # false: stitching may still move its call to another episode (see gateway.episodes)
    )
    project: str
    durable: bool  # false: served with `X-Kaizen-No-Log`, kept in this replica's memory only
    written: bool = False  # seen in SQL (read from it, or found there by a recheck)
    checked_at: float = field(default_factory=time.monotonic)  # when it was last known to be stored

    def chain_items(self) -> list[dict[str, Any]]:
        """What a response continuing this one was generated from before its own input: this one's input
        items (its chain's included) and its output items."""
        return [*self.input_items, *self.body.get("output", ())]

    def item(self, item_id: str) -> dict[str, Any] | None:
        """One of its output or input items, by id."""
        for item in (*self.body.get("output", ()), *self.input_items):
            if item.get("id") == item_id:
                return dict(item)
        return None


def _known(stored: StoredResponseInfo) -> KnownResponse:
    messages = stored.messages[1:] if stored.body.get("instructions") is not None else stored.messages
    conversation = [*messages, stored.reply] if stored.reply is not None else list(messages)
    return KnownResponse(
        stored.body,
        stored.input_items,
        conversation,
        stored.episode_id,
        True,
        stored.project,
        durable=True,
        written=True,
    )


class ResponseNotWritten(APIError):
    status_code = 409


class RecentResponses:
    """Bounded LRU of response id to response, and the ids this replica deleted."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, KnownResponse] = OrderedDict()
        self._deleted: OrderedDict[str, None] = OrderedDict()

    def get(self, response_id: str) -> KnownResponse | None:
        found = self._items.get(response_id)
        if found is not None:
            self._items.move_to_end(response_id)
        return found

    def put(self, response_id: str, response: KnownResponse) -> None:
        if self.size == 0:
            return
        self._items[response_id] = response
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._items.pop(response_id, None)
        self._deleted[response_id] = None
        while len(self._deleted) > max(self.size, 1):
            self._deleted.popitem(last=False)

    def deleted(self, response_id: str) -> bool:
        return response_id in self._deleted


class ResponseStore:
    def __init__(self, database: Database, *, cache_size: int, read_wait_s: float, recheck_s: float) -> None:
        self.database = database
        self.recent = RecentResponses(cache_size)
        self.read_wait_s = read_wait_s
        self.recheck_s = recheck_s

    def remember(self, response_id: str, response: KnownResponse) -> None:
        self.recent.put(response_id, response)

    async def find(self, response_id: str, principal: Principal) -> KnownResponse | None:
        """The response if it is stored and the key's project sees it; None otherwise (another project's
        response is answered as if it did not exist)."""
        if not RESPONSE_ID.match(response_id) or self.recent.deleted(response_id):
            return None
        known = self.recent.get(response_id)
        if known is not None:
            if not principal.sees(known.project):
                return None
            if known.episode_resolved or not known.durable:
                return known
            # Its call was stitched by the capture writer: the episode it ended in is the one to continue.
            stored = await self._read(response_id)
            return _known(stored) if stored is not None else known
        stored = await self._read(response_id, wait=True)
        if stored is None or not principal.sees(stored.project):
            return None
        known = _known(stored)
        self.recent.put(response_id, known)
        return known

    async def read(self, response_id: str, principal: Principal) -> KnownResponse | None:
        """`find` for `GET`: a copy held here longer than `recheck_s` is checked in SQL first, so a response
        deleted on another replica is not answered from this one's memory after that interval."""
        known = self.recent.get(response_id)
        if known is not None and known.durable and time.monotonic() - known.checked_at >= self.recheck_s:
            call_id = response_id.removeprefix("resp_")
            async with self.database.session() as session:
                stored = await response_stored(session, call_id)
            if stored or (stored is None and not known.written):
                # Stored, or its call is not written yet (still in this replica's capture queue).
                self.recent.put(
                    response_id, replace(known, written=bool(stored), checked_at=time.monotonic())
                )
            else:  # deleted (or removed with its call by retention)
                self.recent.forget(response_id)
        return await self.find(response_id, principal)

    async def _read(self, response_id: str, *, wait: bool = False) -> StoredResponseInfo | None:
        deadline = time.monotonic() + (self.read_wait_s if wait else 0.0)
        delay = _FIRST_RETRY_S
        while True:
            async with self.database.session() as session:
                stored = await get_response(session, response_id)
            left = deadline - time.monotonic()
            if stored is not None or left <= 0:
                return stored
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _LONGEST_RETRY_S)

    async def delete(self, response_id: str, principal: Principal) -> bool:
        """Delete a stored response (its captured call stays); False when the key sees no such response.

        One created here a moment ago may not be written yet: the delete waits for it, so that the writer does
        not store it afterwards."""
        if not RESPONSE_ID.match(response_id) or self.recent.deleted(response_id):
            return False
        known = self.recent.get(response_id)
        if known is not None and not principal.sees(known.project):
            return False
        if known is not None and not known.durable:
            self.recent.forget(response_id)
            return True
        deadline = time.monotonic() + self.read_wait_s
        delay = _FIRST_RETRY_S
        while True:
            async with self.database.session() as session:
                stored = await get_response(session, response_id)
                if stored is not None:
                    if not principal.sees(stored.project):
                        return False
                    await delete_response(session, response_id)
                    await session.commit()
                    self.recent.forget(response_id)
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _LONGEST_RETRY_S)
        if known is not None:  # created here, still in the capture queue (the database may be down)
            raise ResponseNotWritten(
                f"response {response_id!r} is not stored yet; retry the delete shortly",
                code="response_not_written",
                retry_after=1.0,
            )
        return False
