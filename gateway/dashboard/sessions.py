"""Dashboard logins: a signed, expiring session cookie naming the key that logged in, and CSRF tokens (failed
logins are throttled by `gateway.auth.LoginThrottle`).

The cookie holds the SHA-256 of the key (as `api_keys` stores it), an expiry and a random nonce, signed with
HMAC-SHA256 under the dashboard secret, so any replica with the same secret accepts it. Every request looks
the key up in the key ring again, so revoking the key (or dropping its `admin` scope) ends its sessions on
every replica within `KAIZEN_POLICY_REFRESH_S`; a logout stores the session's nonce (`dashboard_logouts`),
which the key ring reads with the keys, so a copy of the cookie stops working on every replica within the
same interval (at once on the one that logged out), without a database read per page. The cookie is
HttpOnly, SameSite=Strict and scoped to /dashboard; state-changing requests must also carry the session's CSRF
token in a header, which only the dashboard's own pages know.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from gateway.auth import KeyRing, Principal, set_principal
from gateway.errors import AuthenticationError, PermissionDenied

COOKIE = "kaizen_dashboard"
COOKIE_PATH = "/dashboard"
CSRF_HEADER = "x-kaizen-csrf"
_SESSION_STATE = "kaizen.dashboard_session"
_SAFE_METHODS = frozenset({"GET", "HEAD"})


class LoginRequired(Exception):
    """A page was asked for without a valid session."""


@dataclass(frozen=True)
class DashboardSession:
    key_digest: str  # SHA-256 of the key that logged in
    expires: int  # Unix seconds
    nonce: str  # per login: the CSRF token is derived from it


class _Payload(msgspec.Struct, array_like=True):
    key_digest: str
    expires: int
    nonce: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionSigner:
    """Issues and verifies session cookies and their CSRF tokens under one secret."""

    def __init__(self, secret: Callable[[], bytes], ttl_s: float, *, secure: bool) -> None:
        self._load_secret = secret  # read on first use: building the app touches no file
        self._secret: bytes | None = None
        self.ttl_s = ttl_s
        self.secure = secure

    def _mac(self, purpose: bytes, data: bytes) -> bytes:
        if self._secret is None:
            self._secret = self._load_secret()
        return hmac.new(self._secret, purpose + b"\x00" + data, hashlib.sha256).digest()

    def issue(self, key_digest: str) -> str:
        """A cookie value for a login by the key with this digest."""
        payload = msgspec.msgpack.encode(
            _Payload(key_digest, int(time.time() + self.ttl_s), secrets.token_urlsafe(16))
        )
        return f"{_b64(payload)}.{_b64(self._mac(b'session', payload))}"

    def read(self, value: str | None) -> DashboardSession | None:
        """The session of a cookie value, or None if it is missing, altered, malformed or expired."""
        if not value or value.count(".") != 1 or len(value) > 1024:
            return None
        encoded, mac = value.split(".")
        try:
            payload = _unb64(encoded)
            valid = hmac.compare_digest(_unb64(mac), self._mac(b"session", payload))
            decoded = msgspec.msgpack.decode(payload, type=_Payload) if valid else None
        except (ValueError, msgspec.DecodeError):
            return None
        if decoded is None or decoded.expires <= time.time():
            return None
        return DashboardSession(decoded.key_digest, decoded.expires, decoded.nonce)

    def csrf_token(self, session: DashboardSession) -> str:
        return _b64(self._mac(b"csrf", session.nonce.encode()))

    def cookie(self, value: str) -> Cookie:
        return Cookie(
            key=COOKIE,
            value=value,
            path=COOKIE_PATH,
            max_age=math.ceil(self.ttl_s),
            httponly=True,
            samesite="strict",
            secure=self.secure,
        )

    def cleared_cookie(self) -> Cookie:
        return Cookie(
            key=COOKIE,
            value="",
            path=COOKIE_PATH,
            max_age=0,
            httponly=True,
            samesite="strict",
            secure=self.secure,
        )


def _same_origin(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """A browser names the page that sent a request in `Origin`; the dashboard accepts writes from itself only."""
    origin = connection.headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-origin request (browsers send Origin on every such POST)
    host = connection.headers.get("host", "")
    return origin.split("://", 1)[-1] == host


def requires_login(*, page: bool) -> Guard:
    """A guard for dashboard routes: a valid session of a key with the `admin` scope, and for writes the
    session's CSRF token and a same-origin request. Pages without a session redirect to the login page;
    fetches get a 401 in OpenAI's shape."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        signer: SessionSigner = connection.app.state.dashboard_signer
        ring: KeyRing = connection.app.state.key_ring
        session = signer.read(connection.cookies.get(COOKIE))
        if session is not None and ring.session_ended(session.nonce):
            session = None  # logged out: a copy of the cookie is no session either
        principal: Principal | None = ring.by_digest(session.key_digest) if session is not None else None
        if session is None or principal is None or "admin" not in principal.scopes:
            if page:
                raise LoginRequired
            raise AuthenticationError("Log in to the dashboard first.", code="login_required")
        if isinstance(connection, Request) and connection.method not in _SAFE_METHODS:
            token = connection.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(token.encode(), signer.csrf_token(session).encode()):
                raise PermissionDenied("Missing or wrong CSRF token.", code="csrf_failed")
            if not _same_origin(connection):
                raise PermissionDenied("Cross-origin request refused.", code="cross_origin")
        set_principal(connection, principal)
        connection.scope["state"][_SESSION_STATE] = session

    guard.__name__ = "requires_dashboard_login_page" if page else "requires_dashboard_login"
    return guard


def session_of(connection: ASGIConnection[Any, Any, Any, Any]) -> DashboardSession:
    """The session a guard established for this request."""
    session: DashboardSession = connection.scope["state"][_SESSION_STATE]
    return session
