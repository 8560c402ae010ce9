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

from storage.dialect import epoch_bucket, utc
from storage.models import AuditEntry, Call, Episode, JudgeGroup, Policy, Reward, TrainingRun
from storage.rollups import Key, Sums, window_sums


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


@dataclass(frozen=True)
class RewardPoint:
    """The mean reward of one policy's episodes that started in a bucket, by the version that served them."""

    start: datetime
    version: int | None
    mean_reward: float
    episodes: int


@dataclass(frozen=True)
class EpisodeTotals:
    episodes: int
    rewarded: int
    feedback: int  # feedback rows


@dataclass(frozen=True)
class Activity:
    """A window of traffic summed per bucket, policy and serving version: the overview's charts and totals."""

    sums: dict[Key, Sums]

    def traffic(self) -> list[TrafficBucket]:
        """Calls, errors, latency and tokens per bucket with calls, oldest first."""
        buckets: dict[int, Sums] = {}
        for (bucket, _, _), sums in self.sums.items():
            if sums.calls:
                buckets.setdefault(bucket, Sums()).add(sums)
        return [
            TrafficBucket(
                _at(bucket),
                s.calls,
                s.errors,
                s.latency_ms_sum / s.calls,
                s.latency_ms_max,
                s.prompt_tokens,
                s.completion_tokens,
            )
            for bucket, s in sorted(buckets.items())
        ]

    def rewards(self, policy: str) -> list[RewardPoint]:
        """Live reward of a policy's traffic: rewarded episodes per bucket and version (of the first call)."""
        return [
            RewardPoint(_at(bucket), version, s.reward_sum / s.rewarded, s.rewarded)
            for (bucket, owner, version), s in sorted(
                self.sums.items(), key=lambda item: (item[0][0], -1 if item[0][2] is None else item[0][2])
            )
            if owner == policy and s.rewarded
        ]

    def totals(self) -> EpisodeTotals:
        """Episodes started in the window, how many are rewarded, and the feedback rows given in it."""
        return EpisodeTotals(
            sum(s.episodes for s in self.sums.values()),
            sum(s.rewarded for s in self.sums.values()),
            sum(s.feedback for s in self.sums.values()),
        )


