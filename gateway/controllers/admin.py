"""Admin routes (a key with the `admin` scope): capture counters, managed keys, the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import KeyRing, create_key, principal_of, requires
from gateway.capture.sink import CaptureSink
from gateway.controllers.params import PageLimit, PathName
from gateway.engines.base import Engine
from gateway.errors import NotFound
from storage.audit import AuditInfo, list_audit, record_audit
from storage.database import Database
from storage.keys import KeyInfo, list_keys, revoke_key
from storage.models import DEFAULT_PROJECT

Text = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class CaptureAdminController(Controller):
    path = "/admin/capture"
    guards = [requires("admin")]  # noqa: RUF012

    @get("")
    async def capture_stats(self, sink: NamedDependency[CaptureSink]) -> dict[str, Any]:
        """Counters of the capture path: queued, written, spooled, replayed, dropped, opted out."""
        return sink.snapshot()


class EngineAdminController(Controller):
    path = "/admin/engine"
    guards = [requires("admin")]  # noqa: RUF012

    @get("")
    async def engine_state(self, engine: NamedDependency[Engine]) -> dict[str, Any]:
        """The engine and its replicas: which take calls, their calls in flight, restarts and adapters."""
        return engine.snapshot()


class CreateKey(msgspec.Struct, forbid_unknown_fields=True):
    name: Text
    scopes: list[str]
    project: Text = DEFAULT_PROJECT
    models: list[Text] | None = None


class KeyView(msgspec.Struct):
    """A key as lists show it: never its secret, only the first characters."""

    id: str
    name: str
    prefix: str
    scopes: list[str]
    project: str
    models: list[str] | None
    created_at: datetime
    revoked_at: datetime | None


class CreatedKey(KeyView):
    secret: str  # shown once, at creation


def key_view(key: KeyInfo) -> KeyView:
    return KeyView(
        key.id, key.name, key.prefix, key.scopes, key.project, key.models, key.created_at, key.revoked_at
    )


class KeysController(Controller):
    path = "/admin/keys"
    guards = [requires("admin")]  # noqa: RUF012

    @post("", status_code=201)
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[CreateKey],
        session: NamedDependency[AsyncSession],
        database: NamedDependency[Database],
        keys: NamedDependency[KeyRing],
    ) -> CreatedKey:
        """Create a key; the answer holds its secret, which is not stored and cannot be shown again."""
        key, secret = await create_key(session, data.name, data.scopes, data.project, data.models)
        await record_audit(
            session,
            principal_of(request).actor,
            "key.create",
            key.id,
            {"name": key.name, "scopes": key.scopes, "project": key.project, "models": key.models},
        )
        await session.commit()  # usable on this gateway at once; on the others within the refresh interval
        await keys.refresh(database)
        view = key_view(key)
        return CreatedKey(**msgspec.structs.asdict(view), secret=secret)

    @get("")
    async def list_all(self, session: NamedDependency[AsyncSession]) -> list[KeyView]:
        """Every key, revoked ones included."""
        return [key_view(k) for k in await list_keys(session)]

    @delete("/{key_id:str}", status_code=200)
    async def revoke(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        database: NamedDependency[Database],
        keys: NamedDependency[KeyRing],
    ) -> KeyView:
        """Revoke a key: refused by this gateway at once, by every replica within `KAIZEN_POLICY_REFRESH_S`."""
        return await _revoke(request, key_id, session, database, keys)

    @post("/{key_id:str}/revoke", status_code=200)
    async def revoke_post(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        database: NamedDependency[Database],
        keys: NamedDependency[KeyRing],
    ) -> KeyView:
        """The same as `DELETE /admin/keys/{id}`, for clients that cannot send DELETE."""
        return await _revoke(request, key_id, session, database, keys)


async def _revoke(
    request: Request[Any, Any, Any], key_id: str, session: AsyncSession, database: Database, keys: KeyRing
) -> KeyView:
    key = await revoke_key(session, key_id)
    if key is None:
        raise NotFound(f"no key {key_id!r}", param="key_id", code="key_not_found")
    await record_audit(session, principal_of(request).actor, "key.revoke", key.id, {"name": key.name})
    await session.commit()  # before this gateway re-reads its keys, in a session of its own
    await keys.refresh(database)
    return key_view(key)


class AuditController(Controller):
    path = "/admin/audit"
    guards = [requires("admin")]  # noqa: RUF012

    @get("")
    async def list_all(
        self,
        session: NamedDependency[AsyncSession],
        action: FromQuery[str | None] = None,
        target: FromQuery[str | None] = None,
        limit: FromQuery[PageLimit] = 100,
    ) -> list[AuditInfo]:
        """Administrative changes, newest first: promotions, rollbacks, pauses, key changes, manual runs."""
        return await list_audit(session, action=action, target=target, limit=limit)
