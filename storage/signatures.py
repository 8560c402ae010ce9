"""Signed feedback requests already applied (the replay guard), in the database so every replica shares it.

`record_signature` runs in the transaction that writes the request's rewards: a request refused or failed
(a 400, a 503 while the database is down) leaves nothing behind and may be delivered again.
"""

from __future__ import annotations

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dialect import insert
from storage.models import SignatureReplay


async def record_signature(session: AsyncSession, mac: str, timestamp: int) -> bool:
    """Remember a signature; False when it is already remembered (committed by this or another replica).

    On PostgreSQL a concurrent insert of the same MAC waits for the other transaction and then conflicts.
    """
    stmt = (
        insert(session, SignatureReplay)
        .values(mac=mac, timestamp=timestamp)
        .on_conflict_do_nothing(index_elements=["mac"])
        .returning(SignatureReplay.mac)
    )
    return (await session.execute(stmt)).scalar_one_or_none() is not None


async def forget_signatures(session: AsyncSession, before: int) -> int:
    """Drop signatures timestamped before `before` (unix seconds): verification refuses them anyway."""
    result = await session.execute(delete(SignatureReplay).where(SignatureReplay.timestamp < before))
    return int(result.rowcount)  # type: ignore[attr-defined]
