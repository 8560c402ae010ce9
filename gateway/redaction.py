"""PII redaction: what a policy's `privacy` section removes from a call before it is stored.

One compiled alternation scans each string once; a match whose checksum fails (a Luhn-invalid card number, an
IBAN that is not 1 mod 97, a colon-separated string that is no IPv6 address) is left as it was. `mask` replaces
a match with its kind (`[EMAIL]`); `hash` appends the first 8 hex digits of an HMAC-SHA256 of the normalised
value under the gateway's redaction key (`[EMAIL:1a2b3c4d]`), so the same address gives the same token in
every call and replica that shares the key, and grouping or counting by it still works.

Only what is stored is redacted: the app gets the engine's answer untouched. A redacted text no longer matches
the token ids the engine saw, so `redact_call` drops the ids that encode redacted text (the trainer
re-tokenises it) and the per-token logprobs of a changed reply.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib
import ipaddress
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from gateway.keyfile import generated_key
from storage.models import GROUP_KEY_LENGTH, USER_LENGTH
from storage.records import CallRecord
from trainer.control.policy_config import PrivacyConfig

log = logging.getLogger(__name__)

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Order matters: at one position the first alternative that matches wins (a PEM block before anything in it,
# a card number before a phone number).
_PATTERNS: tuple[tuple[str, str], ...] = (
    (
        "secret",
        r"-----BEGIN[A-Z ]{0,20} PRIVATE KEY-----[\s\S]{0,10000}?-----END[A-Z ]{0,20} PRIVATE KEY-----"
        r"|\b(?:sk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{20,}"
        r"|\b(?:ghp|gho|ghu|ghs|ghr|github_pat)_[A-Za-z0-9_]{20,}"
        r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
        r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
        r"|\b[Bb]earer[ \t]+[A-Za-z0-9._~+/-]{16,}=*",
    ),
    ("email", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
    ("iban", r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b"),
    ("card", r"(?<![\d.,-])\d(?:[ -]?\d){12,18}(?!\d|[.,]\d)"),
    (
        "ip6",
        r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|"
        + _OCTET
        + r"(?:\."
        + _OCTET
        + r"){3})?(?![\w:])",
    ),
    ("ip4", r"(?<![\w.])" + _OCTET + r"(?:\." + _OCTET + r"){3}(?![\w]|\.\d)"),
    ("phone", r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}(?!\w)"),
)
_DETECTOR_OF = {
    "secret": "secret",
    "email": "email",
    "iban": "iban",
    "card": "card",
    "ip6": "ip",
    "ip4": "ip",
    "phone": "phone",
}
_LABEL = {"ip6": "IP", "ip4": "IP"}


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number carries."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def iban_valid(compact: str) -> bool:
    """ISO 13616: the country code and check digits moved to the end, letters as 10..35, is 1 mod 97."""
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def _ipv6_valid(text: str) -> bool:
    # Two groups at least: `::2` in a slice or `a::b` in C++ is not worth a placeholder.
    if sum(1 for group in re.split("[:.]", text) if group) < 2:
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _phone_valid(text: str) -> bool:
    digits = sum(c.isdigit() for c in text)
    if text.startswith("+"):
        return 7 <= digits <= 15
    # Without a country code: a separated run long enough to be a number, not a date or a short code.
    return 9 <= digits <= 15 and any(c in text for c in " .-(")


def _digits(text: str) -> str:
    return "".join(c for c in text if c.isdigit())


# kind -> (is it really one?, the value the hash is taken of)
_CHECKS: dict[str, tuple[Callable[[str], bool], Callable[[str], str]]] = {
    "secret": (lambda _: True, lambda s: s),
    "email": (lambda _: True, str.lower),
    "iban": (lambda s: iban_valid(s.replace(" ", "")), lambda s: s.replace(" ", "")),
    "card": (lambda s: luhn_valid(_digits(s)), _digits),
    "ip6": (_ipv6_valid, str.lower),
    "ip4": (lambda _: True, lambda s: s),
    "phone": (_phone_valid, _digits),
}


# Cheap tests (substring checks in C, one anchored character-class scan) that a detector could match at all:
# most texts pass none of them, and the full alternation, which tries every branch at every position, is
# compiled and run only for the detectors that could.
_SECRET_MARKS = (
    "PRIVATE KEY",
    "sk-",
    "rk-",
    "_pat_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "AKIA",
    "ASIA",
    "xox",
)
_NUMBERISH = re.compile(r"\d[\d .()-]{5,}\d")


def _candidates(wanted: frozenset[str], text: str) -> frozenset[str]:
    if len(text) < 6:  # shorter than the shortest match (`a@b.io`): roles, ids, finish reasons
        return frozenset()
    found: list[str] = []
    if "secret" in wanted and ("earer" in text or any(mark in text for mark in _SECRET_MARKS)):
        found.append("secret")
    if "email" in wanted and "@" in text:
        found.append("email")
    numberish = _NUMBERISH.search(text) is not None
    if numberish:
        found.extend(kind for kind in ("iban", "card", "phone") if kind in wanted)
    if "ip" in wanted and (numberish or ":" in text):
        found.append("ip")  # IPv4 is a numberish run; IPv6 has colons
    return frozenset(found)


@functools.cache
def _compiled(kinds: frozenset[str]) -> re.Pattern[str] | None:
    parts = [f"(?P<{kind}>{pattern})" for kind, pattern in _PATTERNS if _DETECTOR_OF[kind] in kinds]
    return re.compile("|".join(parts)) if parts else None


def _pattern_for(wanted: frozenset[str], text: str) -> re.Pattern[str] | None:
    return _compiled(_candidates(wanted, text)) if wanted else None


def load_redaction_key(configured: str, data_dir: Path) -> bytes:
    """The key of `hash` mode: the configured one, else one generated once into the data directory.

    Replicas that share the data directory (they must, for adapters) share the generated key, so a value hashes
    to the same token everywhere; a configured key also survives a new data directory."""
    if configured:
        return configured.encode()
    return generated_key(data_dir / "redaction.key")


def _load_hook(path: str) -> Callable[[str], str]:
    module, _, name = path.partition(":")
    hook: Callable[[str], str] = getattr(importlib.import_module(module), name)
    return hook


class Redactor:
    """Redacts strings and JSON values for one policy's `privacy` section (never built for mode `off`)."""

    def __init__(self, config: PrivacyConfig, key: bytes, *, policy: str) -> None:
        self.policy = policy
        self.hash = config.mode == "hash"
        self.key = key
        self._wanted = frozenset(
            _DETECTOR_OF[kind] for kind, _ in _PATTERNS if _DETECTOR_OF[kind] in config.detectors
        )
        self._hook: Callable[[str], str] | None = None
        self._hook_broken = False
        if config.hook:
            try:
                self._hook = _load_hook(config.hook)
            except Exception as exc:
                # Fail closed: the owner asked for this rule, so text it cannot check is not stored.
                log.error(
                    "policy %s: redaction hook %s cannot be loaded (%r); texts are stored as [REDACTED]",
                    policy,
                    config.hook,
                    exc,
                )
                self._hook_broken = True

    def _replace(self, match: re.Match[str]) -> str:
        kind = match.lastgroup
        assert kind is not None
        text = match.group()
        valid, normal = _CHECKS[kind]
        if not valid(text):
            return text
        label = _LABEL.get(kind, kind.upper())
        if not self.hash:
            return f"[{label}]"
        digest = hmac.new(self.key, f"{label}:{normal(text)}".encode(), hashlib.sha256).hexdigest()
        return f"[{label}:{digest[:8]}]"

    def text(self, text: str) -> str:
        if self._hook_broken:
            return "[REDACTED]"
        pattern = _pattern_for(self._wanted, text)
        if pattern is not None:
            text = pattern.sub(self._replace, text)
        if self._hook is not None:
            try:
                text = self._hook(text)
            except Exception as exc:
                log.error(
                    "policy %s: redaction hook failed (%s); the text is stored as [REDACTED]",
                    self.policy,
                    type(exc).__name__,
                )
                return "[REDACTED]"
        return text

    def value(self, value: Any) -> Any:
        """A JSON value with every string in it redacted (keys are left alone)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value


def redact_call(record: CallRecord, redactor: Redactor) -> CallRecord:
    """The record as it may be stored: texts redacted, token ids and logprobs that encode redacted text dropped.

    A changed prompt drops `prompt_token_ids` (the trainer renders the redacted context with the chat template);
    a changed reply drops that choice's token ids and logprobs, and the per-token `logprobs` of the stored
    response (its token strings would spell the value out piece by piece); untouched replies keep theirs."""
    request = redactor.value(record.request)
    prompt_ids = record.prompt_token_ids if request == record.request else None
    response = record.response
    completion_ids = record.completion_token_ids
    completion_logprobs = record.completion_logprobs
    if response is not None:
        original = response
        response = redactor.value(original)
        choices = response.get("choices") or []
        for index, (old, new) in enumerate(zip(original.get("choices") or [], choices, strict=False)):
            if old.get("message") == new.get("message") and old.get("text") == new.get("text"):
                continue
            new["logprobs"] = None
            if completion_ids is not None and index < len(completion_ids):
                completion_ids = [*completion_ids[:index], None, *completion_ids[index + 1 :]]
            if completion_logprobs is not None and index < len(completion_logprobs):
                completion_logprobs = [*completion_logprobs[:index], None, *completion_logprobs[index + 1 :]]
    metadata = redactor.value(record.episode_metadata)
    return msgspec.structs.replace(
        record,
        request=request,
        response=response,
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion_ids,
        completion_logprobs=completion_logprobs,
        error=redactor.value(record.error),
        # A hashed value can be longer than the one it replaces: kept within the columns the gateway checked.
        user=redactor.text(record.user)[:USER_LENGTH] if record.user else record.user,
        group_key=redactor.text(record.group_key)[:GROUP_KEY_LENGTH]
        if record.group_key
        else record.group_key,
        episode_metadata=metadata,
    )
