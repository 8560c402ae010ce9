"""The rate limiter's arithmetic, on an injected clock: refill, refusal, Retry-After, token debt, headers."""

from __future__ import annotations

import pytest

from gateway.auth import KeyRing
from gateway.rate_limits import Limits, RateLimiter, caller_identity, duration, limiter_from_settings
from gateway.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(requests: int = 0, tokens: int = 0, window_s: float = 60.0, **kwargs: object) -> RateLimiter:
    return RateLimiter(Limits(requests, tokens), window_s=window_s, **kwargs)  # type: ignore[arg-type]


def test_requests_refused_when_spent_and_admitted_exactly_after_retry_after() -> None:
    clock = Clock()
    rl = limiter(requests=2, clock=clock)
    assert rl.admit("a", spends_tokens=True).refused is None
    assert rl.admit("a", spends_tokens=True).refused is None
    refused = rl.admit("a", spends_tokens=True)
    assert refused.refused == "requests"
    assert refused.retry_after_s == pytest.approx(30.0)  # one unit refills in window / limit
    clock.now += refused.retry_after_s - 0.01
    assert rl.admit("a", spends_tokens=True).refused == "requests"
    clock.now += 0.01
    assert rl.admit("a", spends_tokens=True).refused is None
    assert rl.admit("a", spends_tokens=True).refused == "requests"


def test_refusals_take_nothing_and_refill_caps_at_the_limit() -> None:
    clock = Clock()
    rl = limiter(requests=3, clock=clock)
    for _ in range(3):
        rl.admit("a", spends_tokens=False)
    for _ in range(5):  # refused attempts do not dig the caller deeper
        assert rl.admit("a", spends_tokens=False).retry_after_s == pytest.approx(20.0)
    clock.now += 3600  # an hour idle refills to the limit, not beyond
    admitted = [rl.admit("a", spends_tokens=False).refused is None for _ in range(4)]
    assert admitted == [True, True, True, False]


def test_callers_have_separate_buckets() -> None:
    rl = limiter(requests=1, clock=Clock())
    assert rl.admit("a", spends_tokens=False).refused is None
    assert rl.admit("a", spends_tokens=False).refused == "requests"
    assert rl.admit("b", spends_tokens=False).refused is None


def test_tokens_are_charged_after_the_call_and_debt_is_paid_back_by_refill() -> None:
    clock = Clock()
    rl = limiter(tokens=100, clock=clock)
    verdict = rl.admit("a", spends_tokens=True)
    assert verdict.refused is None
    rl.charge(verdict.caller, 150)  # more than the budget: the call already ran, so the bucket goes to -50
    refused = rl.admit("a", spends_tokens=True)
    assert refused.refused == "tokens"
    assert refused.retry_after_s == pytest.approx(51 * 60 / 100)  # back to one token
    assert rl.admit("a", spends_tokens=False).refused is None  # routes that spend no tokens still pass
    clock.now += refused.retry_after_s
    assert rl.admit("a", spends_tokens=True).refused is None


def test_a_token_refusal_does_not_take_a_request_and_retry_after_covers_both_limits() -> None:
    clock = Clock()
    rl = limiter(requests=2, tokens=60, clock=clock)
    first = rl.admit("a", spends_tokens=True)
    rl.charge(first.caller, 120)  # 61 tokens short: 61 s to refill one token
    refused = rl.admit("a", spends_tokens=True)
    assert refused.refused == "tokens" and refused.retry_after_s == pytest.approx(61.0)
    assert first.caller.requests is not None and first.caller.requests.level == pytest.approx(1.0)
    assert rl.admit("a", spends_tokens=True).refused == "tokens"
    clock.now += 61
    assert rl.admit("a", spends_tokens=True).refused is None
    rl.charge(first.caller, 1000)
    rl.admit("a", spends_tokens=False)
    both = rl.admit("a", spends_tokens=True)  # requests free up after 30 s, tokens after much longer
    assert both.refused == "tokens" and both.retry_after_s > 60


