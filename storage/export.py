"""Export of episodes to Parquet or JSON lines, in Kaizen's own schema or OpenAI's fine-tuning chat format.

Streamed: episodes are read in batches (keyset pagination on `(created_at, id)`, a fresh session per batch),
and each batch becomes one Parquet row group or its JSON lines, so memory holds one batch whatever the size of
the table. The file is written under a temporary name and renamed when complete: an export that fails leaves
no partial file behind.

Kaizen's schema is one row per episode with its trajectory (`messages`, `tools`), every turn (`turns`: call
id, model, version, status, usage), every reward with its source (`rewards`), the derived `reward` with its
`reward_provenance`, and the episode's own fields. In Parquet the free-form JSON fields are JSON text columns
(their shape varies per row); in JSON lines they are nested values. OpenAI's format is `{"messages": [...],
"tools": [...]}` per line, as its fine-tuning API and Hugging Face chat datasets take it; in Parquet the
messages are typed structs (text content, tool calls) and `tools` is JSON text, since JSON schemas have no
fixed shape. Episodes whose trajectory does not end with an assistant reply are left out of OpenAI's format
(there is nothing to learn from) and counted.

polars and pyarrow are imported here and nowhere on the serving side: the CLI imports this module lazily.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import msgspec
import polars as pl
import pyarrow.parquet as pq
from sqlalchemy import ColumnElement, and_, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.database import Database
from storage.episodes import EpisodeTranscript, get_transcripts
from storage.models import Call, Episode
from storage.policies import episodes_of
from storage.rewards import RewardInfo, rewards_for_episodes

Format = Literal["parquet", "jsonl"]
Schema = Literal["kaizen", "openai"]

_JSON = msgspec.json.Encoder()

KAIZEN_COLUMNS: dict[str, pl.DataType] = {
    "episode_id": pl.String(),
    "policy": pl.String(),
    "project": pl.String(),
    "source": pl.String(),
    "group_key": pl.String(),
    "created_at": pl.Datetime("us", "UTC"),
    "updated_at": pl.Datetime("us", "UTC"),
    "calls": pl.Int32(),
    "adapter_versions": pl.List(pl.Int64()),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "reward": pl.Float64(),
    "reward_provenance": pl.String(),
    "rewards": pl.String(),
    "messages": pl.String(),
    "tools": pl.String(),
    "turns": pl.String(),
    "metadata": pl.String(),
    "tags": pl.String(),
}
#: Columns of Kaizen's schema that hold free-form JSON: text in Parquet, nested values in JSON lines.
KAIZEN_JSON_COLUMNS = ("reward_provenance", "rewards", "messages", "tools", "turns", "metadata", "tags")

_TOOL_CALL = pl.Struct(
    {
        "id": pl.String(),
        "type": pl.String(),
        "function": pl.Struct({"name": pl.String(), "arguments": pl.String()}),
    }
)
OPENAI_COLUMNS: dict[str, pl.DataType] = {
    "messages": pl.List(
        pl.Struct(
            {
                "role": pl.String(),
                "content": pl.String(),
                "name": pl.String(),
                "tool_calls": pl.List(_TOOL_CALL),
                "tool_call_id": pl.String(),
            }
        )
    ),
    "tools": pl.String(),
}
# What a message of OpenAI's fine-tuning format may hold.
_OPENAI_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass(frozen=True)
class ExportFilter:
    """Which episodes to export; every given condition must hold."""

    policy: str | None = None
    project: str | None = None
    versions: tuple[int, ...] = ()  # episodes with a turn served by one of these adapter versions
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    min_reward: float | None = None  # derived reward at least (unrewarded episodes are left out)
    max_reward: float | None = None
    sources: tuple[str, ...] = ()  # `traffic`, `import`, ...

    def conditions(self) -> list[ColumnElement[bool]]:
        found: list[ColumnElement[bool]] = []
        if self.policy is not None:
            found.append(episodes_of(self.policy))
        if self.project is not None:
            found.append(Episode.project == self.project)
        if self.sources:
            found.append(Episode.source.in_(self.sources))
        # Timestamps are stored in UTC; SQLite compares them as text, so the bounds are given in UTC too.
        if self.since is not None:
            found.append(Episode.created_at >= self.since.astimezone(UTC))
        if self.until is not None:
            found.append(Episode.created_at < self.until.astimezone(UTC))
        if self.min_reward is not None:
            found.append(Episode.reward >= self.min_reward)
        if self.max_reward is not None:
            found.append(Episode.reward <= self.max_reward)
        if self.versions:
            found.append(
                exists().where(Call.episode_id == Episode.id, Call.adapter_version.in_(self.versions))
            )
        return found


@dataclass
class ExportReport:
    path: str
    format: str
    schema: str
    episodes: int = 0  # rows written
    skipped: int = 0  # episodes the format cannot express (OpenAI's: no final assistant reply)
    bytes: int = 0


@dataclass(frozen=True)
class EpisodeData:
    """One exported episode: its trajectory and every reward of it."""

    trajectory: EpisodeTranscript
    rewards: list[RewardInfo] = field(default_factory=list)


async def count_episodes(session: AsyncSession, selection: ExportFilter) -> int:
    return int(
        await session.scalar(select(func.count()).select_from(Episode).where(*selection.conditions())) or 0
    )


async def episode_batches(
    database: Database, selection: ExportFilter, batch_size: int
) -> AsyncIterator[list[EpisodeData]]:
    """The selected episodes, oldest first, `batch_size` at a time; each batch is read in its own session."""
    after: tuple[datetime, str] | None = None
    while True:
        async with database.session() as session:
            query = select(Episode.id, Episode.created_at).where(*selection.conditions())
            if after is not None:
                created, ident = after
                query = query.where(
                    or_(Episode.created_at > created, and_(Episode.created_at == created, Episode.id > ident))
                )
            page = (
                await session.execute(query.order_by(Episode.created_at, Episode.id).limit(batch_size))
            ).all()
            if not page:
                return
            ids = [row.id for row in page]
            trajectories = await get_transcripts(session, ids)
            rewards = await rewards_for_episodes(session, ids)
        after = (page[-1].created_at, page[-1].id)
        yield [EpisodeData(trajectories[i], rewards.get(i, [])) for i in ids if i in trajectories]


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; Kaizen writes them in UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _total(usages: list[dict[str, Any]], key: str) -> int | None:
    """The turns' token counts added up; None when no turn counted them (an imported conversation)."""
    counted = [int(u[key]) for u in usages if u.get(key) is not None]
    return sum(counted) if counted else None


