"""The dashboard's read queries: time series aggregated in SQL, keyset-paginated lists, one episode whole.

Every query is plain SQLAlchemy Core on the tables (no views, no dialect-specific JSON paths), bounded by a
time window or a page size, and served by the indexes of migration 0011, so pages stay fast with millions of
captured calls (`tests/bench/bench_dashboard.py` measures them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Text, and_, case, cast, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dialect import epoch_bucket
from storage.models import AuditEntry, Call, Episode, JudgeGroup, Policy, Reward, TrainingRun


def utc(value: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; every timestamp Kaizen writes is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _at(epoch: int | float) -> datetime:
    return datetime.fromtimestamp(int(epoch), UTC)


# ----------------------------------------------------------------------------------------------- overview
@dataclass(frozen=True)
class TrafficBucket:
    """Calls that started in one time bucket."""

    start: datetime
    calls: int
    errors: int  # status other than `ok` (errors and client disconnects)
    mean_latency_ms: float | None
    max_latency_ms: float | None
    prompt_tokens: int
    completion_tokens: int


async def traffic_series(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> list[TrafficBucket]:
    """Calls, errors, latency and tokens per `step_s` bucket of [since, until), oldest first."""
    bucket = epoch_bucket(session, Call.created_at, step_s).label("bucket")
    query = (
        select(
            bucket,
            func.count().label("calls"),
            func.sum(case((Call.status != "ok", 1), else_=0)).label("errors"),
            func.avg(Call.latency_ms).label("mean_latency"),
            func.max(Call.latency_ms).label("max_latency"),
            func.coalesce(func.sum(Call.prompt_tokens), 0).label("prompt"),
            func.coalesce(func.sum(Call.completion_tokens), 0).label("completion"),
        )
        .where(Call.created_at >= since, Call.created_at < until)
        .group_by(bucket)
        .order_by(bucket)
    )
    if policy is not None:
        query = query.where(Call.policy == policy)
    rows = await session.execute(query)
    return [
        TrafficBucket(
            _at(row.bucket),
            int(row.calls),
            int(row.errors or 0),
            None if row.mean_latency is None else float(row.mean_latency),
            None if row.max_latency is None else float(row.max_latency),
            int(row.prompt),
            int(row.completion),
        )
        for row in rows
    ]


@dataclass(frozen=True)
class RewardPoint:
    """The mean reward of one policy's episodes that started in a bucket, by the version that served them."""

    start: datetime
    version: int | None
    mean_reward: float
    episodes: int


async def reward_series(
    session: AsyncSession, policy: str, since: datetime, until: datetime, step_s: int
) -> list[RewardPoint]:
    """Live reward of a policy's traffic: rewarded episodes per bucket and serving version (of the first call)."""
    bucket = epoch_bucket(session, Episode.created_at, step_s).label("bucket")
    rows = await session.execute(
        select(
            bucket,
            Call.adapter_version,
            func.avg(Episode.reward).label("mean"),
            func.count().label("n"),
        )
        .join(Call, and_(Call.episode_id == Episode.id, Call.position == 0))
        .where(
            Episode.policy == policy,
            Episode.created_at >= since,
            Episode.created_at < until,
            Episode.reward.is_not(None),
        )
        .group_by(bucket, Call.adapter_version)
        .order_by(bucket)
    )
    return [RewardPoint(_at(r.bucket), r.adapter_version, float(r.mean), int(r.n)) for r in rows]


@dataclass(frozen=True)
class VersionEvent:
    """A change of the version that serves a policy: a promotion or rollback by a person, or by the gate."""

    at: datetime
    policy: str
    kind: str  # promote | rollback | gate
    version: int | None  # the version made active (a rollback records the one it left)
    actor: str


