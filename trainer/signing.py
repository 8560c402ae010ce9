"""HMAC-SHA256 signatures of webhook bodies, shared by incoming feedback and outgoing scoring webhooks.

Header format (like Stripe's): ``X-Kaizen-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">``.
Signing the timestamp with the body lets the receiver refuse old (replayed) requests.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "X-Kaizen-Signature"


class SignatureError(ValueError):
    """The signature is missing, malformed, wrong or outside the replay window."""


def signature(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header value for `body`, signed now (or at `timestamp`)."""
    ts = int(time.time()) if timestamp is None else timestamp
    return f"t={ts},v1={signature(secret, ts, body)}"


def verify(
    secret: str, header: str | None, body: bytes, *, tolerance_s: float, now: float | None = None
) -> int:
    """Check a header against `body`; returns its timestamp. Constant-time comparison of every `v1` given."""
    if not header:
        raise SignatureError(f"missing {HEADER} header")
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isdigit():
            timestamp = int(value)
        elif key == "v1" and value:
            candidates.append(value.lower())
    if timestamp is None or not candidates:
        raise SignatureError(f"malformed {HEADER} header: expected t=<unix seconds>,v1=<hex>")
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise SignatureError(f"signature timestamp is outside the {tolerance_s:g} s replay window")
    expected = signature(secret, timestamp, body)
    matched = False
    for candidate in candidates:  # no early exit: time does not depend on which one matched
        matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError("signature does not match the body")
    return timestamp
