"""Bearer keys: who sends a request, what it may do (scopes), and which project's data it sees.

Keys come from two places. The environment (`KAIZEN_API_KEYS`, `KAIZEN_ADMIN_KEY`) gives keys of the built-in
project with every client scope, and the admin key. Managed keys live in the `api_keys` table as SHA-256
digests of their secrets, with a name, scopes, a project and optionally the models they may call; every
gateway keeps them in memory and re-reads them every `KAIZEN_POLICY_REFRESH_S`, so a revocation reaches every
replica within that interval and the request path never queries the database. A key is found by the digest
of the presented secret (a dict lookup): the digest of a high-entropy secret tells nothing about its neighbours,
so no constant-time scan of every key is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from litestar.connection import ASGIConnection, Request
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.errors import APIError, AuthenticationError, InvalidRequest, PermissionDenied, ServiceUnavailable
from storage.database import Database
from storage.keys import KeyInfo, insert_key, list_keys
from storage.logouts import logged_out
from storage.models import DEFAULT_PROJECT

log = logging.getLogger(__name__)

Scope = Literal["chat", "feedback", "read", "admin"]
SCOPES: tuple[str, ...] = get_args(Scope)
CLIENT_SCOPES = frozenset({"chat", "feedback", "read"})
_STATE_KEY = "kaizen.principal"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """The sender of a request, as its key describes it."""

    key_id: str  # a managed key's id; `env` (environment keys), `admin-key`, or `open` (no keys configured)
    name: str
    scopes: frozenset[str]
    project: str  # what its calls are recorded under
    models: frozenset[str] | None = None  # models/policies it may call; None: any
    all_projects: bool = False  # admin keys read and reward every project's episodes

    @property
    def actor(self) -> str:
        """How the audit log names it."""
        return (
            self.key_id
            if self.key_id in ("admin-key", "env", "open", "webhook")
            else f"{self.key_id} ({self.name})"
        )

    def sees(self, project: str) -> bool:
        return self.all_projects or project == self.project

    def may_use(self, model: str, policy: str | None) -> bool:
        return self.models is None or model in self.models or (policy is not None and policy in self.models)

    def acting_on(self, owner: str | None) -> Principal | None:
        """Who this key's calls to a policy owned by `owner` (None: shared) are made and recorded as; None: it
        may not call it. Admin keys may, and their calls are recorded under the owner, whose episodes alone
        such a policy trains on."""
        if owner is None or owner == self.project:
            return self
        if self.all_projects:
            return replace(self, project=owner)
        return None


OPEN = Principal("open", "open", CLIENT_SCOPES, DEFAULT_PROJECT)
WEBHOOK = Principal("webhook", "webhook", frozenset({"feedback"}), DEFAULT_PROJECT, all_projects=True)
"""A request signed with the feedback webhook secret: a trusted backend, not bound to one project."""


def _managed(key: KeyInfo) -> Principal:
    models = None if key.models is None else frozenset(key.models)
    scopes = frozenset(key.scopes)
    return Principal(key.id, key.name, scopes, key.project, models, all_projects="admin" in scopes)


class KeyRing:
    """Every accepted key, by the digest of its secret. With no client key at all, /v1 is open.

    Until the managed keys have been read once, the ring does not know whether it is open: a key it cannot find
    may be a managed one, and an empty table cannot be told from an unreadable one. Such a request is refused
    with a 503 (`KeysUnavailable`) rather than let in as `open`, so a database that is down while a gateway
    starts never opens it; environment keys and the admin key work meanwhile."""

    def __init__(self, client_keys: Iterable[str], admin_key: str = "") -> None:
        self._static: dict[str, Principal] = {
            digest(k): Principal("env", "env", CLIENT_SCOPES, DEFAULT_PROJECT) for k in client_keys if k
        }
        if admin_key:
            self._static[digest(admin_key)] = Principal(
                "admin-key", "admin-key", frozenset(SCOPES), DEFAULT_PROJECT, all_projects=True
            )
        self._closed = any(p.key_id == "env" for p in self._static.values())
        self._keys: dict[str, Principal] = dict(self._static)
        self._loaded = False  # the managed keys were read at least once
        self._ended: frozenset[str] = frozenset()
        self._ended_here: dict[str, float] = {}  # logouts through this process, until a refresh reads them
        self._task: asyncio.Task[None] | None = None

    @property
    def open(self) -> bool:
        """No client key was ever configured (environment or managed; revoked ones count, so revoking the
        last key does not open the gateway): /v1 and feedback accept anyone, as before keys existed."""
        return self._loaded and not self._closed

    @property
    def loaded(self) -> bool:
        """Whether the managed keys were read from the database at least once."""
        return self._loaded

    @property
    def admin_enabled(self) -> bool:
        return any("admin" in p.scopes for p in self._keys.values())

    def lookup(self, authorization: str | None) -> Principal | None:
        if authorization is None or not authorization.startswith("Bearer "):
            return None
        return self._keys.get(digest(authorization[7:].strip()))

    def by_digest(self, key_digest: str) -> Principal | None:
        """The principal of the key whose secret has this SHA-256 (a dashboard session names its key so)."""
        return self._keys.get(key_digest)

    def load(self, keys: Sequence[KeyInfo], ended_sessions: Iterable[str] = ()) -> None:
        """Replace the managed keys with these (revoked ones are refused), environment keys staying, and the
        dashboard sessions ended by a logout with these."""
        fresh = {k.hash: _managed(k) for k in keys if k.revoked_at is None}
        self._keys = {**fresh, **self._static}
        self._closed = self._closed or bool(keys)
        self._loaded = True
        self._ended = frozenset(ended_sessions)
        now = time.time()
        self._ended_here = {
            nonce: expires
            for nonce, expires in self._ended_here.items()
            if nonce not in self._ended and expires > now
        }

    def session_ended(self, nonce: str) -> bool:
        """Whether the dashboard session with this nonce was ended by a logout (on any replica)."""
        return nonce in self._ended or nonce in self._ended_here

    def end_session(self, nonce: str, expires: float) -> None:
        """A logout through this process: refused here at once (even by a refresh that read the list just
        before it was stored), elsewhere from their next refresh."""
        self._ended_here[nonce] = expires

    async def refresh(self, database: Database) -> None:
        try:
            async with database.session() as session:
                keys = await list_keys(session)
                ended = await logged_out(session)
        except Exception as exc:  # keep the last known keys; the next round retries
            log.warning("could not read API keys: %s", exc)
            return
        self.load(keys, ended)

    async def start(self, database: Database, interval_s: float) -> None:
        await self.refresh(database)

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                await self.refresh(database)

        self._task = asyncio.create_task(loop(), name="key-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class KeysUnavailable(ServiceUnavailable):
    """The managed keys have not been read yet (the database was unreachable since start-up): whether the
    request's key is valid cannot be told, so it is neither let in nor refused as invalid."""

    def __init__(self) -> None:
        super().__init__(
            "The gateway has not read its API keys from the database yet; retry shortly.",
            code="keys_unavailable",
            retry_after=2.0,
        )


