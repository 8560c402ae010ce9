"""An older commit of Kaizen, unpacked with `git archive` and run with this checkout's environment: benchmarks
measure the code before a change beside it, and the rolling-upgrade test runs the previous version's gateways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git(*args: str) -> str:
    """The output of a git command in this checkout."""
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def unpack(ref: str, target: Path) -> str:
    """The tree of `ref` under `target`; returns the full commit id."""
    commit = git("rev-parse", f"{ref}^{{commit}}")
    archive = target.with_suffix(".tar")
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, stdout=out)
    target.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()
    return commit


def tree_paths(tree: Path) -> dict[str, str]:
    """The variables that make Python import Kaizen from `tree`. PYTHONSAFEPATH: `python -m` (the gateway and its
    children) would otherwise put the working directory, this checkout, first on the path."""
    return {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment, importing Kaizen from `tree`."""
    return {**os.environ, **tree_paths(tree)}


def check_tree(tree: Path) -> None:
    """Fail unless a process started with `tree_env(tree)` runs the code under `tree`."""
    script = "import json, gateway, trainer; print(json.dumps([gateway.__file__, trainer.__file__]))"
    out = subprocess.run(
        [sys.executable, "-c", script], env=tree_env(tree), check=True, capture_output=True, text=True
    )
    modules = json.loads(out.stdout)
    if not all(Path(module).is_relative_to(tree) for module in modules):
        raise RuntimeError(f"a process would import {modules}, not the code under {tree}")
