"""Per-key rate limits: requests and tokens per window, enforced in this process.

Each caller has up to two token buckets. The requests bucket holds `rpm` units and refills continuously at
`rpm / window` per second; a call takes one unit and is refused while less than one is left. The tokens bucket
holds `tpm` units and refills the same way; a chat call is admitted while at least one token is left and its
real usage (prompt plus completion tokens, from the engine's `usage`) is subtracted after it finished. Nothing is
estimated before the call, so the bucket may go below zero: a caller that overspent waits until the refill has
paid the debt back. Continuous refill (rather than fixed windows) makes `Retry-After` exact, so a client that
waits that long is admitted.

The buckets live in this process's memory: with several replicas each enforces the limit on its own, so a key
gets up to `replicas x limit`. That is deliberate: the hot path never waits on the database or another replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import KeyRing, digest
from gateway.bare_asgi import send_json
from gateway.protocol import ErrorBody, ErrorResponse
from gateway.settings import Settings

# Where the middleware leaves the admitted caller's token meter for the chat handler (in the ASGI scope's state).
METER_STATE_KEY = "kaizen_token_meter"
# Route handlers whose calls spend engine tokens carry this in their `opt`; only they are refused for tokens.
SPENDS_TOKENS = "rate_limit_tokens"
# Below one unit by at most this much still counts as one: refill arithmetic in floats must not turn an
# exact `Retry-After` into a second refusal.
_EPSILON = 1e-9
_encode = msgspec.json.Encoder().encode

LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True)
class Limits:
    """Units per window for one caller; 0 means unlimited."""

    requests: int
    tokens: int


def caller_identity(authorization: str | None, client_host: str | None, keys: KeyRing) -> str:
    """The stable name of the bucket a request counts against.

    A key the gateway knows is named by a short SHA-256 prefix (the key itself is never kept); any other request
    counts against its client address. An unknown token is no identity: an open gateway accepts any, and a
    closed one refuses it, so a new token per request must not buy a new bucket (unlimited calls, or unlimited
    guesses at a key). This is the one place that decides who a caller is.
    """
    if authorization is not None and authorization[:7].lower() == "bearer ":
        token = authorization[7:].strip()
        key_digest = digest(token)  # one hash: it finds the key and names its bucket
        if token and keys.by_digest(key_digest) is not None:
            return "key-" + key_digest[:16]
    return "anon-" + (client_host or "unknown")


class Bucket:
    """A continuously refilling token bucket. Its level may go negative (tokens are charged after the call)."""

    __slots__ = ("capacity", "level", "limit_header", "rate", "stamp")

    def __init__(self, capacity: int, window_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / window_s
        self.level = float(capacity)
        self.stamp = now
        self.limit_header = str(capacity).encode()

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(float(self.capacity), self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    @property
    def available(self) -> bool:
        return self.level >= 1 - _EPSILON

    def wait_s(self) -> float:
        """Seconds until one unit is available again."""
        return max(0.0, (1 - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
        return max(0.0, (self.capacity - self.level) / self.rate)

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level + _EPSILON))


class Caller:
    """The buckets of one caller (absent where its limit is off)."""

    __slots__ = ("requests", "tokens")

    def __init__(self, limits: Limits, window_s: float, now: float) -> None:
        self.requests = Bucket(limits.requests, window_s, now) if limits.requests else None
        self.tokens = Bucket(limits.tokens, window_s, now) if limits.tokens else None

    def idle(self, now: float) -> bool:
        """Both buckets full: forgetting this caller changes nothing."""
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)
                if bucket.level < bucket.capacity:
                    return False
        return True

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's `x-ratelimit-*` headers for the limits that are set (ASGI header pairs)."""
        out: list[tuple[bytes, bytes]] = []
        if (bucket := self.requests) is not None:
            out += (
                (b"x-ratelimit-limit-requests", bucket.limit_header),
                (b"x-ratelimit-remaining-requests", b"%d" % bucket.remaining),
                (b"x-ratelimit-reset-requests", duration(bucket.reset_s()).encode()),
            )
        if (bucket := self.tokens) is not None:
            out += (
                (b"x-ratelimit-limit-tokens", bucket.limit_header),
                (b"x-ratelimit-remaining-tokens", b"%d" % bucket.remaining),
                (b"x-ratelimit-reset-tokens", duration(bucket.reset_s()).encode()),
            )
        return out


class Verdict(NamedTuple):
    """The outcome of `RateLimiter.admit`: `refused` names the exhausted limit, None when admitted."""

    caller: Caller
    refused: LimitKind | None = None
    retry_after_s: float = 0.0