def authenticate_client(ring: KeyRing, authorization: str | None, scope: str) -> Principal:
    """The principal of a /v1 request that needs `scope`: 401 without a known key, 403 without the scope, 503
    while the keys are unknown."""
    principal = ring.lookup(authorization)
    if principal is None:
        if not ring.loaded:
            raise KeysUnavailable()
        if ring.open:
            return OPEN
        raise AuthenticationError(
            "Missing or invalid API key. Send `Authorization: Bearer <key>`.", code="invalid_api_key"
        )
    return _with_scope(principal, scope)


def _with_scope(principal: Principal, scope: str) -> Principal:
    if scope not in principal.scopes:
        raise PermissionDenied(f"This key lacks the `{scope}` scope needed here.", code="insufficient_scope")
    return principal


def requires(scope: Scope) -> Guard:
    """A guard that authenticates the request and checks `scope`; the principal is kept in the request scope."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        _authenticate(connection, scope)

    guard.__name__ = f"requires_{scope}"
    return guard


def authenticates(scope: Scope) -> Callable[[Request[Any, Any, Any]], Awaitable[None]]:
    """`requires` as a before-request hook, for the chat route: Litestar hands each guard a copy of the route
    handler (13 µs a call on the reference machine), a hook only the request. Both run before the body is read
    and their errors get the same answers. Async, as Litestar runs a synchronous hook in a worker thread."""

    async def hook(request: Request[Any, Any, Any]) -> None:
        _authenticate(request, scope)

    hook.__name__ = f"authenticates_{scope}"
    return hook


def _authenticate(connection: ASGIConnection[Any, Any, Any, Any], scope: Scope) -> None:
    ring: KeyRing = connection.app.state.key_ring
    authorization = connection.headers.get("authorization")
    if scope == "admin":
        if not ring.admin_enabled:
            raise AuthenticationError(
                "Admin routes are disabled: set KAIZEN_ADMIN_KEY.", code="admin_disabled"
            )
        throttle: LoginThrottle = connection.app.state.login_throttle
        found = counted_lookup(ring, throttle, client_address(connection), authorization)
        if found is None:
            raise AuthenticationError("Missing or invalid admin key.", code="invalid_admin_key")
        principal = _with_scope(found, scope)
    else:
        principal = authenticate_client(ring, authorization, scope)
    set_principal(connection, principal)


def set_principal(connection: ASGIConnection[Any, Any, Any, Any], principal: Principal) -> None:
    """Record who sent the request, for `principal_of` (guards call it once they authenticated it)."""
    connection.scope.setdefault("state", {})[_STATE_KEY] = principal


def principal_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    """The principal a guard established for this request."""
    return principal_in(connection.scope)


def principal_in(scope: Mapping[str, Any]) -> Principal:
    """The principal a guard established for the request of this ASGI scope (a mounted app's handlers)."""
    principal: Principal = scope["state"][_STATE_KEY]
    return principal


class LoginThrottle:
    """Failed logins per client address, in this process's memory: an address that failed `limit` times
    within `window_s` is refused (right key or not) until the oldest of those failures is `window_s` old.
    A login is anything the admin key opens: the dashboard's form, /admin and /metrics, counted together.
    Each replica counts on its own, like the rate limits; at most `max_addresses` addresses are remembered."""

    def __init__(
        self,
        limit: int,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 10_000,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self.max_addresses = max_addresses
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, address: str, now: float) -> deque[float] | None:
        failures = self._failures.get(address)
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        if failures is not None and not failures:
            del self._failures[address]
            return None
        return failures

    def retry_after(self, address: str) -> float | None:
        """Seconds until this address may try again; None when it may now (or throttling is off)."""
        if self.limit <= 0:
            return None
        now = self.clock()
        failures = self._recent(address, now)
        if failures is None or len(failures) < self.limit:
            return None
        return failures[-self.limit] + self.window_s - now

    def failed(self, address: str) -> None:
        if self.limit <= 0:
            return
        now = self.clock()
        if address not in self._failures and len(self._failures) >= self.max_addresses:
            for known in list(self._failures):  # forget addresses whose failures are all old
                self._recent(known, now)
            if len(self._failures) >= self.max_addresses:  # still full: the oldest entry goes
                del self._failures[next(iter(self._failures))]
        failures = self._failures.setdefault(address, deque())
        failures.append(now)
        while len(failures) > self.limit:
            failures.popleft()

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)


