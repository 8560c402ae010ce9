"""A handle on a policy behind a gateway: OpenAI clients that go through it, trajectories, rewards sent in code,
and training, judging and versions through the admin API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gateway.client.agent import PolicyTools, open_tools
from gateway.client.connection import Connection, KaizenError
from gateway.client.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import openai

#: Items per `/v1/feedback` request (the gateway's batch limit).
FEEDBACK_BATCH = 1000


@dataclass(frozen=True)
class Run:
    """A job of the policy as `/admin/runs/{id}` shows it (train, judge or retention)."""

    id: int
    policy: str
    kind: str
    status: str  # running | succeeded | skipped | failed | rejected
    from_version: int | None
    to_version: int | None
    config: dict[str, Any]
    metrics: dict[str, Any]
    error: str | None

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Run:
        return cls(
            id=int(data["id"]),
            policy=str(data["policy"]),
            kind=str(data["kind"]),
            status=str(data["status"]),
            from_version=data.get("from_version"),
            to_version=data.get("to_version"),
            config=dict(data.get("config") or {}),
            metrics=dict(data.get("metrics") or {}),
            error=data.get("error"),
        )

    @property
    def finished(self) -> bool:
        """Done, including the gate's decision on a train run's candidate (made after training finished)."""
        if self.status == "running":
            return False
        awaiting_gate = self.kind == "train" and self.status == "succeeded" and self.to_version is not None
        return not (awaiting_gate and "gate" not in self.metrics)

    @property
    def gate(self) -> dict[str, Any] | None:
        """The evaluation gate's decision and numbers, for a train run that wrote a candidate."""
        gate = self.metrics.get("gate")
        return gate if isinstance(gate, dict) else None

    @property
    def promoted(self) -> bool:
        return self.gate is not None and self.gate.get("decision") == "promote"