def kaizen_row(data: EpisodeData) -> dict[str, Any]:
    """An episode in Kaizen's schema, JSON fields as Python values."""
    t = data.trajectory
    usage = [turn.usage or {} for turn in t.turns]
    return {
        "episode_id": t.episode_id,
        "policy": t.policy,
        "project": t.project,
        "source": t.source,
        "group_key": t.group_key,
        "created_at": _utc(t.created_at),
        "updated_at": _utc(t.updated_at),
        "calls": len(t.turns),
        "adapter_versions": sorted(
            {turn.adapter_version for turn in t.turns if turn.adapter_version is not None}
        ),
        "prompt_tokens": _total(usage, "prompt_tokens"),
        "completion_tokens": _total(usage, "completion_tokens"),
        "reward": t.reward,
        "reward_provenance": t.reward_provenance,
        "rewards": [
            {
                "id": r.id,
                "request_id": r.call_id,
                "source": r.source,
                "name": r.name,
                "value": r.value,
                "label": r.label,
                "comment": r.comment,
                "metadata": r.metadata,
                "status": r.status,
                "created_at": _utc(r.created_at),
            }
            for r in data.rewards
        ],
        "messages": t.messages,
        "tools": t.tools,
        "turns": [
            {
                "request_id": turn.call_id,
                "position": turn.position,
                "model": turn.model,
                "adapter_version": turn.adapter_version,
                "status": turn.status,
                "finish_reason": turn.finish_reason,
                "usage": turn.usage,
                "created_at": _utc(turn.created_at),
            }
            for turn in t.turns
        ],
        "metadata": t.metadata,
        "tags": t.tags,
    }


def openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message with only what OpenAI's fine-tuning format holds (no nulls, no extensions)."""
    out = {key: message[key] for key in _OPENAI_MESSAGE_KEYS if message.get(key) is not None}
    if "tool_calls" in out:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {
                    "name": (call.get("function") or {}).get("name"),
                    "arguments": (call.get("function") or {}).get("arguments"),
                },
            }
            for call in out["tool_calls"]
        ]
    return out


def openai_row(data: EpisodeData) -> dict[str, Any] | None:
    """An episode in OpenAI's fine-tuning chat format, or None when it does not end with an assistant reply."""
    messages = [openai_message(m) for m in data.trajectory.messages]
    if not messages or messages[-1].get("role") != "assistant":
        return None
    row: dict[str, Any] = {"messages": messages}
    if data.trajectory.tools:
        row["tools"] = data.trajectory.tools
    return row


def _text(content: Any) -> str | None:
    """Message content as text, for Parquet's typed messages: text parts joined, other parts left out."""
    if content is None or isinstance(content, str):
        return content
    return "".join(
        part.get("text") or part.get("refusal") or ""
        for part in content
        if isinstance(part, dict) and part.get("type") in ("text", "refusal")
    )


def _json_text(value: Any) -> str | None:
    return None if value is None else _JSON.encode(value).decode()


def _parquet_row(row: dict[str, Any], schema: Schema) -> dict[str, Any]:
    if schema == "kaizen":
        return {k: _json_text(v) if k in KAIZEN_JSON_COLUMNS else v for k, v in row.items()}
    return {
        "messages": [{**m, "content": _text(m.get("content"))} for m in row["messages"]],
        "tools": _json_text(row.get("tools")),
    }


class _ParquetFile:
    """Row groups appended one batch at a time with a fixed schema."""

    def __init__(self, path: Path, schema: Schema) -> None:
        self.columns = KAIZEN_COLUMNS if schema == "kaizen" else OPENAI_COLUMNS
        self.schema = schema
        empty = pl.DataFrame(schema=self.columns).to_arrow()
        self.writer = pq.ParquetWriter(path, empty.schema, compression="zstd")

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        frame = pl.DataFrame([_parquet_row(r, self.schema) for r in rows], schema=self.columns, orient="row")
        self.writer.write_table(frame.to_arrow(), row_group_size=max(1, len(rows)))

    def close(self) -> None:
        self.writer.close()


class _JsonLinesFile:
    def __init__(self, path: Path) -> None:
        self.handle = path.open("wb")

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        self.handle.write(b"".join(_JSON.encode(r) + b"\n" for r in rows))

    def close(self) -> None:
        self.handle.close()


async def export_episodes(
    database: Database,
    path: Path,
    *,
    fmt: Format,
    schema: Schema,
    selection: ExportFilter,
    batch_size: int = 500,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the selected episodes to `path`; `progress` is told how many episodes each batch held."""
    report = ExportReport(str(path), fmt, schema)
    partial = path.with_name(f".{path.name}.partial")
    sink = _ParquetFile(partial, schema) if fmt == "parquet" else _JsonLinesFile(partial)
    try:
        async for batch in episode_batches(database, selection, batch_size):
            rows = [kaizen_row(d) if schema == "kaizen" else openai_row(d) for d in batch]
            kept = [r for r in rows if r is not None]
            report.skipped += len(rows) - len(kept)
            if kept:
                sink.write(kept)
                report.episodes += len(kept)
            if progress is not None:
                progress(len(batch))
        report.bytes = _complete(sink, partial, path)
    except BaseException:
        sink.close()
        partial.unlink(missing_ok=True)
        raise
    return report


def _complete(sink: _ParquetFile | _JsonLinesFile, partial: Path, path: Path) -> int:
    """Close the written file and give it its name; returns its size."""
    sink.close()
    os.replace(partial, path)
    return path.stat().st_size
