"""The import rules of the layout, read from the source: which package may import which, and what the serving
process, the capture writer and the client can ever load.

Every `import` counts, including those inside functions (they run when the function does); only those under
`if TYPE_CHECKING:` do not. So a rule holds for every path through the code, not just the ones a test happens to
run (tests/integration/test_light_serving.py checks the running process too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "trainer", "storage", "migrations")
#: What the training stack brings: never in the serving process, the capture writer or the client.
HEAVY = ("torch", "transformers", "peft", "trl", "unsloth", "polars", "pyarrow", "gguf", "datasets")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = sources()[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


@cache
def imports(module: str, top_level_only: bool = False) -> frozenset[str]:
    """Every module `module` imports (`from a import b` counts as `a` and, when it is one, `a.b`)."""
    found: set[str] = set()

    def visit(nodes: Iterable[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking_only(node):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in sources())
            if top_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue  # a function's imports run when it is called, not when its module is imported
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit(children)

    visit(ast.parse(sources()[module].read_text()).body)
    return frozenset(found)


def closure(start: str, top_level_only: bool = False) -> dict[str, str]:
    """Every module reachable from `start`, each with the module that first imports it (for the failure)."""
    seen = {start: ""}
    todo = [start]
    while todo:
        current = todo.pop()
        for name in imports(current, top_level_only):
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]
            for step in parents:  # importing a.b.c runs a and a.b first
                if step not in seen:
                    seen[step] = current
                    if step in sources():
                        todo.append(step)
    return seen


def path_to(seen: dict[str, str], target: str) -> str:
    chain = [target]
    while seen.get(chain[-1]):
        chain.append(seen[chain[-1]])
    return " <- ".join(chain)


def forbidden(seen: dict[str, str], banned: Iterable[str]) -> list[str]:
    return sorted(
        path_to(seen, name) for name in seen if any(name == b or name.startswith(b + ".") for b in banned)
    )


@pytest.mark.parametrize(
    "entry",
    ["gateway.app", "gateway.capture.writer", "gateway.client"],
    ids=["serving-process", "capture-writer", "client"],
)
def test_light_processes_can_never_load_the_training_stack(entry: str) -> None:
    """Not the training stack, not the learner, and not the commands, demo or client around the serving path."""
    seen = closure(entry)
    banned = [*HEAVY, "trainer.learner"]
    if entry != "gateway.client":
        banned += ["gateway.commands", "gateway.demo", "gateway.client"]
    assert forbidden(seen, banned) == []


def test_every_command_starts_light() -> None:
    """`kaizen` parses its command line before it loads what the command needs: what every command imports on
    the way (each command module's top level) never holds the training stack."""
    assert forbidden(closure("gateway.commands.main", top_level_only=True), [*HEAVY, "trainer.learner"]) == []


def test_only_a_training_process_imports_the_learner() -> None:
    outside = [m for m in sources() if not m.startswith("trainer.learner")]
    offenders = sorted(
        f"{m} imports {n}" for m in outside for n in imports(m) if n.startswith("trainer.learner")
    )
    assert offenders == []


@pytest.mark.parametrize(
    ("package", "banned"),
    [
        ("trainer", ("gateway",)),
        ("trainer.control", ("gateway", "trainer.learner", *HEAVY)),
        ("storage", ("gateway", "trainer", "migrations")),
        ("migrations", ("gateway", "trainer")),
    ],
)
def test_dependencies_point_one_way(package: str, banned: tuple[str, ...]) -> None:
    """gateway -> trainer -> storage, and migrations -> storage: never back."""
    offenders = sorted(
        f"{m} imports {n}"
        for m in sources()
        if m == package or m.startswith(package + ".")
        for n in imports(m)
        if any(n == b or n.startswith(b + ".") for b in banned)
    )
    assert offenders == []


def test_the_rules_see_what_they_check() -> None:
    """The reader finds imports in functions, skips TYPE_CHECKING ones, and follows packages: a sanity check."""
    assert "torch" in imports("trainer.learner.model")
    assert "trainer.learner.grpo" in closure("trainer.learner.job")
    assert "trainer.learner.distributed" not in imports("trainer.learner.train_command", top_level_only=True)
    assert "gateway.engines.vllm" in closure("gateway.app")  # a function-level import
    assert "trainer.control.policy_config" in closure("gateway.app")
