"""`/admin/runs` and per-policy job triggers: see runs with their status and metrics, start a judge, train
or retention run now (admin key). Pausing and resuming a policy's schedule is
`gateway.controllers.policy_actions`, shared with the dashboard."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.controllers.params import PageLimit, PathName, RowId
from gateway.errors import APIError, InvalidRequest, NotFound, invalid_policy_config, policy_not_found
from gateway.scheduling import Jobs
from storage.audit import record_audit
from storage.jobs import RunInfo, get_run, list_runs
from storage.policies import get_policy
from trainer.control.policy_config import InvalidPolicyConfig, load_policy_config
from trainer.control.scheduler import JobBusy, JobKind, TrainOptions


class Started(msgspec.Struct):
    run_id: int
    policy: str
    kind: str


class TrainBody(msgspec.Struct, forbid_unknown_fields=True):
    """Optional body of a train trigger: this run's `TrainConfig` overrides and the start of its data window."""

    overrides: dict[str, Any] = {}
    since: datetime | None = None


class RunsController(Controller):
    path = "/admin"
    guards = [requires("admin")]  # noqa: RUF012

    @get("/runs")
    async def list_all(
        self,
        session: NamedDependency[AsyncSession],
        policy: FromQuery[str | None] = None,
        kind: FromQuery[str | None] = None,
        limit: FromQuery[PageLimit] = 100,
    ) -> list[RunInfo]:
        """Runs of every kind (train, judge, retention), newest first; a train run's gate decision is in
        `metrics.gate`."""
        return await list_runs(session, policy, kind, limit)

    @get("/runs/{run_id:int}")
    async def get_one(self, run_id: FromPath[RowId], session: NamedDependency[AsyncSession]) -> RunInfo:
        run = await get_run(session, run_id)
        if run is None:
            raise NotFound(f"no run {run_id}", param="run_id", code="run_not_found")
        return run

    @post("/policies/{name:str}/train", status_code=202)
    async def train(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        jobs: NamedDependency[Jobs],
        session: NamedDependency[AsyncSession],
    ) -> Started:
        """Train now in a child process; the candidate goes through the gate. Answers with the run id.

        An optional JSON body, `{"overrides": {...}, "since": "<ISO time>"}`, overrides keys of the policy's
        `train` configuration for this run (validated like `kaizen train --set`) and sets where its data starts.
        """
        raw = await request.body()
        options = TrainOptions()
        if raw.strip():
            try:
                body = msgspec.json.decode(raw, type=TrainBody)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise InvalidRequest(str(exc), code="invalid_value") from exc
            refuse_too_deep({"overrides": body.overrides}, param="overrides")
            policy = await get_policy(session, name)
            if policy is None:
                raise policy_not_found(name)
            try:
                load_policy_config(policy.config, train_overrides=body.overrides)
            except InvalidPolicyConfig as exc:
                raise invalid_policy_config(exc, param="overrides") from exc
            since = body.since
            if since is not None and since.tzinfo is None:
                since = since.replace(tzinfo=UTC)
            options = TrainOptions(body.overrides, since)
        return await _start(request, jobs, session, name, "train", options)

    @post("/policies/{name:str}/judge", status_code=202)
    async def judge(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        jobs: NamedDependency[Jobs],
        session: NamedDependency[AsyncSession],
    ) -> Started:
        """Score the policy's unscored groups now, in the background."""
        return await _start(request, jobs, session, name, "judge")

    @post("/policies/{name:str}/retention", status_code=202)
    async def retention(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        jobs: NamedDependency[Jobs],
        session: NamedDependency[AsyncSession],
    ) -> Started:
        """Prune old calls and unused versions now, in the background."""
        return await _start(request, jobs, session, name, "retention")


async def _start(
    request: Request[Any, Any, Any],
    jobs: Jobs,
    session: AsyncSession,
    name: str,
    kind: JobKind,
    options: TrainOptions | None = None,
) -> Started:
    try:
        run_id = await jobs.runner.start(name, kind, options=options)
    except LookupError as exc:
        raise NotFound(str(exc), param="name", code="policy_not_found") from exc
    except JobBusy as exc:
        raise APIError(str(exc), code="job_running", status_code=409) from exc
    # The run row is written by the runner in a session of its own; the entry names it.
    details: dict[str, Any] = {"run_id": run_id}
    if options is not None and (options.overrides or options.since is not None):
        details["overrides"] = dict(options.overrides)
        details["since"] = options.since.isoformat() if options.since is not None else None
    await record_audit(session, principal_of(request).actor, f"run.{kind}", name, details)
    return Started(run_id, name, kind)