async def version_events(
    session: AsyncSession, since: datetime, until: datetime, policy: str | None = None
) -> list[VersionEvent]:
    """Promotions and rollbacks (the audit log) and the gate's promotions (train runs), oldest first."""
    audit = select(AuditEntry).where(
        AuditEntry.action.in_(("policy.promote", "policy.rollback")),
        AuditEntry.at >= since,
        AuditEntry.at < until,
    )
    runs = (
        select(TrainingRun, Policy.name)
        .join(Policy, Policy.id == TrainingRun.policy_id)
        .where(
            TrainingRun.kind == "train",
            TrainingRun.to_version.is_not(None),
            TrainingRun.finished_at >= since,
            TrainingRun.finished_at < until,
        )
    )
    if policy is not None:
        audit = audit.where(AuditEntry.target == policy)
        runs = runs.where(Policy.name == policy)
    events: list[VersionEvent] = []
    for entry in (await session.execute(audit.limit(1000))).scalars():
        details = entry.details or {}
        promote = entry.action == "policy.promote"
        version = details.get("version") if promote else details.get("from_version")
        events.append(
            VersionEvent(
                utc(entry.at),
                entry.target,
                "promote" if promote else "rollback",
                version if isinstance(version, int) else None,
                entry.actor,
            )
        )
    for run, name in await session.execute(runs.limit(1000)):
        gate = (run.metrics or {}).get("gate") or {}
        if gate.get("decision") == "promote" and run.finished_at is not None:
            events.append(VersionEvent(utc(run.finished_at), name, "gate", run.to_version, f"run {run.id}"))
    return sorted(events, key=lambda e: e.at)


@dataclass(frozen=True)
class EpisodeTotals:
    episodes: int
    rewarded: int
    feedback: int  # feedback rows


async def episode_totals(
    session: AsyncSession, since: datetime, until: datetime, policy: str | None = None
) -> EpisodeTotals:
    """Episodes started in [since, until), how many of them are rewarded, and feedback rows given in it.

    Counted so that each count can come from an index alone: all episodes, and the unrewarded ones
    (`reward IS NULL`, the review queue's index), rather than reading every episode's reward."""
    window = [Episode.created_at >= since, Episode.created_at < until]
    if policy is not None:
        window.append(Episode.policy == policy)
    total = await session.scalar(select(func.count()).select_from(Episode).where(*window))
    unrewarded = await session.scalar(
        select(func.count()).select_from(Episode).where(*window, Episode.reward.is_(None))
    )
    feedback = (
        select(func.count())
        .select_from(Reward)
        .where(Reward.source == "feedback", Reward.created_at >= since, Reward.created_at < until)
    )
    if policy is not None:
        feedback = feedback.join(Episode, Episode.id == Reward.episode_id).where(Episode.policy == policy)
    return EpisodeTotals(
        int(total or 0), int(total or 0) - int(unrewarded or 0), int(await session.scalar(feedback) or 0)
    )


# ----------------------------------------------------------------------------------------------- episodes
@dataclass(frozen=True)
class EpisodeFilter:
    """What the episode list is narrowed to; None leaves a criterion out."""

    policy: str | None = None
    version: int | None = None  # some call of the episode was served by this adapter version
    min_reward: float | None = None
    max_reward: float | None = None
    feedback: bool | None = None  # has (True) or lacks (False) a reward of source `feedback`
    rewarded: bool | None = None  # has (True) or lacks (False) a derived reward
    since: datetime | None = None
    until: datetime | None = None
    text: str | None = None  # a substring of any of its calls' request or response, case-insensitive
    source: str | None = None


@dataclass(frozen=True)
class EpisodeCursor:
    """Where a page ended: the last row's (created_at, id), in the list's order (newest first)."""

    created_at: datetime
    id: str


@dataclass(frozen=True)
class EpisodeSummary:
    id: str
    policy: str | None
    source: str
    project: str
    created_at: datetime
    reward: float | None
    calls: int
    versions: tuple[int | None, int | None]  # lowest and highest adapter version that served it
    tokens: int
    feedback: int  # feedback rows
    rewards: int  # reward rows of any source
    preview: str  # the first user message of its first call, shortened


