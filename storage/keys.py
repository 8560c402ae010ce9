"""Repository functions for managed API keys. Secrets are never stored: a key is found by its SHA-256."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import ApiKey


@dataclass(frozen=True)
class KeyInfo:
    id: str
    name: str
    prefix: str
    hash: str
    scopes: list[str]
    project: str
    models: list[str] | None
    created_at: datetime
    revoked_at: datetime | None


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        row.id,
        row.name,
        row.prefix,
        row.hash,
        [str(s) for s in row.scopes],
        row.project,
        None if row.models is None else [str(m) for m in row.models],
        row.created_at,
        row.revoked_at,
    )


async def insert_key(session: AsyncSession, key: KeyInfo) -> None:
    session.add(
        ApiKey(
            id=key.id,
            name=key.name,
            prefix=key.prefix,
            hash=key.hash,
            scopes=list(key.scopes),
            project=key.project,
            models=None if key.models is None else list(key.models),
            created_at=key.created_at,
        )
    )
    await session.flush()


async def list_keys(session: AsyncSession, *, include_revoked: bool = True) -> list[KeyInfo]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [_info(row) for row in (await session.execute(query)).scalars()]


async def revoke_key(session: AsyncSession, key_id: str) -> KeyInfo | None:
    """Mark a key revoked (revoking twice keeps the first time); None when no key has that id."""
    await session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=datetime.now(UTC))
    )
    row = (await session.execute(select(ApiKey).where(ApiKey.id == key_id))).scalar_one_or_none()
    return None if row is None else _info(row)
