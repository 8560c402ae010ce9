"""Each built-in detector finds what it names and leaves look-alikes alone; modes, hooks and records."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.redaction import Redactor, iban_valid, load_redaction_key, luhn_valid, redact_call
from storage.models import GROUP_KEY_LENGTH, USER_LENGTH
from storage.records import CallRecord
from trainer.control.policy_config import InvalidPolicyConfig, PrivacyConfig, load_policy_config


def mask(text: str, **config: object) -> str:
    return Redactor(PrivacyConfig.model_validate({"mode": "mask", **config}), b"", policy="p").text(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("write to Jane.Roe+news@mail.example.co.uk today", "write to [EMAIL] today"),
        ("a@b.io", "[EMAIL]"),
        ("call +44 20 7946 0958 now", "call [PHONE] now"),
        ("call (415) 555-0134", "call [PHONE]"),
        ("call 415-555-0134", "call [PHONE]"),
        ("pay with 4111 1111 1111 1111", "pay with [CARD]"),
        ("pay with 4242-4242-4242-4242", "pay with [CARD]"),
        ("amex 378282246310005", "amex [CARD]"),
        ("to DE89 3704 0044 0532 0130 00.", "to [IBAN]."),
        ("to GB82WEST12345698765432", "to [IBAN]"),
        ("from 203.0.113.42:8080", "from [IP]:8080"),
        ("from 2001:db8::8a2e:370:7334 and fe80::1", "from [IP] and [IP]"),
        ("key sk-proj-Abc123def456GHI789jkl012", "key [SECRET]"),
        ("key sk-ant-api03-abcdefghijklmnopqrstuvwxyz", "key [SECRET]"),
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "token [SECRET]"),
        ("aws AKIAIOSFODNN7EXAMPLE", "aws [SECRET]"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc", "Authorization: [SECRET]"),
        (
            "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\nok",
            "[SECRET]\nok",
        ),
        ("slack xoxb-1234567890-abcdefghij", "slack [SECRET]"),
    ],
)
def test_detectors_find_what_they_name(text: str, expected: str) -> None:
    assert mask(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112 fails Luhn",
        "number 1234567812345678 fails Luhn",
        "DE00 3704 0044 0532 0130 00 has wrong check digits",
        "GB82WEST12345698765433 is off by one",
        "on 2024-01-15 at 12:30:45",
        "order 123456789012 shipped",
        "version 1.2.3, pi 3.14159, price 1,234.56, 10.5%",
        "zip 94107, year 2024, 300.0.0.1 is no address",
        "std::vector and a[::2]",
        "my sk-short key and ghp_short",
        "user at example dot com",
    ],
)
def test_look_alikes_are_left_alone(text: str) -> None:
    assert mask(text) == text


def test_checksums() -> None:
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    assert iban_valid("DE89370400440532013000") and not iban_valid("DE89370400440532013001")
    assert not iban_valid("DE89")


def test_hash_is_keyed_and_stable() -> None:
    one = Redactor(PrivacyConfig(mode="hash"), b"key-1", policy="p")
    other = Redactor(PrivacyConfig(mode="hash"), b"key-2", policy="p")
    text = "Jane@Example.org, jane@example.org, 4111 1111 1111 1111, 4111111111111111, bob@example.org"
    redacted = one.text(text)
    tokens = redacted.split(", ")
    assert (
        tokens[0] == tokens[1] and tokens[0].startswith("[EMAIL:") and len(tokens[0]) == len("[EMAIL:]") + 8
    )
    assert tokens[2] == tokens[3] and tokens[2].startswith("[CARD:")
    assert tokens[4] != tokens[0]
    assert other.text(text) != redacted


def test_only_chosen_detectors_run() -> None:
    assert mask("jane@example.org 203.0.113.42", detectors=["ip"]) == "jane@example.org [IP]"


def test_hook_runs_after_the_detectors_and_fails_closed() -> None:
    hooked = {"hook": "tests.support.redaction_hooks:customer_ids"}
    assert mask("CUST-123456 wrote from a@b.io", **hooked) == "[CUSTOMER] wrote from [EMAIL]"
    assert mask("CUST-123456", hook="tests.support.redaction_hooks:broken") == "[REDACTED]"
    assert mask("CUST-123456", hook="tests.support.no_such_module:f") == "[REDACTED]"


def test_privacy_section_is_validated() -> None:
    assert load_policy_config({}).privacy.mode == "off"
    with pytest.raises(InvalidPolicyConfig) as caught:
        load_policy_config({"privacy": {"mode": "scramble", "detectors": ["dna"], "hook": "no colon"}})
    assert {p.path for p in caught.value.problems} == {"privacy.mode", "privacy.detectors[0]", "privacy.hook"}


def test_record_drops_the_token_ids_of_redacted_text() -> None:
    record = CallRecord(
        id="c1",
        episode_id="e1",
        episode_resolved=True,
        model="m",
        request={"messages": [{"role": "user", "content": "mail a@b.io"}], "params": {"user": "a@b.io"}},
        response={
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "sent to a@b.io"},
                    "logprobs": {"x": 1},
                },
                {"index": 1, "message": {"role": "assistant", "content": "done"}, "logprobs": {"x": 2}},
            ]
        },
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[[4, 5], [6]],
        completion_logprobs=[[-0.1, -0.2], [-0.3]],
        user="a@b.io",
        group_key="a@b.io",
        episode_metadata={"contact": "a@b.io", "n": 3},
        created_at=0.0,
    )
    stored = redact_call(record, Redactor(PrivacyConfig(mode="mask"), b"", policy="p"))
    assert stored.request["messages"][0]["content"] == "mail [EMAIL]"
    assert stored.request["params"] == {"user": "[EMAIL]"}
    assert stored.prompt_token_ids is None
    assert stored.completion_token_ids == [None, [6]]
    assert stored.completion_logprobs == [None, [-0.3]]
    assert stored.response is not None
    assert [c["logprobs"] for c in stored.response["choices"]] == [None, {"x": 2}]
    assert stored.user == stored.group_key == "[EMAIL]"
    assert stored.episode_metadata == {"contact": "[EMAIL]", "n": 3}
    assert record.request["messages"][0]["content"] == "mail a@b.io"  # what the app got is untouched


def test_a_hashed_user_or_group_key_stays_within_its_column() -> None:
    # `[IP:1a2b3c4d]` is longer than `1.2.3.4`: a user the gateway let through at 256 characters could come
    # out of hashing longer than `calls.user` holds.
    near_limit = ("1.2.3.4 " * 32)[:USER_LENGTH]
    record = CallRecord(
        id="c1",
        episode_id="e1",
        episode_resolved=True,
        model="m",
        request={"messages": []},
        user=near_limit,
        group_key=near_limit,
        created_at=0.0,
    )
    stored = redact_call(record, Redactor(PrivacyConfig(mode="hash"), b"k", policy="p"))
    assert stored.user is not None and stored.group_key is not None
    assert stored.user.startswith("[IP:") and len(stored.user) == USER_LENGTH
    assert len(stored.group_key) == GROUP_KEY_LENGTH


def test_generated_key_is_kept_and_a_configured_one_wins(tmp_path: Path) -> None:
    first = load_redaction_key("", tmp_path)
    assert len(first) == 64 and load_redaction_key("", tmp_path) == first
    assert (tmp_path / "redaction.key").stat().st_mode & 0o077 == 0
    assert [p.name for p in tmp_path.iterdir()] == ["redaction.key"]
    assert load_redaction_key("configured", tmp_path) == b"configured"