class Model:
    """A policy served by a Kaizen gateway, local or remote: only `base_url` and the keys say which.

    `api_key` sends calls and rewards (scopes chat, feedback, read); `admin_key` trains, judges and reads runs.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        feedback_secret: str | None = None,
        timeout_s: float = 120.0,
        poll_s: float = 1.0,
    ) -> None:
        self.name = name
        self.connection = Connection(base_url, api_key, admin_key, feedback_secret, timeout_s)
        self.poll_s = poll_s

    @property
    def openai_base_url(self) -> str:
        return self.connection.openai_base_url

    # ------------------------------------------------------------------ inference
    def openai_client(self, **options: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client on the gateway (calls are captured; episodes by stitching or your headers)."""
        import openai

        return openai.OpenAI(
            **{"base_url": self.openai_base_url, "api_key": self.connection.api_key or "unused", **options}
        )

    def async_openai_client(self, **options: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` client on the gateway."""
        import openai

        return openai.AsyncOpenAI(
            **{"base_url": self.openai_base_url, "api_key": self.connection.api_key or "unused", **options}
        )

    def trajectory(self, group_key: str | None = None) -> Trajectory:
        """A new trajectory (its own episode) of this policy, in the group `group_key`."""
        return Trajectory(self.connection, self.name, group_key)

    def tools(self, trajectory: Trajectory | None = None) -> AbstractAsyncContextManager[PolicyTools]:
        """An MCP session on the policy's tools (`/mcp/<policy>`); calls made through it join `trajectory`'s
        episode. Use it with `gateway.client.run_agent`."""
        return open_tools(self.connection, self.name, trajectory, timeout_s=self.connection.timeout_s)

    # ------------------------------------------------------------------ the policy
    async def info(self) -> dict[str, Any]:
        """The policy as the admin API shows it: base model, active version, configuration, versions."""
        policies = await self.connection.request("GET", "/admin/policies", admin=True)
        for policy in policies:
            if policy["name"] == self.name:
                return dict(policy)
        raise KaizenError(404, f"no policy named {self.name!r}", "policy_not_found", "name")

    async def register(
        self, base_model: str | None = None, config: Mapping[str, Any] | None = None
    ) -> int | None:
        """Create the policy (version 0 active) unless it exists; returns its active version."""
        body: dict[str, Any] = {"name": self.name, "config": dict(config or {})}
        if base_model is not None:
            body["base_model"] = base_model
        try:
            created = await self.connection.request("POST", "/admin/policies", body=body, admin=True)
        except KaizenError as exc:
            if exc.code != "policy_exists":
                raise
            return await self.version()
        return created.get("active_version")  # type: ignore[no-any-return]

    async def version(self) -> int | None:
        """The active version (what `model=<name>` is served by)."""
        return (await self.info()).get("active_version")

    async def wait_for_version(self, version: int, *, timeout_s: float = 600.0) -> int:
        """Wait until `version` (or a later one) is active; gateways switch to it within their policy refresh
        (`KAIZEN_POLICY_REFRESH_S`). Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = await self.version()
            if active is not None and active >= version:
                return active
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name}@{version} was not active after {timeout_s:g} s (active: {active})"
                )
            await asyncio.sleep(self.poll_s)

    # ------------------------------------------------------------------ episodes
    async def episode(self, episode_id: str) -> dict[str, Any]:
        """A stored episode with its messages, reward and rewards (`GET /v1/episodes/{id}`)."""
        return dict(await self.connection.request("GET", f"/v1/episodes/{episode_id}"))

    async def wait_until_stored(
        self, trajectories: Iterable[Trajectory | TrajectoryGroup], *, timeout_s: float = 120.0
    ) -> None:
        """Wait until the gateway stored these trajectories' episodes: it writes captured calls in the
        background, and a judge or training run only sees what is stored. Raises TimeoutError."""
        pending = {t.episode_id for t in _members(trajectories)}
        deadline = time.monotonic() + timeout_s
        while pending:
            for episode_id in sorted(pending):
                try:
                    await self.episode(episode_id)
                except KaizenError as exc:
                    if exc.status not in (
                        404,
                        409,
                    ):  # 409: still queued; 404: not written by this replica yet
                        raise
                    continue
                pending.discard(episode_id)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(pending)} episodes not stored after {timeout_s:g} s")
            await asyncio.sleep(self.poll_s)

    # ------------------------------------------------------------------ rewards
    async def send_rewards(
        self, trajectories: Iterable[Trajectory | TrajectoryGroup], *, name: str = "rollout"
    ) -> int:
        """Send the rewards set in code as feedback named `name`; returns how many were new (a repeat is
        stored once). Trajectories without a reward, and failed ones, are left to the policy's scorer."""
        items = [item for t in _members(trajectories) if (item := t.feedback(name)) is not None]
        stored = 0
        for start in range(0, len(items), FEEDBACK_BATCH):
            try:
                answer = await self.connection.request(
                    "POST", "/v1/feedback", body={"items": items[start : start + FEEDBACK_BATCH]}, signed=True
                )
            except KaizenError as exc:
                # A signed repeat within the same second carries the same signature, which the gateway
                # refuses because that very request was already applied: nothing in the batch is new.
                if exc.code == "replayed_signature":
                    continue
                raise
            stored += sum(1 for item in answer["items"] if not item.get("duplicate"))
        return stored

    # ------------------------------------------------------------------ jobs
    async def run(self, run_id: int) -> Run:
        return Run.from_api(await self.connection.request("GET", f"/admin/runs/{run_id}", admin=True))

    async def wait_for_run(self, run_id: int, *, timeout_s: float = 3600.0) -> Run:
        """Wait until a run finished (a train run: until the gate decided on its candidate)."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = await self.run(run_id)
            if run.finished:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} of {self.name} still {run.status} after {timeout_s:g} s")
            await asyncio.sleep(self.poll_s)

    async def judge(
        self,
        groups: Iterable[Trajectory | TrajectoryGroup] = (),
        *,
        wait: bool = True,
        timeout_s: float = 3600.0,
    ) -> Run:
        """Score the policy's unscored groups now with its scorer (RULER unless configured otherwise), once the
        episodes of `groups` are stored."""
        await self.wait_until_stored(groups)
        started = await self.connection.request("POST", f"/admin/policies/{self.name}/judge", admin=True)
        run_id = int(started["run_id"])
        return await self.wait_for_run(run_id, timeout_s=timeout_s) if wait else await self.run(run_id)

    async def train(
        self,
        groups: Iterable[Trajectory | TrajectoryGroup] = (),
        *,
        overrides: Mapping[str, Any] | None = None,
        since: datetime | None = None,
        wait: bool = True,
        timeout_s: float = 6 * 3600.0,
    ) -> Run:
        """Train now (the gateway runs it, then gates the candidate); `overrides` are `train` configuration keys
        for this run (`{"grouping": "key", "mode": "warm_start"}`), `since` where its data starts. It starts once
        the episodes of `groups` are stored."""
        await self.wait_until_stored(groups)
        body: dict[str, Any] = {}
        if overrides:
            body["overrides"] = dict(overrides)
        if since is not None:
            body["since"] = since.isoformat()
        started = await self.connection.request(
            "POST", f"/admin/policies/{self.name}/train", body=body or None, admin=True
        )
        run_id = int(started["run_id"])
        return await self.wait_for_run(run_id, timeout_s=timeout_s) if wait else await self.run(run_id)


def _members(entries: Iterable[Trajectory | TrajectoryGroup]) -> list[Trajectory]:
    """The trajectories of a mix of trajectories and groups (a group's failed rollouts left out)."""
    out: list[Trajectory] = []
    for entry in entries:
        out.extend(entry.trajectories if isinstance(entry, TrajectoryGroup) else [entry])
    return out
