"""Every migration says whether it may run while the previous revision's gateways serve, and the history those
verdicts are read along is one line."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from migrations.online import DIALECTS, Offline, Online

VERSIONS = Path(__file__).resolve().parents[2] / "migrations" / "versions"
MODULES = sorted(p for p in VERSIONS.glob("*.py") if p.name != "__init__.py")


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_every_migration_declares_its_online_safety(path: Path) -> None:
    safety = getattr(load(path), "ONLINE_SAFETY", None)
    assert isinstance(safety, Online | Offline), (
        f"{path.name} must declare ONLINE_SAFETY = Online(...) or Offline(...)"
    )
    assert len(safety.why.split()) >= 5, f"{path.name}: say why, in a sentence an operator can act on"
    if isinstance(safety, Offline):
        assert safety.dialects and set(safety.dialects) <= set(DIALECTS), safety.dialects


def test_the_history_is_one_line() -> None:
    """An old gateway decides whether it may serve on a newer database by walking back from the database's revision
    to its own, one predecessor at a time: branches or merges would make that walk ambiguous."""
    modules = [load(path) for path in MODULES]
    revisions = {m.revision: m.down_revision for m in modules}
    assert all(previous is None or isinstance(previous, str) for previous in revisions.values())
    predecessors = [p for p in revisions.values() if p is not None]
    heads = set(revisions) - set(predecessors)
    assert len(heads) == 1, heads
    assert sorted(predecessors) == sorted(set(revisions) - heads)  # each revision is followed by one at most
    assert [r for r, p in revisions.items() if p is None] == ["0001"]


def test_the_verdict_depends_on_the_database_only_where_declared() -> None:
    rewrite = Offline("copies a table under an exclusive lock", dialects=("postgresql",))
    assert not rewrite.safe_on("postgresql")
    assert rewrite.safe_on("sqlite")
    assert not Offline("drops a table the previous revision writes").safe_on("sqlite")
    assert Online("creates a table nothing reads yet").safe_on("postgresql")


def test_the_operations_guide_lists_every_migration_with_its_verdict() -> None:
    """docs/operations.md's table is what operators plan an upgrade by: it must say what the modules declare."""
    guide = (VERSIONS.parents[1] / "docs" / "operations.md").read_text()
    table = dict(re.findall(r"^\| `(\d{4})` \| (\w+ / \w+) \|", guide, flags=re.MULTILINE))
    declared = {}
    for path in MODULES:
        module = load(path)
        verdicts = ("yes" if module.ONLINE_SAFETY.safe_on(d) else "no" for d in ("postgresql", "sqlite"))
        declared[module.revision] = " / ".join(verdicts)
    assert table == declared
