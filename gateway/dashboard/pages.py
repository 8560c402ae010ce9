"""The dashboard's pages (HTML, server-rendered): overview, episodes and trajectories, the review queue,
policies, training runs and judge groups. Reads only; the writes are in `gateway.dashboard.actions`."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlencode

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from litestar.response import Redirect, Template
from markupsafe import Markup
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of
from gateway.controllers.params import PathName, RowId
from gateway.dashboard.actions import safe_next
from gateway.dashboard.charts import Axis, Chart, Marker, Series, number_axis, render, time_axis
from gateway.dashboard.formatting import milliseconds, seconds, unit_of
from gateway.dashboard.sessions import SessionSigner, requires_login, session_of
from gateway.errors import InvalidRequest, NotFound
from gateway.settings import Settings
from storage.audit import list_audit
from storage.dashboard import (
    Activity,
    EpisodeCursor,
    EpisodeFilter,
    JudgeDay,
    VersionEvent,
    activity,
    episode_created_at,
    episode_detail,
    episode_rewards,
    judge_series,
    list_episodes,
    list_judge_groups,
    list_sources,
    queue_neighbour,
    version_events,
)
from storage.database import Database
from storage.jobs import RunInfo, get_run, list_runs
from storage.learning_latency import learning_latency
from storage.policies import PolicyInfo, get_policy, list_adapters, list_policies
from storage.rollouts import list_pins, list_rollouts
from storage.rollups import refresh_if_stale
from storage.version_rewards import VersionReward, policy_version_rewards
from trainer.control.policy_config import InvalidPolicyConfig, load_policy_config
from trainer.control.run_logs import run_log_path

T = TypeVar("T")
PAGE_SIZE = 50
LOG_TAIL_BYTES = 64 * 1024
POLICY_PAGE_REWARD_WINDOW = timedelta(days=30)
"""The policy page's live reward per version counts the episodes started this long ago at most: the overview's
longest window, and a bound on the rows one page view sums."""
# window -> (length, bucket): about a hundred points per chart.
WINDOWS: dict[str, tuple[timedelta, int]] = {
    "1h": (timedelta(hours=1), 60),
    "6h": (timedelta(hours=6), 300),
    "24h": (timedelta(hours=24), 900),
    "7d": (timedelta(days=7), 7200),
    "30d": (timedelta(days=30), 21600),
}
QUEUE_PARTS = ("unrewarded", "rewarded")
"""The review queue's two parts, in order (index: whether the episodes in it are rewarded)."""
_NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
Text = Annotated[str | None, QueryParameter(max_length=256, pattern=_NO_CONTROL)]
"""A filter value typed into a form: bounded, without control characters (empty or absent: no filter).
(The constraints sit on the optional type itself: on `FromQuery[... | None]` they would not be checked.)"""


def _context(request: Request[Any, Any, Any], page: str, **values: Any) -> dict[str, Any]:
    signer: SessionSigner = request.app.state.dashboard_signer
    return {
        "page": page,
        "actor": principal_of(request).actor,
        "csrf": signer.csrf_token(session_of(request)),
        **values,
    }


