"""Feedback: validate items, authenticate webhooks, store rewards, and link feedback that arrived early.

Semantics of an unknown target: feedback naming a call or episode that is neither stored nor recently
submitted to this gateway's capture queue is still accepted (it may be in flight on another replica, or in a
spool) and stored as `pending`. A background task links pending feedback when its target is written; after
`feedback_grace_s` without it, it is marked `orphaned`, and new feedback for that id is refused with 404.
An orphan whose target appears later is still linked. Nothing accepted is ever dropped.

Replays: with a webhook secret, a signed request is applied once. Its identity is the parsed signature (the
timestamp and the MAC the gateway computes, see `gateway/signing.py`), recorded in the database in the same
transaction as its rewards, so every replica refuses it afterwards and a request that was refused or failed
(for example a 503 while the database is down) may be sent again as it was. Records older than the
signature tolerance are deleted by the linker, since verification refuses such timestamps anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import WEBHOOK, KeyRing, Principal, authenticate_client
from gateway.body_depth import refuse_too_deep
from gateway.capture.sink import RecentTargets
from gateway.episodes import valid_id
from gateway.errors import APIError, AuthenticationError, InvalidRequest, NotFound, ServiceUnavailable
from gateway.redaction import Redactor
from gateway.responses.store import RESPONSE_ID
from gateway.signing import Signature, SignatureError, verify
from storage.calls import find_call
from storage.database import Database
from storage.episodes import episode_policy
from storage.models import REWARD_NAME_LENGTH
from storage.rewards import NewReward, RewardInfo, insert_rewards, link_pending, mark_orphans, oldest_unlinked
from storage.rewards import rewards_by_key as stored_by_key
from storage.signatures import forget_signatures, record_signature
from trainer.control.policy_config import FeedbackConfig, InvalidPolicyConfig
from trainer.control.rewards import policy_reward_config, refresh_episode_rewards

log = logging.getLogger(__name__)

MAX_BATCH = 1000
Id = Annotated[str, Meta(min_length=1, max_length=64)]


class FeedbackItem(Struct, forbid_unknown_fields=True):
    value: bool | float | str
    request_id: Id | None = None
    episode_id: Id | None = None
    name: Annotated[str, Meta(min_length=1, max_length=REWARD_NAME_LENGTH)] = "user"
    comment: Annotated[str, Meta(max_length=10_000)] | None = None
    metadata: dict[str, Any] = {}
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class FeedbackBatch(Struct, forbid_unknown_fields=True):
    items: Annotated[list[FeedbackItem], Meta(min_length=1, max_length=MAX_BATCH)]


class StoredFeedback(Struct):
    id: int
    request_id: str | None
    episode_id: str | None
    value: float
    status: str  # linked | pending | orphaned
    duplicate: bool  # the idempotency key was seen before: nothing was written


class FeedbackResult(Struct):
    ids: list[int]
    items: list[StoredFeedback]


@dataclass
class _Target:
    status: str  # linked | pending
    episode_id: str | None
    policy: str | None
    call_id: str | None = None  # the server id a request id resolved to


def _param(message: str, prefix: str) -> str | None:
    marker = "at `$"
    if marker not in message:
        return None
    path = message.split(marker, 1)[1].rstrip("`").lstrip(".")
    return (prefix + path).replace(".[", "[") or None


def decode_items(raw_body: bytes) -> tuple[list[FeedbackItem], bool]:
    """Items of a body that is one item or `{"items": [...]}`; (items, batched). Raises `InvalidRequest`."""
    try:
        body = msgspec.json.decode(raw_body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"could not parse the JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(
            'the body must be a JSON object: one item, or {"items": [...]}', code="invalid_json"
        )
    refuse_too_deep(body)
    batched = "items" in body
    try:
        items = (
            msgspec.convert(body, FeedbackBatch).items if batched else [msgspec.convert(body, FeedbackItem)]
        )
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), param=_param(str(exc), ""), code="invalid_value") from exc
    for index, item in enumerate(items):
        # Text columns cannot hold NUL on PostgreSQL: refused on both databases. `metadata` is JSON (lossless).
        for name in ("name", "comment", "idempotency_key"):
            value = getattr(item, name)
            if value is not None and "\x00" in value:
                param = f"items[{index}].{name}" if batched else name
                raise InvalidRequest(
                    f"{param} must not contain NUL characters", param=param, code="invalid_value"
                )
    return items, batched


def to_number(value: bool | float | str, config: FeedbackConfig, param: str) -> tuple[float, str | None]:
    """(number, label) of a feedback value under the policy's configuration."""
    if isinstance(value, bool):
        return (config.true_value, "thumbs_up") if value else (config.false_value, "thumbs_down")
    if isinstance(value, str):
        if value not in config.labels:
            known = ", ".join(sorted(config.labels)) or "none"
            raise InvalidRequest(
                f"unknown label {value!r} (known labels: {known})", param=param, code="unknown_label"
            )
        return config.labels[value], value
    number = float(value)  # finite: the JSON decoder refuses NaN and infinities
    if (config.min_value is not None and number < config.min_value) or (
        config.max_value is not None and number > config.max_value
    ):
        raise InvalidRequest(
            f"value {number:g} is outside the configured range [{config.min_value}, {config.max_value}]",
            param=param,
            code="value_out_of_range",
        )
    return number, None


