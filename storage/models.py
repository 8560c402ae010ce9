"""SQLAlchemy 2 declarative models: the schema of everything Kaizen stores.

SQL is the source of truth. Columns that hold conversations are JSON so that SQLite and PostgreSQL share one
schema; ids are text so that a client-supplied request id can be the primary key.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DEFAULT_PROJECT = "default"
"""The project of the environment's keys, and of everything captured before projects existed."""
EPISODE_SOURCE_TRAFFIC = "traffic"
"""The source of an episode made of calls through the gateway; tools that write episodes name their own."""

# Lengths of the text columns that hold what a request names, which the gateway checks (or keeps values
# within) before it stores them: on PostgreSQL a longer value is refused, and the capture writer would have
# to drop a call that was answered.
POLICY_NAME_LENGTH = 128
GROUP_KEY_LENGTH = 256
USER_LENGTH = 256
REWARD_NAME_LENGTH = 128


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}  # noqa: RUF012


class Policy(Base):
    """A trainable model: a base model plus a lineage of LoRA adapter versions."""

    __tablename__ = "policies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(POLICY_NAME_LENGTH), unique=True)
    base_model: Mapped[str] = mapped_column(String(512))
    active_version: Mapped[int | None] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The project that owns it: only that project's keys call it and only its episodes train it. NULL: shared by
    # every project (each policy created before owners existed, and one created with `shared`).
    project: Mapped[str | None] = mapped_column(String(128))