def _window(key: str) -> tuple[str, datetime, datetime, int]:
    if key not in WINDOWS:
        raise InvalidRequest(
            f"window must be one of {', '.join(WINDOWS)}", param="window", code="invalid_value"
        )
    length, step = WINDOWS[key]
    now = datetime.now(UTC)
    # Whole buckets, so that the newest point is not a partial one that looks like a drop.
    until = datetime.fromtimestamp((int(now.timestamp()) // step + 1) * step, UTC)
    return key, until - length, until, step


async def _window_holding(
    chosen: str | None,
    default: str,
    load: Callable[[datetime, datetime, int], Awaitable[T]],
    present: Callable[[T], list[float]],
) -> tuple[str, datetime, datetime, int, T]:
    """The window `chosen`, or else the shortest one up to `default` that holds all the data the default one
    has (what `load` returns for a window, whose times `present` lists), and that data: a run of a few minutes
    gets a point a minute, not two points at the edge of a day."""
    key, since, until, step = _window(chosen or default)
    data = await load(since, until, step)
    times = present(data)
    if chosen is None and times:
        oldest = min(times)
        for name in WINDOWS:  # shortest first
            if name == key:
                break
            shorter = _window(name)
            if shorter[1].timestamp() <= oldest:
                key, since, until, step = shorter
                data = await load(since, until, step)
                break
    return key, since, until, step, data


def _blank(value: str | None) -> str | None:
    return value.strip() or None if value is not None else None


def _number(value: str | None, param: str, kind: type[float] | type[int] = float) -> Any:
    text = _blank(value)
    if text is None:
        return None
    try:
        number = kind(text)
    except ValueError as exc:
        raise InvalidRequest(f"{param} must be a number", param=param, code="invalid_value") from exc
    if kind is int and not 0 <= number <= 2**63 - 1:
        raise InvalidRequest(f"{param} is out of range", param=param, code="invalid_value")
    if kind is float and not math.isfinite(number):
        raise InvalidRequest(f"{param} must be a finite number", param=param, code="invalid_value")
    return number


def _time(value: str | None, param: str) -> datetime | None:
    text = _blank(value)
    if text is None:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InvalidRequest(
            f"{param} must be a date or time like 2025-01-31 or 2025-01-31T12:00",
            param=param,
            code="invalid_value",
        ) from exc
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _choice(value: str | None, param: str, choices: Sequence[str]) -> str | None:
    text = _blank(value)
    if text is not None and text not in choices:
        raise InvalidRequest(
            f"{param} must be one of {', '.join(choices)}", param=param, code="invalid_value"
        )
    return text


def encode_cursor(cursor: EpisodeCursor) -> str:
    return f"{cursor.created_at.isoformat()}~{cursor.id}"


def decode_cursor(value: str | None) -> EpisodeCursor | None:
    text = _blank(value)
    if text is None:
        return None
    stamp, _, episode_id = text.rpartition("~")
    try:
        created = datetime.fromisoformat(stamp)
    except ValueError as exc:
        raise InvalidRequest("after is not a page cursor", param="after", code="invalid_value") from exc
    return EpisodeCursor(created if created.tzinfo else created.replace(tzinfo=UTC), episode_id)


def _markers(events: Sequence[VersionEvent]) -> list[Marker]:
    labels = {"promote": "promoted v{}", "rollback": "rolled back from v{}", "gate": "gate promoted v{}"}
    return [Marker(e.at.timestamp(), labels[e.kind].format(e.version), e.kind) for e in events]


def _paused(policy: PolicyInfo) -> bool | None:
    try:
        return load_policy_config(policy.config).schedule.paused
    except InvalidPolicyConfig:
        return None


class LoginPage(Controller):
    """The login form: the one page shown without a session (its script posts the key as JSON)."""

    path = "/dashboard/login"

    @get("")
    async def login(self, next: Text = None) -> Template:
        return Template("login.html.j2", context={"page": "login", "next": safe_next(next or "/dashboard")})


class DashboardPages(Controller):
    path = "/dashboard"
    guards = [requires_login(page=True)]  # noqa: RUF012

    @get("")
    async def overview(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        database: NamedDependency[Database],
        window: Text = None,
        policy: Text = None,
    ) -> Template:
        """Traffic, errors, latency and tokens over the window; the live reward of each policy by version."""
        chosen = _blank(policy)
        # Without a scheduler nothing else keeps the rollups current; with one, this finds them fresh.
        await refresh_if_stale(database)

        async def load(since: datetime, until: datetime, step: int) -> tuple[Activity, list[VersionEvent]]:
            return (
                await activity(session, since, until, step, chosen),
                await version_events(session, since, until, chosen),
            )

        def present(data: tuple[Activity, list[VersionEvent]]) -> list[float]:
            return [float(key[0]) for key in data[0].sums] + [e.at.timestamp() for e in data[1]]

        key, since, until, step, (summed, events) = await _window_holding(
            _blank(window), "24h", load, present
        )
        axis = time_axis(since, until, present((summed, events)), step)
        traffic = summed.traffic()
        totals = summed.totals()
        x = [b.start.timestamp() for b in traffic]
        charts = [
            Chart(
                "Calls and errors",
                [
                    Series("calls", list(zip(x, [b.calls for b in traffic], strict=True))),
                    Series("errors", list(zip(x, [b.errors for b in traffic], strict=True))),
                ],
                axis,
                y_label=f"per {seconds(step)}",
            ),
            Chart(
                "Latency",
                [
                    Series(
                        "mean",
                        [
                            (t, b.mean_latency_ms)
                            for t, b in zip(x, traffic, strict=True)
                            if b.mean_latency_ms is not None
                        ],
                    ),
                    Series(
                        "max",
                        [
                            (t, b.max_latency_ms)
                            for t, b in zip(x, traffic, strict=True)
                            if b.max_latency_ms is not None
                        ],
                    ),
                ],
                axis,
                y_format=milliseconds,
            ),
            Chart(
                "Tokens",
                [
                    Series("prompt", list(zip(x, [b.prompt_tokens for b in traffic], strict=True))),
                    Series("completion", list(zip(x, [b.completion_tokens for b in traffic], strict=True))),
                ],
                axis,
                y_label=f"per {seconds(step)}",
            ),
        ]
        policies = await list_policies(session)
        reward_charts = []
        for info in policies:
            if chosen is not None and info.name != chosen:
                continue
            points = summed.rewards(info.name)
            by_version: dict[int | None, list[tuple[float, float]]] = {}
            for point in points:
                by_version.setdefault(point.version, []).append((point.start.timestamp(), point.mean_reward))
            series = [
                Series("base" if version is None else f"v{version}", values)
                for version, values in sorted(
                    by_version.items(), key=lambda item: -1 if item[0] is None else item[0]
                )
            ]
            reward_charts.append(
                (
                    info,
                    render(
                        Chart(
                            f"Live reward of {info.name} by serving version",
                            series,
                            axis,
                            markers=_markers([e for e in events if e.policy == info.name]),
                            y_label="mean reward",
                        ),
                        caption=False,
                    ),
                )
            )
        return Template(
            "overview.html.j2",
            context=_context(
                request,
                "overview",
                window=key,
                windows=list(WINDOWS),
                since=since,
                until=until,
                policy=chosen,
                policies=policies,
                totals=totals,
                calls=sum(b.calls for b in traffic),
                errors=sum(b.errors for b in traffic),
                prompt_tokens=sum(b.prompt_tokens for b in traffic),
                completion_tokens=sum(b.completion_tokens for b in traffic),
                charts=[render(c) for c in charts],
                reward_charts=reward_charts,
                events=events,
            ),
        )

    @get("/episodes")
    async def episodes(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
        policy: Text = None,
        version: Text = None,
        min_reward: Text = None,
        max_reward: Text = None,
        # `feedback` is also the name of a dependency (the feedback service): the parameter is renamed.
        with_feedback: Annotated[
            str | None, QueryParameter(name="feedback", max_length=256, pattern=_NO_CONTROL)
        ] = None,
        rewarded: Text = None,
        since: Text = None,
        until: Text = None,
        q: Text = None,
        source: Text = None,
        after: Text = None,
    ) -> Template:
        """A filtered page of episodes, newest first, with a link to the next page."""
        flags = ("yes", "no")
        has_feedback = _choice(with_feedback, "feedback", flags)
        is_rewarded = _choice(rewarded, "rewarded", flags)
        filt = EpisodeFilter(
            policy=_blank(policy),
            version=_number(version, "version", int),
            min_reward=_number(min_reward, "min_reward"),
            max_reward=_number(max_reward, "max_reward"),
            feedback=None if has_feedback is None else has_feedback == "yes",
            rewarded=None if is_rewarded is None else is_rewarded == "yes",
            since=_time(since, "since"),
            until=_time(until, "until"),
            text=_blank(q),
            source=_blank(source),
        )
        found = await list_episodes(
            session, filt, PAGE_SIZE, decode_cursor(after), text_window=settings.dashboard_search_episodes
        )
        cursor = found.next
        form = {
            "policy": policy or "",
            "version": version or "",
            "min_reward": min_reward or "",
            "max_reward": max_reward or "",
            "feedback": has_feedback or "",
            "rewarded": is_rewarded or "",
            "since": since or "",
            "until": until or "",
            "q": q or "",
            "source": source or "",
        }
        kept = {k: v for k, v in form.items() if v}
        next_url = (
            f"/dashboard/episodes?{urlencode({**kept, 'after': encode_cursor(cursor)})}" if cursor else None
        )
        return Template(
            "episodes.html.j2",
            context=_context(
                request,
                "episodes",
                rows=found.rows,
                form=form,
                next_url=next_url,
                searched_to=found.searched_to,
                search_window=settings.dashboard_search_episodes,
                first_url=f"/dashboard/episodes?{urlencode(kept)}" if after else None,
                policies=[p.name for p in await list_policies(session)],
                sources=await list_sources(session),
            ),
        )

    @get("/episodes/{episode_id:str}")
    async def episode(
        self,
        request: Request[Any, Any, Any],
        episode_id: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        queue: Text = None,
        policy: Text = None,
    ) -> Template:
        """One trajectory: every call's messages, tools and reply, every reward and where it came from."""
        detail = await episode_detail(session, episode_id)
        if detail is None:
            raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")
        rewards = await episode_rewards(session, episode_id)
        part = _choice(queue, "queue", QUEUE_PARTS)
        review = {
            "after": episode_id,
            "part": part or QUEUE_PARTS[0],
            **({"policy": p} if (p := _blank(policy)) else {}),
        }
        final = detail.calls[-1] if detail.calls else None
        return Template(
            "episode.html.j2",
            context=_context(
                request,
                "episodes",
                episode=detail,
                final=final,
                rewards=rewards,
                in_queue=part is not None,
                next_url=f"/dashboard/review?{urlencode(review)}",
                pretty=_pretty,
            ),
        )

    @get("/review")
    async def review(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        after: Text = None,
        part: Text = None,
        policy: Text = None,
    ) -> Template | Redirect:
        """The review queue: the next episode to label (unrewarded first, newest first), opened in queue mode."""
        chosen = _blank(policy)
        in_rewarded = _choice(part, "part", QUEUE_PARTS) == "rewarded"
        current = None
        if (after_id := _blank(after)) is not None:
            created = await episode_created_at(session, after_id)
            current = EpisodeCursor(created, after_id) if created is not None else None
        found = await queue_neighbour(session, current, in_rewarded=in_rewarded, policy=chosen)
        if found is None:
            return Template("queue_empty.html.j2", context=_context(request, "review", policy=chosen))
        episode_id, rewarded = found
        query = {"queue": QUEUE_PARTS[rewarded], **({"policy": chosen} if chosen else {})}
        return Redirect(f"/dashboard/episodes/{episode_id}?{urlencode(query)}", status_code=303)

    @get("/policies")
    async def policies(
        self, request: Request[Any, Any, Any], session: NamedDependency[AsyncSession]
    ) -> Template:
        """Every policy: its active version, how many versions it has, whether its schedule is paused."""
        rows = []
        for info in await list_policies(session):
            versions = await list_adapters(session, info.id)
            rows.append((info, len(versions), _paused(info)))
        return Template("policies.html.j2", context=_context(request, "policies", rows=rows))

    @get("/policies/{name:str}")
    async def policy(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
    ) -> Template:
        """One policy: versions (promote, rollback), their live reward and how long the serving one took from
        reward to serving, rollouts and pins, schedule (pause, resume), configuration, recent changes."""
        info = await get_policy(session, name)
        if info is None:
            raise NotFound(f"no policy named {name!r}", code="policy_not_found")
        live = (
            await policy_version_rewards(session, name, datetime.now(UTC) - POLICY_PAGE_REWARD_WINDOW) or []
        )
        try:
            effective: dict[str, Any] | None = load_policy_config(info.config).model_dump(mode="json")
            problem = None
        except InvalidPolicyConfig as exc:
            effective, problem = None, str(exc)
        return Template(
            "policy.html.j2",
            context=_context(
                request,
                "policies",
                policy=info,
                versions=list(reversed(await list_adapters(session, info.id))),
                paused=_paused(info),
                stored=_pretty(info.config),
                effective=_pretty(effective) if effective is not None else None,
                problem=problem,
                audit=await list_audit(session, target=name, limit=20),
                runs=await list_runs(session, name, None, 10),
                live=list(reversed(live)),
                live_chart=_live_reward_chart(live),
                live_days=POLICY_PAGE_REWARD_WINDOW.days,
                latency=next(iter(await learning_latency(session, name)), None),
                rollouts=await list_rollouts(session, name, 10),
                pins=await list_pins(session, name),
            ),
        )

    @get("/runs")
    async def runs(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        policy: Text = None,
        kind: Text = None,
        status: Text = None,
        before: Text = None,
    ) -> Template:
        """Runs of every kind, newest first; reward, loss and the gate's numbers of the latest train runs."""
        chosen = _blank(policy)
        kind_value = _choice(kind, "kind", ("train", "judge", "retention"))
        status_value = _choice(status, "status", ("running", "succeeded", "skipped", "failed", "rejected"))
        before_id = _number(before, "before", int)
        rows = await list_runs(
            session, chosen, kind_value, PAGE_SIZE, status=status_value, before_id=before_id
        )
        trains = list(reversed(await list_runs(session, chosen, "train", 100)))
        form = {"policy": chosen or "", "kind": kind_value or "", "status": status_value or ""}
        kept = {k: v for k, v in form.items() if v}
        next_url = (
            f"/dashboard/runs?{urlencode({**kept, 'before': rows[-1].id})}"
            if len(rows) == PAGE_SIZE
            else None
        )
        return Template(
            "runs.html.j2",
            context=_context(
                request,
                "runs",
                rows=rows,
                form=form,
                next_url=next_url,
                policies=[p.name for p in await list_policies(session)],
                charts=_run_charts(trains),
            ),
        )

    @get("/runs/{run_id:int}")
    async def run(
        self,
        request: Request[Any, Any, Any],
        run_id: FromPath[RowId],
        session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Template:
        """One run: status, the data it used, its loss and collapse series, the gate's decision, its log."""
        info = await get_run(session, run_id)
        if info is None:
            raise NotFound(f"no run {run_id}", code="run_not_found")
        log_tail = None
        if info.kind == "train":
            log_tail = await asyncio.to_thread(_tail, run_log_path(settings.data_dir, info.id))
        metrics = info.metrics
        data, gate = metrics.get("data"), metrics.get("gate")
        laid_out = {key for key, kind in _LAID_OUT if isinstance(metrics.get(key), kind)}
        rest = {k: v for k, v in metrics.items() if k not in laid_out}
        lists = _non_scalars(rest)
        return Template(
            "run.html.j2",
            context=_context(
                request,
                "runs",
                run=info,
                # Whatever a mode or version of the trainer reports: scalars by dotted path in tables, lists
                # and the rest as JSON; only the keys below get charts or rows of their own.
                numbers=_scalars(rest),
                data=_scalars(data) if isinstance(data, dict) else None,
                gate=gate if isinstance(gate, dict) else None,
                gate_more={k: v for k, v in _scalars(gate).items() if k.split(".")[0] not in _GATE_SHOWN}
                if isinstance(gate, dict)
                else {},
                charts=_step_charts(metrics),
                config=_pretty(info.config),
                other=_pretty(lists) if lists else None,
                log_tail=log_tail,
            ),
        )

    @get("/judge")
    async def judge(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        policy: Text = None,
        status: Text = None,
        window: Text = None,
        before: Text = None,
    ) -> Template:
        """Judged groups: cost, failures and latency over time, and each attempt with its error."""
        chosen = _blank(policy)
        status_value = _choice(status, "status", ("judged", "failed"))

        async def load(since: datetime, until: datetime, step: int) -> list[JudgeDay]:
            return await judge_series(session, since, until, step, chosen)

        def present(days: list[JudgeDay]) -> list[float]:
            return [d.start.timestamp() for d in days]

        key, since, until, step, series = await _window_holding(_blank(window), "7d", load, present)
        x = present(series)
        axis = time_axis(since, until, x, step)
        charts = [
            render(
                Chart(
                    "Judged groups and failures",
                    [
                        Series("groups", list(zip(x, [d.groups for d in series], strict=True))),
                        Series("failed", list(zip(x, [d.failed for d in series], strict=True))),
                    ],
                    axis,
                )
            ),
            render(
                Chart(
                    "Judge cost",
                    [Series("USD", list(zip(x, [d.cost_usd for d in series], strict=True)))],
                    axis,
                    y_label="USD",
                )
            ),
        ]
        rows = await list_judge_groups(
            session,
            policy=chosen,
            status=status_value,
            limit=PAGE_SIZE,
            before_id=_number(before, "before", int),
        )
        form = {"policy": chosen or "", "status": status_value or "", "window": key}
        kept = {k: v for k, v in form.items() if v}
        return Template(
            "judge.html.j2",
            context=_context(
                request,
                "judge",
                rows=rows,
                charts=charts,
                form=form,
                windows=list(WINDOWS),
                totals={
                    "groups": sum(d.groups for d in series),
                    "failed": sum(d.failed for d in series),
                    "cost_usd": sum(d.cost_usd for d in series),
                },
                policies=[p.name for p in await list_policies(session)],
                next_url=f"/dashboard/judge?{urlencode({**kept, 'before': rows[-1].id})}"
                if len(rows) == PAGE_SIZE
                else None,
            ),
        )


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _tail(path: Path) -> str | None:
    """The end of a log file (None when there is none)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_BYTES))
            data = handle.read()
    except FileNotFoundError:
        return None
    text = data.decode("utf-8", errors="replace")
    return text if size <= LOG_TAIL_BYTES else text.split("\n", 1)[-1]


def _metric(run: RunInfo, *path: str) -> float | None:
    value: Any = run.metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _run_charts(trains: Sequence[RunInfo]) -> list[Any]:
    """Across train runs (x: run id): the mean reward and loss of the data, and the gate's two rewards."""

    def series(name: str, *path: str) -> Series:
        return Series(name, [(float(r.id), v) for r in trains if (v := _metric(r, *path)) is not None])

    return [
        render(
            Chart(
                "Training data: reward and loss per run",
                [series("reward mean", "reward_mean"), series("loss", "loss")],
                number_axis(),
            )
        ),
        render(
            Chart(
                "Gate: held-out reward, candidate vs active",
                [series("candidate", "gate", "candidate_reward"), series("active", "gate", "active_reward")],
                number_axis(),
            )
        ),
    ]


_LAID_OUT: tuple[tuple[str, type], ...] = (
    ("data", dict),
    ("gate", dict),
    ("history", list),
    ("collapse", list),
)
"""Metrics the run page lays out itself when they have the expected shape (else they are listed generically)."""
_GATE_SHOWN = frozenset(
    {
        "decision",
        "candidate_version",
        "candidate_reward",
        "active_version",
        "active_reward",
        "tolerance",
        "groups",
        "reasons",
        "collapse_problems",
        "wall_s",
        "candidate_signals",
        "active_signals",
    }
)
"""Gate fields the run page lays out itself; any other is listed under them."""
MAX_STEP_CHARTS = 8


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _scalars(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Numbers, strings, booleans and nulls of nested objects, by dotted path (lists are left out)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, path + "."))
        elif not isinstance(value, list):
            out[path] = value
    return out


def _non_scalars(values: dict[str, Any]) -> dict[str, Any]:
    """The lists among nested objects, by dotted path: what the tables of scalars leave out."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _non_scalars(value).items()})
        elif isinstance(value, list):
            out[key] = value
    return out


def _per_step(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of every row with a number under `key`; a row without a step counts by its place."""
    return [
        (float(row["step"]) if _is_number(row.get("step")) else float(n), float(row[key]))
        for n, row in enumerate(rows)
        if _is_number(row.get(key))
    ]


def _step_charts(metrics: dict[str, Any]) -> list[Any]:
    """Within one run (x: optimizer step): every number the trainer logged per step (loss first), each on its
    own chart, and the collapse guard's signals at each check on one."""
    charts = []
    history = metrics.get("history")
    rows = [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []
    keys = sorted({k for row in rows for k, v in row.items() if k != "step" and _is_number(v)})
    keys.sort(key=lambda k: k != "loss")
    for key in keys[:MAX_STEP_CHARTS]:
        title = "Loss per optimizer step" if key == "loss" else f"{key} per optimizer step"
        charts.append(
            render(Chart(title, [Series(key, _per_step(rows, key))], number_axis(), y_format=unit_of(key)))
        )
    collapse = metrics.get("collapse")
    checks = [c for c in collapse if isinstance(c, dict)] if isinstance(collapse, list) else []
    signals = sorted({k for c in checks for k, v in c.items() if k != "step" and _is_number(v)})
    if signals:
        charts.append(
            render(
                Chart(
                    "Collapse signals at each check",
                    [Series(name, _per_step(checks, name)) for name in signals],
                    number_axis(),
                )
            )
        )
    return charts


def _live_reward_chart(rows: Sequence[VersionReward]) -> Markup | None:
    """Mean live reward by version between the bounds of its 95% interval; None until a version has a reward."""
    rewarded = [row for row in rows if row.version is not None and row.stats.mean is not None]
    if not rewarded:
        return None
    bounded = [row for row in rewarded if row.stats.low is not None]

    def line(
        name: str, rows: Sequence[VersionReward], pick: Callable[[VersionReward], float | None]
    ) -> Series:
        return Series(name, [(float(row.version or 0), pick(row) or 0.0) for row in rows])

    return render(
        Chart(
            "Live reward by version, with its 95% interval",
            [
                line("mean", rewarded, lambda row: row.stats.mean),
                line("95% upper", bounded, lambda row: row.stats.high),
                line("95% lower", bounded, lambda row: row.stats.low),
            ],
            Axis(lambda x: f"v{x:g}", steps=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)),
            y_label="mean reward",
        )
    )