def _episode_conditions(filt: EpisodeFilter) -> list[Any]:
    conditions: list[Any] = []
    if filt.policy is not None:
        conditions.append(Episode.policy == filt.policy)
    if filt.source is not None:
        conditions.append(Episode.source == filt.source)
    if filt.since is not None:
        conditions.append(Episode.created_at >= filt.since)
    if filt.until is not None:
        conditions.append(Episode.created_at < filt.until)
    # `reward + 0`: a range on the reward index would make SQLite sort every match to find the newest 50;
    # walking the time index newest first and testing the reward finds them at once.
    if filt.min_reward is not None:
        conditions.append(Episode.reward + 0 >= filt.min_reward)
    if filt.max_reward is not None:
        conditions.append(Episode.reward + 0 <= filt.max_reward)
    if filt.rewarded is not None:
        conditions.append(Episode.reward.is_not(None) if filt.rewarded else Episode.reward.is_(None))
    if filt.version is not None:
        conditions.append(exists().where(Call.episode_id == Episode.id, Call.adapter_version == filt.version))
    if filt.feedback is not None:
        has = exists().where(Reward.episode_id == Episode.id, Reward.source == "feedback")
        conditions.append(has if filt.feedback else ~has)
    if filt.text:
        needle = filt.text
        conditions.append(
            exists().where(
                Call.episode_id == Episode.id,
                or_(
                    cast(Call.request, Text).icontains(needle, autoescape=True),
                    cast(Call.response, Text).icontains(needle, autoescape=True),
                ),
            )
        )
    return conditions


def _after(cursor: EpisodeCursor) -> Any:
    """Rows after the cursor in (created_at, id) descending order, written so that both databases read an
    index range on `created_at` (an OR of the two cases alone makes SQLite scan)."""
    return and_(
        Episode.created_at <= cursor.created_at,
        or_(Episode.created_at < cursor.created_at, Episode.id < cursor.id),
    )


async def list_episodes(
    session: AsyncSession, filt: EpisodeFilter, limit: int, after: EpisodeCursor | None = None
) -> tuple[list[EpisodeSummary], EpisodeCursor | None]:
    """A page of episodes, newest first, and the cursor of the next page (None on the last one)."""
    query = select(
        Episode.id,
        Episode.policy,
        Episode.source,
        Episode.project,
        Episode.created_at,
        Episode.reward,
    ).where(*_episode_conditions(filt))
    if after is not None:
        query = query.where(_after(after))
    rows = (
        await session.execute(query.order_by(Episode.created_at.desc(), Episode.id.desc()).limit(limit + 1))
    ).all()
    more = len(rows) > limit
    rows = rows[:limit]
    ids = [row.id for row in rows]
    stats = await _call_stats(session, ids)
    counts = await _reward_counts(session, ids)
    previews = await _previews(session, ids)
    page = [
        EpisodeSummary(
            row.id,
            row.policy,
            row.source,
            row.project,
            utc(row.created_at),
            row.reward,
            stats.get(row.id, (0, (None, None), 0))[0],
            stats.get(row.id, (0, (None, None), 0))[1],
            stats.get(row.id, (0, (None, None), 0))[2],
            counts.get(row.id, (0, 0))[0],
            counts.get(row.id, (0, 0))[1],
            previews.get(row.id, ""),
        )
        for row in rows
    ]
    cursor = EpisodeCursor(page[-1].created_at, page[-1].id) if more and page else None
    return page, cursor


async def _call_stats(
    session: AsyncSession, ids: Sequence[str]
) -> dict[str, tuple[int, tuple[int | None, int | None], int]]:
    if not ids:
        return {}
    rows = await session.execute(
        select(
            Call.episode_id,
            func.count(),
            func.min(Call.adapter_version),
            func.max(Call.adapter_version),
            func.coalesce(func.sum(Call.prompt_tokens), 0)
            + func.coalesce(func.sum(Call.completion_tokens), 0),
        )
        .where(Call.episode_id.in_(list(ids)))
        .group_by(Call.episode_id)
    )
    return {row[0]: (int(row[1]), (row[2], row[3]), int(row[4] or 0)) for row in rows}


