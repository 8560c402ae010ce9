"""Dashboard sessions ended by logging out before their cookie expired (`dashboard_logouts`).

The cookie itself stays valid until it expires, so ending a session means remembering it: every gateway reads
the list with its keys (`gateway.auth.KeyRing.refresh`) and refuses those sessions, which costs no database
read per page. A row is kept only until the cookie would have expired anyway.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dialect import insert
from storage.models import DashboardLogout


async def record_logout(session: AsyncSession, nonce: str, expires_at: datetime) -> None:
    """Record that the session with this nonce ended, and forget those whose cookies expired meanwhile."""
    await session.execute(delete(DashboardLogout).where(DashboardLogout.expires_at <= datetime.now(UTC)))
    await session.execute(
        insert(session, DashboardLogout)
        .values(nonce=nonce, expires_at=expires_at)
        .on_conflict_do_nothing(index_elements=["nonce"])
    )


async def logged_out(session: AsyncSession) -> set[str]:
    """The nonces of sessions ended before their cookie expired."""
    rows = await session.scalars(
        select(DashboardLogout.nonce).where(DashboardLogout.expires_at > datetime.now(UTC))
    )
    return set(rows)
