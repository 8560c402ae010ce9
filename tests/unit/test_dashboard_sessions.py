"""Dashboard session cookies: signed, expiring, bound to one secret; CSRF tokens per login."""

from __future__ import annotations

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
