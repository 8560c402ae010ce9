"""Reward rules, feedback value conversion, signatures and policy reward configuration."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime, timedelta

import pytest

from gateway.commands.options import parse_since
from gateway.errors import InvalidRequest
from gateway.feedback import to_number
from gateway.signing import Signature, SignatureError, sign, verify
from storage.rewards import RewardInfo
from trainer.control.policy_config import FeedbackConfig, InvalidPolicyConfig, RewardRule, load_policy_config
from trainer.control.rewards import derive_reward
from trainer.control.scoring import webhook_signature

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def signal(rid: int, source: str, value: float, name: str = "user", minutes: int = 0) -> RewardInfo:
    return RewardInfo(
        rid, None, "e", source, name, value, None, None, {}, None, "linked", T0 + timedelta(minutes=minutes)
    )


def test_priority_rule_prefers_feedback_and_takes_the_latest_per_name() -> None:
    signals = [
        signal(1, "judge", 0.2, "ruler"),
        signal(2, "feedback", 0.0, minutes=1),
        signal(3, "feedback", 1.0, minutes=2),  # the user changed their thumb
        signal(4, "feedback", 0.5, "csat", minutes=3),
    ]
    value, provenance = derive_reward(signals, RewardRule()) or (None, None)
    assert value == 0.75
    assert provenance == {
        "rule": "priority",
        "source": "feedback",
        "terms": [
            {"reward_id": 3, "name": "user", "value": 1.0},
            {"reward_id": 4, "name": "csat", "value": 0.5},
        ],
    }
    assert derive_reward([signal(1, "judge", 0.2, "ruler")], RewardRule()) == (
        0.2,
        {"rule": "priority", "source": "judge", "terms": [{"reward_id": 1, "name": "ruler", "value": 0.2}]},
    )
    assert derive_reward([], RewardRule()) is None
    assert derive_reward([signal(1, "judge", 0.2)], RewardRule(priority=["feedback"])) is None


def test_weighted_rule() -> None:
    signals = [signal(1, "judge", 0.5, "ruler"), signal(2, "feedback", 1.0)]
    rule = RewardRule(kind="weighted", weights={"judge": 1.0, "feedback:user": 3.0})
    assert derive_reward(signals, rule)[0] == pytest.approx((0.5 + 3.0) / 4)  # type: ignore[index]
    raw = RewardRule(kind="weighted", weights={"judge": 1.0, "feedback:user": 3.0}, normalize=False)
    assert derive_reward(signals, raw)[0] == pytest.approx(3.5)  # type: ignore[index]
    only_judge = derive_reward(signals[:1], rule)
    assert only_judge is not None and only_judge[0] == 0.5  # missing terms do not count as zero
    assert derive_reward(signals, RewardRule(kind="weighted", weights={"webhook": 1})) is None


def test_feedback_values() -> None:
    config = FeedbackConfig(labels={"great": 2.0}, true_value=1.0, false_value=-1.0, min_value=0, max_value=5)
    assert to_number(True, config, "value") == (1.0, "thumbs_up")
    assert to_number(False, config, "value") == (-1.0, "thumbs_down")  # thumbs are trusted, not range-checked
    assert to_number("great", config, "value") == (2.0, "great")
    assert to_number(5, config, "value") == (5.0, None)
    with pytest.raises(InvalidRequest, match="unknown label 'meh'") as label:
        to_number("meh", config, "items[0].value")
    assert (label.value.param, label.value.code) == ("items[0].value", "unknown_label")
    with pytest.raises(InvalidRequest, match="outside the configured range"):
        to_number(5.5, config, "value")


def test_policy_reward_config() -> None:
    default = load_policy_config(None).rewards
    assert default.scorer.kind == "judge" and default.feedback.labels["good"] == 1.0
    configured = load_policy_config(
        {"train": {}, "rewards": {"scorer": {"webhook_url": "http://x"}, "judge": {"rubric": "R"}}}
    ).rewards
    assert configured.scorer.kind == "webhook" and configured.judge.rubric == "R"
    assert (
        load_policy_config(
            {"rewards": {"scorer": {"function": "m:f", "webhook_url": "https://scorer.example/s"}}}
        ).rewards.scorer.kind
        == "function"
    )
    with pytest.raises(InvalidPolicyConfig, match=r"rewards\.rule\.kind"):
        load_policy_config({"rewards": {"rule": {"kind": "median"}}})
    with pytest.raises(InvalidPolicyConfig, match=r"rewards\.labelz: unknown key"):
        load_policy_config({"rewards": {"labelz": {}}})


def test_signatures() -> None:
    body = b'{"request_id": "r", "value": 1}'
    header = sign("secret", body, timestamp=1_700_000_000)
    expected = hmac.new(b"secret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    assert verify("secret", header, body, tolerance_s=300, now=1_700_000_100) == Signature(
        1_700_000_000, expected
    )
    # However the header is spelled, the identity is the parsed timestamp and the MAC the receiver computes.
    for variant in (
        f"t=1700000000, v1={expected}",
        f"v1={expected},t=1700000000",
        f"t=01700000000,v1={expected}",
        f"t=1700000000,v1={expected.upper()}",
        f"{header},v1=00",
        f"{header},x=1",
    ):
        assert verify("secret", variant, body, tolerance_s=300, now=1_700_000_000) == Signature(
            1_700_000_000, expected
        )
    # The trainer signs its scoring webhooks in the same format (verify raises if it did not).
    verify("secret", webhook_signature("secret", body), body, tolerance_s=5)
    for bad, now, message in [
        (None, 1_700_000_000, "missing"),
        ("v1=abc", 1_700_000_000, "malformed"),
        (f"t=1700000000,v1={'z' * 64}", 1_700_000_000, "malformed"),
        (f"t=1700000000,t=1700000000,v1={expected}", 1_700_000_000, "malformed"),
        (header, 1_700_000_301, "replay window"),
        (header, 1_699_999_699, "replay window"),
        (sign("other", body, timestamp=1_700_000_000), 1_700_000_000, "does not match"),
    ]:
        with pytest.raises(SignatureError, match=message):
            verify("secret", bad, body, tolerance_s=300, now=now)
    with pytest.raises(SignatureError, match="does not match"):
        verify("secret", header, body + b" ", tolerance_s=300, now=1_700_000_000)


def test_parse_since() -> None:
    now = datetime(2026, 3, 10, 12, tzinfo=UTC)
    assert parse_since("24h", now) == now - timedelta(hours=24)
    assert parse_since("7d", now) == now - timedelta(days=7)
    assert parse_since("2026-03-01", now) == datetime(2026, 3, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday", now)
