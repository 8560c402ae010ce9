"""The audit log: administrative changes, written in the transaction of the change they describe."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import AuditEntry


@dataclass(frozen=True)
class AuditInfo:
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    details: dict[str, Any]


async def record_audit(
    session: AsyncSession, actor: str, action: str, target: str, details: dict[str, Any] | None = None
) -> None:
    """Add an entry to the session's transaction: it commits (or rolls back) with the change itself."""
    session.add(
        AuditEntry(at=datetime.now(UTC), actor=actor, action=action, target=target, details=details or {})
    )
    await session.flush()


async def list_audit(
    session: AsyncSession, *, action: str | None = None, target: str | None = None, limit: int = 100
) -> list[AuditInfo]:
    """Entries, newest first."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    if target is not None:
        query = query.where(AuditEntry.target == target)
    rows = (await session.execute(query)).scalars()
    return [AuditInfo(r.id, r.at, r.actor, r.action, r.target, dict(r.details or {})) for r in rows]
