"""The vLLM environment `make install-vllm` builds: it starts from cached bytecode.

The CPU build starts three processes (API server, engine core, worker) and each imports vLLM, torch and
transformers. Where PYTHONDONTWRITEBYTECODE is set (the Docker image, many CI machines) nothing is cached at run
time, so an environment installed without bytecode compiles those modules in every process of every start and
every restart after a crash (docs/performance.md measures what that costs).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gateway.engines.vllm import find_vllm_python

pytestmark = pytest.mark.vllm

PACKAGES = ("vllm", "torch", "transformers")
# Modules no start imports and Python 3.11 cannot compile (newer syntax in torch's own test helpers).
UNCOMPILABLE = {"torch/testing/_internal/py312_intrinsics.py"}


def test_the_packages_vllm_starts_with_have_their_bytecode() -> None:
    where = subprocess.run(
        [
            find_vllm_python(""),
            "-c",
            "import json, sys, sysconfig; "
            "print(json.dumps([sysconfig.get_paths()['purelib'], sys.implementation.cache_tag]))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    purelib, tag = json.loads(where.stdout)
    root = Path(purelib)
    missing = []
    for package in PACKAGES:
        sources = sorted((root / package).rglob("*.py"))
        assert sources, f"{package} is not installed in {root}"
        for source in sources:
            relative = source.relative_to(root).as_posix()
            cached = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
            if relative not in UNCOMPILABLE and not cached.exists():
                missing.append(relative)
    assert not missing, f"{len(missing)} modules without bytecode, e.g. {missing[:5]}"
