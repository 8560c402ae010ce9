"""Bearer-key checks. Keys are kept only as SHA-256 digests and compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import AuthenticationError


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """A set of accepted keys. Empty means open (no key required)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [digest(k) for k in keys if k]

    @property
    def open(self) -> bool:
        return not self._digests

    def accepts(self, authorization: str | None) -> bool:
        if authorization is None or not authorization.startswith("Bearer "):
            return False
        candidate = digest(authorization[7:].strip())
        # Compare against every key so the time taken does not depend on which one matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(candidate, known)
        return matched


async def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    ring: KeyRing = connection.app.state.api_keys
    if not ring.open and not ring.accepts(connection.headers.get("authorization")):
        raise AuthenticationError(
            "Missing or invalid API key. Send `Authorization: Bearer <key>`.", code="invalid_api_key"
        )


async def require_admin_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    ring: KeyRing = connection.app.state.admin_key
    if ring.open:
        raise AuthenticationError("Admin routes are disabled: set KAIZEN_ADMIN_KEY.", code="admin_disabled")
    if not ring.accepts(connection.headers.get("authorization")):
        raise AuthenticationError("Missing or invalid admin key.", code="invalid_admin_key")