def refuse_throttled(throttle: LoginThrottle, address: str) -> None:
    """429 for an address that failed too many logins lately, whatever key it sends now: answering a right
    key differently would let the guessing go on."""
    wait = throttle.retry_after(address)
    if wait is not None:
        raise APIError(
            f"Too many failed logins from this address; try again in {math.ceil(wait)} s.",
            status_code=429,
            code="too_many_failed_logins",
            retry_after=wait,
        )


def counted_lookup(
    ring: KeyRing, throttle: LoginThrottle, address: str, authorization: str | None
) -> Principal | None:
    """The principal of a key presented where the admin key opens the door (/admin, /metrics, the dashboard's
    login): an address that failed too often is refused first, a key that is not known counts as a failure
    (a request that presents none does not: a browser opening the URL, a scraper not set up yet), and
    while the keys are unread the answer is 503, after the failure was counted."""
    refuse_throttled(throttle, address)
    found = ring.lookup(authorization)
    if found is None:
        if authorization is not None and authorization.startswith("Bearer ") and authorization[7:].strip():
            throttle.failed(address)
        if not ring.loaded:
            raise KeysUnavailable()
    return found


def client_address(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    return connection.client.host if connection.client is not None else ""


# ---------------------------------------------------------------------------------------------- key management
def new_secret() -> str:
    """A key secret: 256 random bits, URL-safe, with a recognisable prefix."""
    return "kz-" + secrets.token_urlsafe(32)


def check_key_fields(name: str, scopes: Sequence[str], project: str) -> None:
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown or not scopes:
        raise InvalidRequest(
            f"scopes must be a non-empty subset of {', '.join(SCOPES)}; unknown: {', '.join(unknown) or '-'}",
            param="scopes",
            code="invalid_value",
        )
    for param, value in (("name", name), ("project", project)):
        if not value or len(value) > 128 or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise InvalidRequest(
                f"{param} must be 1-128 characters without control characters",
                param=param,
                code="invalid_value",
            )


async def create_key(
    session: AsyncSession,
    name: str,
    scopes: Sequence[str],
    project: str = DEFAULT_PROJECT,
    models: Sequence[str] | None = None,
) -> tuple[KeyInfo, str]:
    """Store a new key (its digest only) in the session's transaction; returns it and its secret, which is
    shown this once. Raises `InvalidRequest` for unknown scopes or bad names."""
    check_key_fields(name, scopes, project)
    secret = new_secret()
    key = KeyInfo(
        id="key_" + secrets.token_hex(8),
        name=name,
        prefix=secret[:10],
        hash=digest(secret),
        scopes=sorted(set(scopes)),
        project=project,
        models=None if models is None else sorted(set(models)),
        created_at=datetime.now(UTC),
        revoked_at=None,
    )
    await insert_key(session, key)
    return key, secret
