"""Tool calls made through the gateway's MCP endpoint: written with their episode's id, read with the episode."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dialect import utc
from storage.models import ToolCall


@dataclass(frozen=True)
class ToolCallInfo:
    id: str
    episode_id: str | None
    policy: str
    tool: str
    source: str
    arguments: Any
    result: str
    is_error: bool
    latency_ms: float
    project: str
    created_at: datetime


async def record_tool_call(session: AsyncSession, **values: Any) -> None:
    """Add one call (the caller commits)."""
    session.add(ToolCall(**values))


async def episode_tool_calls(session: AsyncSession, episode_id: str) -> list[ToolCallInfo]:
    """An episode's tool calls, oldest first."""
    rows = await session.scalars(
        select(ToolCall).where(ToolCall.episode_id == episode_id).order_by(ToolCall.created_at, ToolCall.id)
    )
    return [
        ToolCallInfo(
            row.id,
            row.episode_id,
            row.policy,
            row.tool,
            row.source,
            row.arguments,
            row.result,
            row.is_error,
            row.latency_ms,
            row.project,
            utc(row.created_at),
        )
        for row in rows
    ]
