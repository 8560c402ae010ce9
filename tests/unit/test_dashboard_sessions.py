"""Dashboard session cookies: signed, expiring, bound to one secret; CSRF tokens per login."""

from __future__ import annotations

from gateway.auth import LoginThrottle
from gateway.dashboard.sessions import SessionSigner


def _signer(secret: bytes = b"k" * 32, ttl_s: float = 60) -> SessionSigner:
    return SessionSigner(lambda: secret, ttl_s, secure=False)


def test_a_cookie_reads_back_and_names_its_key() -> None:
    signer = _signer()
    session = signer.read(signer.issue("ab" * 32))
    assert session is not None and session.key_digest == "ab" * 32


def test_altered_foreign_expired_or_malformed_cookies_are_no_session() -> None:
    signer = _signer()
    value = signer.issue("ab" * 32)
    payload, mac = value.split(".")
    assert signer.read(payload[:-2] + "AA." + mac) is None
    assert signer.read(payload + "." + mac[:-2] + "AA") is None
    assert _signer(secret=b"x" * 32).read(value) is None
    assert signer.read(_signer(ttl_s=-1).issue("ab" * 32)) is None
    for junk in (None, "", "no-dot", "a.b.c", "%%%.%%%", "e30.AAAA", "x" * 2000):
        assert signer.read(junk) is None


def test_csrf_tokens_differ_per_login_and_per_secret() -> None:
    signer = _signer()
    first = signer.read(signer.issue("ab" * 32))
    second = signer.read(signer.issue("ab" * 32))
    assert first is not None and second is not None
    assert signer.csrf_token(first) != signer.csrf_token(second)
    assert _signer(secret=b"x" * 32).csrf_token(first) != signer.csrf_token(first)


def test_the_cookie_is_http_only_strict_and_scoped_to_the_dashboard() -> None:
    cookie = SessionSigner(lambda: b"k", 60, secure=True).cookie("v")
    assert (cookie.httponly, cookie.samesite, cookie.path, cookie.secure, cookie.max_age) == (
        True,
        "strict",
        "/dashboard",
        True,
        60,
    )


def test_failed_logins_close_an_address_until_the_oldest_failure_leaves_the_window() -> None:
    now = [1000.0]
    throttle = LoginThrottle(3, 60.0, clock=lambda: now[0])
    for at in (1000.0, 1010.0, 1030.0):
        now[0] = at
        assert throttle.retry_after("10.0.0.1") is None
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 30.0  # the failure at 1000 leaves the window at 1060
    now[0] = 1059.0
    assert throttle.retry_after("10.0.0.1") == 1.0
    assert throttle.retry_after("10.0.0.2") is None  # per address
    now[0] = 1060.0
    assert throttle.retry_after("10.0.0.1") is None
    throttle.failed("10.0.0.1")  # failures at 1010, 1030, 1060
    assert throttle.retry_after("10.0.0.1") == 10.0
    throttle.succeeded("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") is None


def test_the_throttle_remembers_a_bounded_number_of_addresses_and_can_be_off() -> None:
    now = [0.0]
    throttle = LoginThrottle(2, 60.0, clock=lambda: now[0], max_addresses=100)
    for n in range(1000):
        throttle.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(throttle._failures) <= 100
    off = LoginThrottle(0, 60.0)
    for _ in range(100):
        off.failed("10.0.0.1")
    assert off.retry_after("10.0.0.1") is None