async def _reward_counts(session: AsyncSession, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    if not ids:
        return {}
    rows = await session.execute(
        select(
            Reward.episode_id,
            func.sum(case((Reward.source == "feedback", 1), else_=0)),
            func.count(),
        )
        .where(Reward.episode_id.in_(list(ids)), Reward.status == "linked")
        .group_by(Reward.episode_id)
    )
    return {row[0]: (int(row[1] or 0), int(row[2])) for row in rows if row[0] is not None}


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


async def _previews(session: AsyncSession, ids: Sequence[str], length: int = 160) -> dict[str, str]:
    if not ids:
        return {}
    rows = await session.execute(
        select(Call.episode_id, Call.request).where(Call.episode_id.in_(list(ids)), Call.position == 0)
    )
    out: dict[str, str] = {}
    for episode_id, request in rows:
        messages = (request or {}).get("messages") or []
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        text = message_text(users[-1].get("content")) if users else ""
        out[episode_id] = text if len(text) <= length else text[: length - 1] + "…"
    return out


async def list_sources(session: AsyncSession) -> list[str]:
    """The distinct episode sources (few: `traffic` and the tools that write episodes)."""
    rows = await session.execute(select(Episode.source).distinct().order_by(Episode.source).limit(100))
    return [row[0] for row in rows]


async def queue_neighbour(
    session: AsyncSession, current: EpisodeCursor | None, *, in_rewarded: bool, policy: str | None = None
) -> tuple[str, bool] | None:
    """The review queue's next episode and whether it is in the rewarded part: unrewarded episodes newest
    first, then rewarded ones newest first. `current` is where the reviewer is (None: the head), and
    `in_rewarded` which part they reached it in (an episode labelled a moment ago is rewarded now, but the
    queue goes on with the unrewarded ones older than it)."""
    base = [Episode.policy == policy] if policy is not None else []
    for rewarded in (False, True):
        if in_rewarded and not rewarded:
            continue
        query = select(Episode.id).where(
            *base, Episode.reward.is_not(None) if rewarded else Episode.reward.is_(None)
        )
        if current is not None and in_rewarded == rewarded:
            query = query.where(_after(current))
        found = await session.scalar(query.order_by(Episode.created_at.desc(), Episode.id.desc()).limit(1))
        if found is not None:
            return str(found), rewarded
    return None


async def episode_created_at(session: AsyncSession, episode_id: str) -> datetime | None:
    """When an episode was created (its place in the review queue), or None when it is unknown."""
    created = await session.scalar(select(Episode.created_at).where(Episode.id == episode_id))
    return utc(created) if created is not None else None


@dataclass(frozen=True)
class CallDetail:
    """One call of an episode as the trajectory view shows it."""

    id: str
    position: int
    model: str
    engine_model: str | None
    adapter_version: int | None
    status: str
    stream: bool
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    params: dict[str, Any]
    response: dict[str, Any] | None
    error: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    sampled_tokens: int | None  # token ids captured for the first choice
    latency_ms: float
    ttft_ms: float | None
    created_at: datetime


@dataclass(frozen=True)
class EpisodeDetail:
    id: str
    policy: str | None
    project: str
    source: str
    group_key: str | None
    metadata: dict[str, Any]
    tags: list[Any]
    reward: float | None
    reward_provenance: dict[str, Any] | None
    created_at: datetime
    calls: list[CallDetail]


async def episode_detail(session: AsyncSession, episode_id: str) -> EpisodeDetail | None:
    """An episode with every call in order (request, response, tokens, timings); None when unknown."""
    episode = await session.get(Episode, episode_id)
    if episode is None:
        return None
    rows = (
        await session.execute(
            select(Call).where(Call.episode_id == episode_id).order_by(Call.position).limit(500)
        )
    ).scalars()
    calls = []
    for call in rows:
        request = call.request or {}
        sampled = (call.completion_token_ids or [None])[0]
        calls.append(
            CallDetail(
                call.id,
                call.position,
                call.model,
                call.engine_model,
                call.adapter_version,
                call.status,
                call.stream,
                list(request.get("messages") or []),
                request.get("tools"),
                dict(request.get("params") or {}),
                call.response,
                call.error,
                call.prompt_tokens,
                call.completion_tokens,
                len(sampled) if isinstance(sampled, list) else None,
                call.latency_ms,
                call.ttft_ms,
                utc(call.created_at),
            )
        )
    return EpisodeDetail(
        episode.id,
        episode.policy,
        episode.project,
        episode.source,
        episode.group_key,
        dict(episode.meta or {}),
        list(episode.tags or []),
        episode.reward,
        episode.reward_provenance,
        utc(episode.created_at),
        calls,
    )


@dataclass(frozen=True)
class RewardDetail:
    """A reward row with everything that says where it came from."""

    id: int
    call_id: str | None
    source: str
    name: str
    value: float
    label: str | None
    comment: str | None  # a judge's explanation, or a person's comment
    metadata: dict[str, Any]
    status: str
    key_id: str | None
    created_at: datetime


async def episode_rewards(session: AsyncSession, episode_id: str) -> list[RewardDetail]:
    """Every reward of an episode and of its calls (pending ones included), oldest first."""
    # Two indexed lookups rather than one OR, which the query planners answer with a scan of `rewards`.
    call_ids = list(await session.scalars(select(Call.id).where(Call.episode_id == episode_id)))
    found: dict[int, Reward] = {}
    for condition in (Reward.episode_id == episode_id, Reward.call_id.in_(call_ids)):
        for row in (await session.execute(select(Reward).where(condition).limit(1000))).scalars():
            found[row.id] = row
    rows = sorted(found.values(), key=lambda r: (utc(r.created_at), r.id))
    return [
        RewardDetail(
            r.id,
            r.call_id,
            r.source,
            r.name,
            r.value,
            r.label,
            r.comment,
            dict(r.meta or {}),
            r.status,
            r.key_id,
            utc(r.created_at),
        )
        for r in rows
    ]


# ----------------------------------------------------------------------------------------------- runs, judge
@dataclass(frozen=True)
class JudgeGroupRow:
    id: int
    policy: str | None
    group_key: str
    episodes: int
    scorer: str
    model: str | None
    status: str
    attempts: int
    error: str | None
    latency_ms: float | None
    cost_usd: float | None
    created_at: datetime


async def list_judge_groups(
    session: AsyncSession,
    *,
    policy: str | None,
    status: str | None,
    limit: int,
    before_id: int | None = None,
) -> list[JudgeGroupRow]:
    """Judging attempts, newest first (keyset on the id)."""
    query = select(JudgeGroup)
    if policy is not None:
        query = query.where(JudgeGroup.policy == policy)
    if status is not None:
        query = query.where(JudgeGroup.status == status)
    if before_id is not None:
        query = query.where(JudgeGroup.id < before_id)
    rows = (await session.execute(query.order_by(JudgeGroup.id.desc()).limit(limit))).scalars()
    return [
        JudgeGroupRow(
            g.id,
            g.policy,
            g.group_key,
            len(g.episode_ids or []),
            g.scorer,
            g.model,
            g.status,
            g.attempts,
            g.error,
            g.latency_ms,
            g.cost_usd,
            utc(g.created_at),
        )
        for g in rows
    ]


@dataclass(frozen=True)
class JudgeDay:
    start: datetime
    groups: int
    failed: int
    cost_usd: float
    mean_latency_ms: float | None


async def judge_series(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> list[JudgeDay]:
    """Judged groups, failures, cost and latency per bucket."""
    bucket = epoch_bucket(session, JudgeGroup.created_at, step_s).label("bucket")
    query = (
        select(
            bucket,
            func.count(),
            func.sum(case((JudgeGroup.status == "failed", 1), else_=0)),
            func.coalesce(func.sum(JudgeGroup.cost_usd), 0.0),
            func.avg(JudgeGroup.latency_ms),
        )
        .where(JudgeGroup.created_at >= since, JudgeGroup.created_at < until)
        .group_by(bucket)
        .order_by(bucket)
    )
    if policy is not None:
        query = query.where(JudgeGroup.policy == policy)
    return [
        JudgeDay(
            _at(r[0]), int(r[1]), int(r[2] or 0), float(r[3] or 0.0), None if r[4] is None else float(r[4])
        )
        for r in await session.execute(query)
    ]