async def activity(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> Activity:
    """[since, until) in `step_s` buckets, for every policy or one: pre-summed rollup rows for the buckets that
    closed a while ago and the raw rows after them (`storage.rollups`)."""
    return Activity(await window_sums(session, since, until, step_s, policy))


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
        gate = run.metrics.get("gate") if isinstance(run.metrics, dict) else None
        # Runs of other modes may have no gate, or one of another shape: only a gate's promotion counts.
        if isinstance(gate, dict) and gate.get("decision") == "promote" and run.finished_at is not None:
            events.append(VersionEvent(utc(run.finished_at), name, "gate", run.to_version, f"run {run.id}"))
    return sorted(events, key=lambda e: e.at)


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


TEXT_SEARCH_WINDOW = 20_000
"""On SQLite, a text search reads at most this many episodes per page (newest first) and says where it
stopped; the next request goes on from there (`KAIZEN_DASHBOARD_SEARCH_EPISODES`). PostgreSQL searches
through its trigram indexes instead."""
TEXT_CANDIDATES = 5_000
"""On PostgreSQL, a text search whose matching calls the trigram indexes find fewer than this many of lists
exactly their episodes; a more common text walks the episodes newest first, where matches come early."""


def _episode_conditions(filt: EpisodeFilter) -> list[Any]:
    """The filter's conditions on episodes, the text search aside (`list_episodes` words it per database)."""
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
        has = exists().where(
            Reward.episode_id == Episode.id,
            Reward.source == "feedback",
            or_(Reward.project.is_(None), Reward.project == Episode.project),
        )
        conditions.append(has if filt.feedback else ~has)
    return conditions


def _like(needle: str) -> str:
    """An ILIKE pattern matching `needle` anywhere, its own wildcards taken literally (escape `\\`)."""
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _text_matches(needle: str) -> Any:
    """Calls whose request or response contains `needle`, case-insensitive. On PostgreSQL `ILIKE` on the
    text of the JSON, which the trigram indexes of migration 0019 serve; on SQLite `lower(..) LIKE lower(..)`."""
    pattern = _like(needle)
    return or_(
        cast(Call.request, Text).ilike(pattern, escape="\\"),
        cast(Call.response, Text).ilike(pattern, escape="\\"),
    )


async def _version_bound(session: AsyncSession, filt: EpisodeFilter) -> Any:
    """Episodes served by a version started no later than its newest call: the list starts there rather than
    walking every newer episode (one probe of `ix_calls_adapter_version_created_at`). None: no such call."""
    query = select(Call.created_at).where(Call.adapter_version == filt.version)
    if filt.policy is not None:
        query = query.where(Call.policy == filt.policy)
    newest = await session.scalar(query.order_by(Call.created_at.desc()).limit(1))
    return None if newest is None else Episode.created_at <= newest


async def _text_condition(session: AsyncSession, filt: EpisodeFilter, needle: str, most: int) -> Any:
    """PostgreSQL: the episodes of the matching calls when the trigram indexes find at most `most` of them (a
    rare text), else a probe per episode walked newest first (a common text fills a page early)."""
    candidates = select(Call.episode_id).where(_text_matches(needle))
    if filt.policy is not None:
        candidates = candidates.where(Call.policy == filt.policy)
    if filt.since is not None:  # an episode's calls start no earlier than the episode
        candidates = candidates.where(Call.created_at >= filt.since)
    found = list(await session.scalars(candidates.limit(most + 1)))
    if len(found) <= most:
        return Episode.id.in_(sorted(set(found)))
    return exists().where(Call.episode_id == Episode.id, _text_matches(needle))


def _at_or_after(cursor: EpisodeCursor) -> Any:
    """Rows up to and including the cursor in the list's order: no older than it (worded as `_after` is)."""
    return and_(
        Episode.created_at >= cursor.created_at,
        or_(Episode.created_at > cursor.created_at, Episode.id >= cursor.id),
    )


def _after(cursor: EpisodeCursor) -> Any:
    """Rows after the cursor in (created_at, id) descending order, written so that both databases read an
    index range on `created_at` (an OR of the two cases alone makes SQLite scan)."""
    return and_(
        Episode.created_at <= cursor.created_at,
        or_(Episode.created_at < cursor.created_at, Episode.id < cursor.id),
    )


@dataclass(frozen=True)
class EpisodePage:
    """A page of the episode list."""

    rows: list[EpisodeSummary]
    next: EpisodeCursor | None  # where the next page starts; None on the last one
    # A text search on SQLite that read its window of episodes without filling the page: the oldest episode
    # it read (the next page goes on after it), else None.
    searched_to: EpisodeCursor | None = None


async def list_episodes(
    session: AsyncSession,
    filt: EpisodeFilter,
    limit: int,
    after: EpisodeCursor | None = None,
    *,
    text_window: int = TEXT_SEARCH_WINDOW,
    text_candidates: int = TEXT_CANDIDATES,
) -> EpisodePage:
    """A page of episodes, newest first, and where the next one starts."""
    conditions = _episode_conditions(filt)
    if after is not None:
        conditions.append(_after(after))
    if filt.version is not None:
        bound = await _version_bound(session, filt)
        if bound is None:
            return EpisodePage([], None)
        conditions.append(bound)
    window_end: EpisodeCursor | None = None
    if filt.text:
        if session.get_bind().dialect.name == "postgresql":
            conditions.append(await _text_condition(session, filt, filt.text, text_candidates))
        else:
            # The oldest episode of the window this request reads; None: fewer are left than the window.
            edge = (
                await session.execute(
                    select(Episode.created_at, Episode.id)
                    .where(*conditions)
                    .order_by(Episode.created_at.desc(), Episode.id.desc())
                    .limit(1)
                    .offset(text_window - 1)
                )
            ).first()
            if edge is not None:
                window_end = EpisodeCursor(utc(edge.created_at), edge.id)
                conditions.append(_at_or_after(window_end))
            conditions.append(exists().where(Call.episode_id == Episode.id, _text_matches(filt.text)))
    query = select(
        Episode.id,
        Episode.policy,
        Episode.source,
        Episode.project,
        Episode.created_at,
        Episode.reward,
    ).where(*conditions)
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
    if more and page:
        return EpisodePage(page, EpisodeCursor(page[-1].created_at, page[-1].id))
    return EpisodePage(page, window_end, window_end)


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
    """Every reward of an episode and of its calls (pending ones included), oldest first. Feedback another
    project sent for this id before the episode existed is not the episode's, and is left out."""
    # Two indexed lookups rather than one OR, which the query planners answer with a scan of `rewards`.
    call_ids = list(await session.scalars(select(Call.id).where(Call.episode_id == episode_id)))
    project = await session.scalar(select(Episode.project).where(Episode.id == episode_id))
    found: dict[int, Reward] = {}
    for condition in (Reward.episode_id == episode_id, Reward.call_id.in_(call_ids)):
        for row in (await session.execute(select(Reward).where(condition).limit(1000))).scalars():
            if row.project is None or row.project == project:
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
