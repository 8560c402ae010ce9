"""Secrets the gateway generates for itself when none is configured: one file per secret in the data directory.

Replicas that share the data directory (they must, for adapters) share the generated secret: the first replica
to start writes it, atomically, and every other one reads that file.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)


def generated_key(path: Path) -> bytes:
    """The secret in `path`, 256 random bits written there (mode 0600) first if the file does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
        try:
            os.link(draft, path)  # atomic, and fails if another replica got there first: then its key is used
            log.info("generated a key in %s", path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip().encode()
