"""storage is the bottom layer: the migrations, the gateway and the trainer build on it, never the reverse."""

from __future__ import annotations

import json
import subprocess
import sys

#: Runs in a fresh interpreter, so modules the test process has already imported cannot hide one.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys

import storage

for module in pkgutil.iter_modules(storage.__path__):
    importlib.import_module(f"storage.{module.name}")
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in ("migrations", "gateway", "trainer"))))
"""


def test_storage_imports_neither_migrations_nor_the_layers_above() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
