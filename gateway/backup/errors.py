"""The one error a backup or a restore stops with: its message says what is wrong and what to do."""

from __future__ import annotations


class BackupError(ValueError):
    """A backup cannot be taken, or a restore was refused or failed; nothing past the refusal was written.

    A `ValueError`, so `kaizen` reports it as one line and exits with status 2."""