class Adapter(Base):
    """One LoRA version of a policy (`policy@N`)."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("policy_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("policies.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # candidate | active | retired | rejected
    path: Mapped[str] = mapped_column(Text)
    parent_version: Mapped[int | None] = mapped_column(Integer)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # When it first served traffic (a canary share, a split, a pin or promotion); NULL: never yet. The time from a
    # reward to the version trained on it serving is measured to here.
    serving_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Rollout(Base):
    """A version of a policy serving beside its active version: a canary the gateway promotes or rolls back on
    live evidence, a split set by hand, or a shadow that answers copies of calls nobody sees."""

    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_policy_status", "policy_id", "status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("policies.id", ondelete="CASCADE"))
    mode: Mapped[str] = mapped_column(String(16))  # canary | split | shadow
    version: Mapped[int] = mapped_column(Integer)  # the version on trial
    baseline_version: Mapped[int | None] = mapped_column(Integer)  # the active version it is compared with
    share: Mapped[float] = mapped_column(Float)  # of the policy's traffic (shadow: of calls copied)
    status: Mapped[str] = mapped_column(String(16))  # running | promoted | rolled_back | stopped
    run_id: Mapped[int | None] = mapped_column(Integer)  # the training run that made the version, if any
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the decision rule it runs under
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the last evaluation
    reason: Mapped[str | None] = mapped_column(Text)  # why it ended
    actor: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class VersionPin(Base):
    """Calls of one project, or of one key, to a policy are served by a pinned version instead of the active one."""

    __tablename__ = "version_pins"
    __table_args__ = (UniqueConstraint("policy_id", "scope", "subject"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("policies.id", ondelete="CASCADE"))
    scope: Mapped[str] = mapped_column(String(16))  # project | key
    subject: Mapped[str] = mapped_column(String(128))  # the project's name, or the key's id
    version: Mapped[int] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ShadowPair(Base):
    """One call answered by the serving version and, in the shadow, by a candidate: the context and both replies
    (redacted as the policy's calls are), scored later. Never an episode: shadows are not training traffic."""

    __tablename__ = "shadow_pairs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    call_id: Mapped[str] = mapped_column(String(64))  # the served call
    messages: Mapped[list[Any]] = mapped_column()  # the context both versions answered
    served: Mapped[dict[str, Any]] = mapped_column()  # the serving version's reply message
    shadow: Mapped[dict[str, Any]] = mapped_column()  # the candidate's reply message
    served_reward: Mapped[float | None] = mapped_column(Float)
    shadow_reward: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    scored_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Episode(Base):
    """A trajectory: the calls of one conversation or agent run, in order."""

    __tablename__ = "episodes"
    # The trainer selects a policy's episodes in a window of creation times; the dashboard sorts by reward.
    __table_args__ = (
        Index("ix_episodes_policy_created_at", "policy", "created_at"),
        Index("ix_episodes_reward_created_at", "reward", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    policy: Mapped[str | None] = mapped_column(String(POLICY_NAME_LENGTH), index=True)
    group_key: Mapped[str | None] = mapped_column(String(GROUP_KEY_LENGTH), index=True)
    # The project of the key that created it: only keys of that project (and admin keys) see or reward it.
    project: Mapped[str] = mapped_column(
        String(128), default=DEFAULT_PROJECT, server_default=DEFAULT_PROJECT, index=True
    )
    # Where the episode came from: `traffic` (calls through the gateway), or the tool that wrote it.
    source: Mapped[str] = mapped_column(
        String(32), default=EPISODE_SOURCE_TRAFFIC, server_default=EPISODE_SOURCE_TRAFFIC, index=True
    )
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    reward: Mapped[float | None] = mapped_column(Float)
    reward_provenance: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Call(Base):
    """One chat completion as the client saw it, plus what training needs (token ids, behaviour logprobs).

    On PostgreSQL the table is partitioned by day of `created_at` and its primary key is (id, created_at)
    (revision 0015, `storage.partitions`); ids stay unique because the gateway generates them."""

    __tablename__ = "calls"
    __table_args__ = (
        Index("ix_calls_episode_position", "episode_id", "position"),
        # Retention deletes a policy's calls older than a cut-off.
        Index("ix_calls_policy_created_at", "policy", "created_at"),
        # The newest call of a serving version: where the episode list filtered by version starts looking.
        Index("ix_calls_adapter_version_created_at", "adapter_version", "created_at"),
        # PostgreSQL also has trigram indexes on the text of `request` and `response` (migration 0019) for the
        # dashboard's text search; they are expressions of one dialect, so they are not declared here.
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The client's own request id (`x-request-id`): indexed for feedback, not unique (SDK retries repeat it).
    client_request_id: Mapped[str | None] = mapped_column(String(64), index=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    policy: Mapped[str | None] = mapped_column(String(POLICY_NAME_LENGTH), index=True)
    model: Mapped[str] = mapped_column(String(256))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    engine_model: Mapped[str | None] = mapped_column(String(256))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    request: Mapped[dict[str, Any]] = mapped_column()
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column(JSON)
    completion_token_ids: Mapped[list[Any] | None] = mapped_column(JSON)
    completion_logprobs: Mapped[list[Any] | None] = mapped_column(JSON)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(32), index=True)  # ok | error | client_disconnected
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    context_hash: Mapped[str | None] = mapped_column(String(32), index=True)
    group_key: Mapped[str | None] = mapped_column(String(GROUP_KEY_LENGTH), index=True)
    user: Mapped[str | None] = mapped_column(String(USER_LENGTH))
    key_id: Mapped[str | None] = mapped_column(String(64))  # the API key that sent it (`env` for env keys)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class StoredResponse(Base):
    """A `POST /v1/responses` answer kept for `GET /v1/responses/{id}` and `previous_response_id` (the API's
    `store`, on by default). Written by the capture writer in the transaction of its call; the conversation a
    continuation extends is that call's messages plus its reply, and its episode and project are the call's."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # `resp_<call id>`
    call_id: Mapped[str] = mapped_column(String(64), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    body: Mapped[dict[str, Any]] = mapped_column()  # the Response object, without logprobs
    input_items: Mapped[list[Any]] = mapped_column()  # the request's input items, with their ids
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class ToolCall(Base):
    """A call of one of a policy's tools through the gateway's MCP endpoint, with the episode it belongs to (the
    `X-Episode-Id` of the request). No foreign key: the episode's first chat call may still be on its way."""

    __tablename__ = "tool_calls"
    __table_args__ = (Index("ix_tool_calls_episode_id_created_at", "episode_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    episode_id: Mapped[str | None] = mapped_column(String(64))
    policy: Mapped[str] = mapped_column(String(POLICY_NAME_LENGTH), index=True)
    tool: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(64))  # the MCP server's name, or `function`
    arguments: Mapped[Any] = mapped_column(JSON)
    result: Mapped[str] = mapped_column(Text)
    is_error: Mapped[bool] = mapped_column(Boolean)
    latency_ms: Mapped[float] = mapped_column(Float)
    key_id: Mapped[str | None] = mapped_column(String(64))
    project: Mapped[str] = mapped_column(String(128), default=DEFAULT_PROJECT)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class StitchKey(Base):
    """Index for prefix stitching: the hash of `messages + reply` of a call points at its episode."""

    __tablename__ = "stitch_keys"

    hash: Mapped[str] = mapped_column(String(32), primary_key=True)
    episode_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Reward(Base):
    """One reward signal for a call or an episode. No foreign key: feedback may arrive before the call row."""

    __tablename__ = "rewards"
    __table_args__ = (Index("ix_rewards_episode_id_source", "episode_id", "source"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    call_id: Mapped[str | None] = mapped_column(String(64), index=True)
    episode_id: Mapped[str | None] = mapped_column(String(64), index=True)
    source: Mapped[str] = mapped_column(String(16))  # feedback | judge | function | webhook
    name: Mapped[str] = mapped_column(String(REWARD_NAME_LENGTH), default="user")
    value: Mapped[float] = mapped_column(Float)
    label: Mapped[str | None] = mapped_column(String(128))
    comment: Mapped[str | None] = mapped_column(Text)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(256), unique=True)
    # linked: its call/episode exists; pending: not written yet; orphaned: still unknown after the grace period.
    status: Mapped[str] = mapped_column(String(16), default="linked", server_default="linked", index=True)
    key_id: Mapped[str | None] = mapped_column(String(64))  # the API key that sent it; None for judges
    # The sender's project: early feedback is linked only to a target of that project. None: any project.
    project: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class JudgeGroup(Base):
    """One judging attempt of a group of episodes (RULER or another scorer): outcome, error, cost, latency."""

    __tablename__ = "judge_groups"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy: Mapped[str | None] = mapped_column(String(POLICY_NAME_LENGTH), index=True)
    group_key: Mapped[str] = mapped_column(String(256))
    episode_ids: Mapped[list[Any]] = mapped_column()
    scorer: Mapped[str] = mapped_column(String(16))  # judge | function | webhook
    model: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))  # judged | failed
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    error: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    cost_usd: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class TrainingRun(Base):
    """One training (or judging) job of a policy, with its outcome and metrics."""

    __tablename__ = "training_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("policies.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="train")
    status: Mapped[str] = mapped_column(String(16))  # running | succeeded | failed | rejected
    from_version: Mapped[int | None] = mapped_column(Integer)
    to_version: Mapped[int | None] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class JobLock(Base):
    """A job holding a policy (judge, train, retention): one at a time per key (the policy's name), in any
    process. Taken with an insert that conflicts on the key, so it works the same on SQLite and PostgreSQL;
    a crashed holder stops renewing `expires_at` and the next job takes the lock over (`storage.locks`).
    """

    __tablename__ = "job_locks"

    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    job: Mapped[str] = mapped_column(String(32))
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SignatureReplay(Base):
    """A signed feedback request whose effect committed, kept for the replay window so that no replica
    accepts it again. Written in the same transaction as the request's rewards."""

    __tablename__ = "signature_replays"

    mac: Mapped[str] = mapped_column(String(64), primary_key=True)  # HMAC of "<t>.<body>", lower-case hex
    timestamp: Mapped[int] = mapped_column(BigInteger, index=True)  # the signature's unix seconds


class ApiKey(Base):
    """A managed API key. Only the SHA-256 of the secret is stored; `prefix` (its first characters) is what
    lists show. Revoked keys stay as rows so that calls and audit entries keep naming them."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    hash: Mapped[str] = mapped_column(String(64), unique=True)  # lower-case hex SHA-256 of the secret
    scopes: Mapped[list[Any]] = mapped_column()  # chat | feedback | read | admin
    project: Mapped[str] = mapped_column(String(128))
    models: Mapped[list[Any] | None] = mapped_column(JSON)  # models/policies it may call; None: any
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AuditEntry(Base):
    """One administrative change (promotion, pause, key created, manual run, ...): who, what, when."""

    __tablename__ = "audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(256), index=True)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)


class TrafficRollup(Base):
    """Calls, episodes, rewards and feedback of one 15-minute bucket, policy and serving version, summed: what
    the dashboard's overview reads for closed buckets instead of every row (`storage.rollups` keeps it up to
    date). Calls count by their own start and version; episodes by their start and the version of their first
    call; feedback rows by when they arrived and the policy of their episode."""

    __tablename__ = "traffic_rollups"
    __table_args__ = (Index("ix_traffic_rollups_policy_bucket", "policy", "bucket_start"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    bucket_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    policy: Mapped[str] = mapped_column(String(128))  # '' for calls and episodes of no policy
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    calls: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)  # status other than `ok`
    latency_ms_sum: Mapped[float] = mapped_column(Float, default=0.0)
    latency_ms_max: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    episodes: Mapped[int] = mapped_column(Integer, default=0)
    rewarded: Mapped[int] = mapped_column(Integer, default=0)
    reward_sum: Mapped[float] = mapped_column(Float, default=0.0)
    feedback: Mapped[int] = mapped_column(Integer, default=0)


class RollupMark(Base):
    """Buckets [since, until) whose rollup rows must be summed again: something in them changed after they
    may have been rolled up (a call written late, a reward derived again, feedback linked, rows deleted).
    Written in the transaction of the change; removed by the refresh that re-summed them."""

    __tablename__ = "rollup_marks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    since: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    until: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RollupState(Base):
    """How far `traffic_rollups` reaches (one row): every bucket before `rolled_until` is summed there."""

    __tablename__ = "rollup_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rolled_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    refreshed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class DashboardLogout(Base):
    """A dashboard session ended by logging out before its cookie expired. Every gateway reads the list with
    its keys, so a copy of the cookie stops working everywhere; a row goes once the cookie would have expired."""

    __tablename__ = "dashboard_logouts"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)  # the session's random nonce
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class SchemaRevision(Base):
    """A schema revision applied to this database, with its predecessor and whether it was safe to run while the
    previous revision's gateways served. A gateway whose code is older than the database reads these rows to tell
    whether it may serve on it (`migrations.runner`): it does not know the newer revisions itself."""

    __tablename__ = "schema_revisions"

    revision: Mapped[str] = mapped_column(String(32), primary_key=True)
    previous: Mapped[str | None] = mapped_column(String(32))
    online_safe: Mapped[bool] = mapped_column(Boolean)  # on this database's dialect
    note: Mapped[str] = mapped_column(Text)  # why it is (not) online-safe
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
