"""Redaction hooks for tests, named in policy configurations as `tests.support.redaction_hooks:<name>`."""

from __future__ import annotations

import re

_CUSTOMER = re.compile(r"\bCUST-\d{6}\b")


def customer_ids(text: str) -> str:
    """An owner's own rule: the shop's customer numbers are personal data too."""
    return _CUSTOMER.sub("[CUSTOMER]", text)


def broken(text: str) -> str:
    raise RuntimeError("this hook always fails")