class FeedbackService:
    def __init__(
        self,
        database: Database,
        recent: RecentTargets,
        api_keys: KeyRing,
        *,
        secret: str,
        tolerance_s: float,
        grace_s: float,
        link_interval_s: float,
        redactor: Callable[[str | None], Redactor | None] = lambda _: None,
        on_stored: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.database = database
        self.recent = recent
        self.api_keys = api_keys
        self.secret = secret
        self.tolerance_s = tolerance_s
        self.grace_s = grace_s
        self.link_interval_s = link_interval_s
        self.redactor = (
            redactor  # the policy's, as the capture path uses it: comments are stored redacted too
        )
        self.on_stored = on_stored  # told the status of every accepted item (metrics)
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ authentication
    def authenticate(self, headers: Mapping[str, str], raw_body: bytes) -> tuple[Principal, Signature | None]:
        """The sender, and a valid signature when a secret is configured (a signed request comes from a
        trusted backend and may name any project's calls); otherwise a key with the `feedback` scope."""
        if not self.secret:
            return authenticate_client(self.api_keys, headers.get("authorization"), "feedback"), None
        try:
            signature = verify(
                self.secret, headers.get("x-kaizen-signature"), raw_body, tolerance_s=self.tolerance_s
            )
        except SignatureError as exc:
            raise AuthenticationError(str(exc), code="invalid_signature") from exc
        return WEBHOOK, signature

    # ------------------------------------------------------------------ submission
    async def submit(
        self, raw_body: bytes, signature: Signature | None = None, principal: Principal = WEBHOOK
    ) -> FeedbackResult:
        """Store the body's items; a signed request's signature is recorded in the same transaction."""
        items, batched = decode_items(raw_body)
        try:
            async with self.database.session() as session:
                if signature is not None and not await record_signature(
                    session, signature.mac, signature.timestamp
                ):
                    raise AuthenticationError(
                        "this signed request was already received", code="replayed_signature"
                    )
                result = await self._store(session, items, batched, principal)
                await session.commit()
        except (OperationalError, OSError, ConnectionError) as exc:
            raise self._unavailable(exc) from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise self._unavailable(exc) from exc
            raise
        if self.on_stored is not None:
            self.on_stored(["duplicate" if item.duplicate else item.status for item in result.items])
        return result

    @staticmethod
    def _unavailable(exc: BaseException) -> APIError:
        log.warning("feedback refused, database unreachable: %s", exc)
        return ServiceUnavailable(
            "the database is unreachable; retry with the same idempotency_key",
            code="database_unavailable",
            retry_after=5.0,
        )

    async def _store(
        self, session: AsyncSession, items: list[FeedbackItem], batched: bool, principal: Principal
    ) -> FeedbackResult:
        # Everything is validated before anything is written: a bad item rejects the whole batch.
        keys = [item.idempotency_key for item in items if item.idempotency_key]
        stored = await stored_by_key(session, keys)
        prepared: list[NewReward | RewardInfo] = []
        for index, item in enumerate(items):
            prefix = f"items[{index}]." if batched else ""
            if item.idempotency_key and item.idempotency_key in stored:
                prepared.append(stored[item.idempotency_key])
                continue
            target = await self._target(session, item, prefix, principal)
            try:
                config = (await policy_reward_config(session, target.policy)).feedback
            except InvalidPolicyConfig as exc:
                raise APIError(str(exc), status_code=500, code="invalid_policy_config") from exc
            value, label = to_number(item.value, config, prefix + "value")
            comment, metadata, name = item.comment, item.metadata, item.name
            redactor = self.redactor(target.policy)
            if redactor is not None:
                comment = redactor.text(comment) if comment else comment
                metadata = redactor.value(metadata)
                name = redactor.text(name)[
                    :REWARD_NAME_LENGTH
                ]  # a hashed value can outgrow the one it replaces
            prepared.append(
                NewReward(
                    source="feedback",
                    value=value,
                    call_id=target.call_id,
                    episode_id=target.episode_id,
                    name=name,
                    label=label,
                    comment=comment,
                    metadata=metadata,
                    idempotency_key=item.idempotency_key,
                    status=target.status,
                    key_id=principal.key_id,
                    project=None if principal.all_projects else principal.project,
                )
            )
        fresh = [p for p in prepared if isinstance(p, NewReward)]
        inserted = iter(await insert_rewards(session, fresh))
        results: list[StoredFeedback] = []
        linked_episodes: set[str] = set()
        for entry in prepared:
            if isinstance(entry, NewReward):
                info, new = next(inserted)
            else:
                info, new = entry, False
            if new and info.status == "linked" and info.episode_id:
                linked_episodes.add(info.episode_id)
            results.append(
                StoredFeedback(
                    info.id, info.call_id, info.episode_id, info.value, info.status, duplicate=not new
                )
            )
        await refresh_episode_rewards(session, linked_episodes)
        return FeedbackResult([r.id for r in results], results)

    async def _target(
        self, session: AsyncSession, item: FeedbackItem, prefix: str, principal: Principal
    ) -> _Target:
        if (item.request_id is None) == (item.episode_id is None):
            raise InvalidRequest(
                "give exactly one of request_id and episode_id",
                param=prefix + "request_id",
                code="invalid_target",
            )
        name, ident = ("request_id", item.request_id) if item.request_id else ("episode_id", item.episode_id)
        assert ident is not None
        if not valid_id(ident):
            raise InvalidRequest(
                f"{name} must be 1-64 characters of letters, digits, '_', '.', ':' or '-'",
                param=prefix + name,
                code="invalid_target",
            )
        if item.request_id is not None:
            if RESPONSE_ID.match(ident):  # a `/v1/responses` id names its call: `resp_<call id>`
                ident = ident.removeprefix("resp_")
            # A server id names its call; a client's own id names the newest call that carried it.
            call_id = self.recent.newest(ident) or ident
            stored = await find_call(session, call_id)
            if stored is not None:
                if not principal.sees(stored[3]):
                    raise self._not_yours(prefix + name, "call", ident)
                return _Target("linked", stored[1], stored[2], stored[0])
            recent = self.recent.call(call_id)
            if recent is not None:  # episode linked when written: stitching may still change it
                return _Target("pending", None, recent[1], call_id)
            await self._within_grace(session, prefix + name, call_id=ident)
            return _Target("pending", None, None, ident)
        project, policy = await episode_policy(session, ident)
        if project is not None:
            if not principal.sees(project):
                raise self._not_yours(prefix + name, "episode", ident)
            return _Target("linked", ident, policy)
        known, policy = self.recent.episode(ident)
        if not known:
            await self._within_grace(session, prefix + name, episode_id=ident)
        return _Target("pending", ident, policy)

    @staticmethod
    def _not_yours(param: str, kind: str, ident: str) -> NotFound:
        """Another project's call or episode: answered like an id that was never written."""
        return NotFound(f"unknown {kind} {ident!r}", param=param, code="unknown_target")

    async def _within_grace(
        self, session: AsyncSession, param: str, *, call_id: str | None = None, episode_id: str | None = None
    ) -> None:
        """Refuse feedback for an id that earlier feedback named more than the grace period ago, still unknown."""
        first = await oldest_unlinked(session, call_id=call_id, episode_id=episode_id)
        if first is not None and first < datetime.now(UTC) - timedelta(seconds=self.grace_s):
            raise NotFound(
                f"unknown {'call' if call_id else 'episode'} {call_id or episode_id!r}: feedback for it has "
                f"waited more than {self.grace_s:g} s and it was never written",
                param=param,
                code="unknown_target",
            )

    # ------------------------------------------------------------------ late linking
    async def link(self) -> set[str]:
        """Link early feedback whose target is now stored, re-derive those episodes' rewards, flag orphans."""
        async with self.database.session() as session:
            episodes = await link_pending(session)
            await refresh_episode_rewards(session, episodes)
            orphaned = await mark_orphans(session, datetime.now(UTC) - timedelta(seconds=self.grace_s))
            await forget_signatures(session, int(time.time() - self.tolerance_s) - 1)
            await session.commit()
        if orphaned:
            log.warning(
                "%d feedback items are orphaned: their target was not written in %g s", orphaned, self.grace_s
            )
        return episodes

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="feedback-linker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.link_interval_s)
            try:
                await self.link()
            except Exception as exc:  # the database may be down; the next round retries
                log.warning("could not link early feedback: %s", exc)