class RateLimiter:
    """Admits or refuses calls per caller, and charges the tokens an admitted call used."""

    def __init__(
        self,
        limits: Limits,
        *,
        window_s: float,
        overrides: Mapping[str, Limits] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_idle_callers: int = 100_000,
    ) -> None:
        self.limits = limits
        self.window_s = window_s
        self.overrides = dict(overrides or {})
        self.clock = clock
        self._callers: dict[str, Caller] = {}
        self._max_idle_callers = max_idle_callers
        self._prune_at = max_idle_callers

    @property
    def enabled(self) -> bool:
        return any(limit.requests or limit.tokens for limit in (self.limits, *self.overrides.values()))

    def limits_of(self, identity: str) -> Limits:
        return self.overrides.get(identity, self.limits)

    def admit(self, identity: str, *, spends_tokens: bool) -> Verdict:
        """Take one request unit, unless a limit is exhausted; then nothing is taken and the verdict says
        which limit and how long until the call would be admitted."""
        now = self.clock()
        caller = self._callers.get(identity)
        if caller is None:
            caller = self._add(identity, now)
        requests, tokens = caller.requests, caller.tokens
        wait: float = 0.0
        refused: LimitKind | None = None
        if requests is not None:
            requests.refill(now)
            if not requests.available:
                wait, refused = requests.wait_s(), "requests"
        if tokens is not None and spends_tokens:
            tokens.refill(now)
            # Refused for the limit that frees up last, so a client waiting `Retry-After` is then admitted.
            if not tokens.available and tokens.wait_s() >= wait:
                wait, refused = tokens.wait_s(), "tokens"
        if refused is not None:
            return Verdict(caller, refused, wait)
        if requests is not None:
            requests.level -= 1
        return Verdict(caller)

    def charge(self, caller: Caller, tokens: int) -> None:
        """Subtract the tokens an admitted call used (it may leave the bucket below zero)."""
        bucket = caller.tokens
        if bucket is not None and tokens > 0:
            bucket.refill(self.clock())
            bucket.level -= tokens

    def _add(self, identity: str, now: float) -> Caller:
        if len(self._callers) >= self._prune_at:
            # Callers whose buckets are full again hold no state worth keeping (e.g. one-off bogus keys).
            self._callers = {name: c for name, c in self._callers.items() if not c.idle(now)}
            self._prune_at = max(self._max_idle_callers, 2 * len(self._callers))
        caller = self._callers[identity] = Caller(self.limits_of(identity), self.window_s, now)
        return caller


def duration(seconds: float) -> str:
    """A duration as OpenAI writes it in `x-ratelimit-reset-*` headers: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def _window(window_s: float) -> str:
    return "minute" if window_s == 60 else f"{duration(window_s)} window"


def refusal(identity: str, verdict: Verdict, limiter: RateLimiter) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The 429 body (OpenAI's shape: type `requests` or `tokens`, code `rate_limit_exceeded`) and its headers."""
    assert verdict.refused is not None
    limits = limiter.limits_of(identity)
    limit = limits.requests if verdict.refused == "requests" else limits.tokens
    wait = verdict.retry_after_s
    message = (
        f"Rate limit reached for {identity} on {verdict.refused} per {_window(limiter.window_s)}: "
        f"limit {limit}. Please try again in {duration(wait)}."
    )
    body = _encode(ErrorResponse(ErrorBody(message, verdict.refused, None, "rate_limit_exceeded")))
    headers = [
        (b"retry-after", b"%d" % max(1, math.ceil(wait))),
        (b"retry-after-ms", b"%d" % max(1, math.ceil(wait * 1000))),
        *verdict.caller.headers(),
    ]
    return body, headers


def token_meter(scope: Scope) -> Callable[[int], None] | None:
    """What the chat service calls with a finished call's token usage; None when tokens are not limited."""
    meter: Callable[[int], None] | None = scope["state"].get(METER_STATE_KEY)
    return meter


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def spends_tokens_by_route(scope: Scope) -> bool:
    """Whether the Litestar route handler a request matched is marked as spending engine tokens."""
    return bool(scope["route_handler"].opt.get(SPENDS_TOKENS))


def rate_limit_middleware(
    limiter: RateLimiter, keys: KeyRing, spends_tokens: Callable[[Scope], bool] = spends_tokens_by_route
) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware for the /v1 routes: refuses over-limit calls with a 429 before the handler runs (so a
    refused call writes nothing), and adds the `x-ratelimit-*` headers to every answer it lets through.
    `spends_tokens`: whether the request's route is refused for tokens (the chat route's is, without Litestar)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            client = scope.get("client")
            identity = caller_identity(_header(scope, b"authorization"), client[0] if client else None, keys)
            spends = spends_tokens(scope)
            verdict = limiter.admit(identity, spends_tokens=spends)
            caller = verdict.caller
            if verdict.refused is not None:
                body, headers = refusal(identity, verdict, limiter)
                await send_json(send, 429, body, headers)
                return
            if spends and caller.tokens is not None:
                scope["state"][METER_STATE_KEY] = lambda used: limiter.charge(caller, used)
            extra = caller.headers()

            async def send_with_headers(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}  # type: ignore[typeddict-item]
                await send(message)

            await app(scope, receive, send_with_headers)

        return middleware

    return wrap


def limiter_from_settings(settings: Settings) -> RateLimiter:
    """The process's limiter: the default limits, and a caller's own where `rate_limit_keys` names it."""
    default = Limits(settings.rate_limit_rpm, settings.rate_limit_tpm)
    overrides = {
        identity: Limits(
            default.requests if own.rpm is None else own.rpm,
            default.tokens if own.tpm is None else own.tpm,
        )
        for identity, own in settings.rate_limit_keys.items()
    }
    return RateLimiter(default, window_s=settings.rate_limit_window_s, overrides=overrides)