def test_headers_report_limit_remaining_and_reset() -> None:
    clock = Clock()
    rl = limiter(requests=4, tokens=1000, clock=clock)
    verdict = rl.admit("a", spends_tokens=True)
    rl.charge(verdict.caller, 250)
    headers = {name.decode(): value.decode() for name, value in verdict.caller.headers()}
    assert headers == {
        "x-ratelimit-limit-requests": "4",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "15s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "750",
        "x-ratelimit-reset-tokens": "15s",
    }
    assert dict(limiter(requests=4, clock=clock).admit("b", spends_tokens=True).caller.headers()).keys() == {
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    }


def test_overrides_lift_or_change_one_callers_limits() -> None:
    rl = limiter(requests=1, overrides={"gate": Limits(0, 0), "big": Limits(3, 0)}, clock=Clock())
    assert all(rl.admit("gate", spends_tokens=True).refused is None for _ in range(10))
    assert [rl.admit("big", spends_tokens=True).refused for _ in range(4)] == [None, None, None, "requests"]
    rl.admit("other", spends_tokens=True)
    assert rl.admit("other", spends_tokens=True).refused == "requests"


def test_limiter_from_settings_and_off_by_default() -> None:
    assert not limiter_from_settings(Settings.load()).enabled
    settings = Settings.load(rate_limit_tpm=500, rate_limit_keys={"key-x": {"rpm": 7}, "key-y": {"tpm": 0}})
    rl = limiter_from_settings(settings)
    assert rl.enabled
    assert rl.limits_of("key-x") == Limits(7, 500)
    assert rl.limits_of("key-y") == Limits(0, 0)
    assert rl.limits_of("anyone") == Limits(0, 500)
    # Off by default but on for one caller: the limiter must still run.
    assert limiter_from_settings(Settings.load(rate_limit_keys={"key-x": {"rpm": 1}})).enabled


def test_idle_callers_are_forgotten_once_there_are_many() -> None:
    clock = Clock()
    rl = limiter(requests=10, clock=clock, max_idle_callers=3)
    for name in ("a", "b", "c"):
        rl.admit(name, spends_tokens=False)
    clock.now += 60  # a, b and c are full again
    rl.admit("d", spends_tokens=False)
    assert set(rl._callers) == {"d"}


def test_caller_identity_names_keys_without_keeping_them() -> None:
    ring = KeyRing(["secret-one", "secret-two"])
    one = caller_identity("Bearer secret-one", "10.0.0.1", ring)
    assert one == caller_identity("Bearer secret-one", "10.0.0.2", ring)  # the key, not the address
    assert one.startswith("key-") and len(one) == 20 and "secret" not in one
    assert one != caller_identity("Bearer secret-two", "10.0.0.1", ring)
    assert caller_identity(None, "10.0.0.1", ring) == "anon-10.0.0.1"
    assert caller_identity("Bearer ", "10.0.0.1", ring) == "anon-10.0.0.1"
    assert caller_identity(None, None, ring) == "anon-unknown"


def test_a_key_the_gateway_does_not_know_counts_against_its_address() -> None:
    # An open gateway accepts any bearer token: were each token its own caller, a new one per request would
    # never be limited. A closed gateway refuses unknown keys, but counting each guess apart would let a
    # client guess keys at any rate.
    for ring in (KeyRing([]), KeyRing(["secret-one"])):
        ring.load([])
        assert {caller_identity(f"Bearer guess-{i}", "10.0.0.1", ring) for i in range(5)} == {"anon-10.0.0.1"}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0201, "21ms"), (1.5, "1.5s"), (30.0, "30s"), (360.0, "6m0s"), (61.25, "1m1.25s")],
)
def test_durations_are_written_as_openai_does(seconds: float, text: str) -> None:
    assert duration(seconds) == text
