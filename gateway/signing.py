"""HMAC-SHA256 signatures of feedback webhook bodies: signing, and the gateway's verification of them.

Header format: ``X-Kaizen-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">``. Signing the
timestamp with the body lets the receiver refuse old requests. Several ``v1`` values may be sent (a sender
rotating its secret); unknown fields are ignored; a second ``t`` is refused as ambiguous.

A request's identity for replay protection is the parsed timestamp and the MAC the gateway computes itself
(`Signature.mac`), never the header text: spacing, field order, leading zeros, hex case or extra fields do not
make the same signed request new. The trainer signs its outgoing scoring webhooks in the same format with its
own few lines (`trainer/control/scoring.py`), because the trainer must not import the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

HEADER = "X-Kaizen-Signature"
_HEX = frozenset("0123456789abcdef")


class SignatureError(ValueError):
    """The signature is missing, malformed, wrong or outside the replay window."""


@dataclass(frozen=True)
class Signature:
    """A verified signature: its timestamp and the canonical MAC (lower-case hex), the replay identity."""

    timestamp: int
    mac: str


def signature(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header value for `body`, signed now (or at `timestamp`)."""
    ts = int(time.time()) if timestamp is None else timestamp
    return f"t={ts},v1={signature(secret, ts, body)}"


def parse(header: str | None) -> tuple[int, list[str]]:
    """(timestamp, lower-case hex candidates) of a header. Raises `SignatureError` when it is malformed."""
    if not header:
        raise SignatureError(f"missing {HEADER} header")
    malformed = SignatureError(f"malformed {HEADER} header: expected t=<unix seconds>,v1=<hex>")
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            if timestamp is not None or not value.isascii() or not value.isdigit() or len(value) > 20:
                raise malformed
            timestamp = int(value)
        elif key == "v1":
            candidate = value.lower()
            if len(candidate) == 64 and set(candidate) <= _HEX:
                candidates.append(candidate)
    if timestamp is None or not candidates:
        raise malformed
    return timestamp, candidates


def verify(
    secret: str, header: str | None, body: bytes, *, tolerance_s: float, now: float | None = None
) -> Signature:
    """Check a header against `body`. Constant-time comparison of every `v1` given."""
    timestamp, candidates = parse(header)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise SignatureError(f"signature timestamp is outside the {tolerance_s:g} s replay window")
    expected = signature(secret, timestamp, body)
    matched = False
    for candidate in candidates:  # no early exit: time does not depend on which one matched
        matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError("signature does not match the body")
    return Signature(timestamp, expected)
