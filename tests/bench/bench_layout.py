"""The layout's figures for a tree: each package's share of the lines, the gateway's imports of the trainer (and of
its learner), and what the serving process loads: every module after it answered `/readyz` and one captured call
(scripted upstream engine, SQLite, schedules on), and its peak RSS.

    python -m tests.bench.bench_layout [--ref 3c66e6d] [--out tests/bench/results/layout.json]

`--ref` also measures an older commit (unpacked with `git archive`), side by side with this tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from tests.bench.bench_learning import ROOT, tree_env, unpack

logger = logging.getLogger("bench_layout")

PACKAGES = ("gateway", "trainer", "storage", "migrations")
#: The learner's modules, wherever a tree keeps them (before the split they sat directly in `trainer/`).
LEARNER = re.compile(
    r"\s*from trainer\.(learner|model|engine_sampling|train_command|grpo|loss|batch|sft|tokens|distributed|"
    r"dataset|grouping|job|tracking|advantages|torchrun)\b"
)

_PROBE = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from tests.support.scripted_upstream import ScriptedUpstream
    before = set(sys.modules)
    from litestar.testing import AsyncTestClient
    from gateway.app import build_services, create_app
    from gateway.settings import Settings
    try:
        from migrations.runner import upgrade_database
    except ImportError:
        from storage.schema import upgrade_database

    async def serve(url):
        os.environ["KAIZEN_UPSTREAM_URL"] = url
        settings = Settings.load(None)
        await upgrade_database(settings.database_url)
        async with AsyncTestClient(create_app(build_services(settings)), base_url="http://localhost") as client:
            ready = await client.get("/readyz")
            body = {"model": "scripted-1", "messages": [{"role": "user", "content": "a b"}]}
            chat = await client.post("/v1/chat/completions", json=body)
        return ready.status_code, chat.status_code

    with ScriptedUpstream() as upstream:
        codes = asyncio.run(serve(upstream.url))
    loaded = sorted(set(sys.modules) - before)
    own = [m for m in loaded if m.split(".")[0] in ("gateway", "trainer", "storage", "migrations")]
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"codes": codes, "modules": len(loaded), "own": own, "peak_rss_kib": peak}))
    """
)


def measure(tree: Path) -> dict[str, Any]:
    lines = {
        pkg: sum(len(p.read_text().splitlines()) for p in (tree / pkg).rglob("*.py")) for pkg in PACKAGES
    }
    imports = trainer_imports = 0
    for path in (tree / "gateway").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from trainer[\w.]* import|import trainer)", line):
                imports += 1
                trainer_imports += bool(LEARNER.match(line))
    with tempfile.TemporaryDirectory() as data:
        env = {
            **tree_env(tree),
            "KAIZEN_ENGINE": "upstream",
            "KAIZEN_DATA_DIR": data,
            "KAIZEN_DATABASE_URL": "",
            "KAIZEN_SCHEDULER": "true",
        }
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, cwd=data, capture_output=True, text=True, check=True
        )
    served = json.loads(done.stdout.strip().splitlines()[-1])
    total = sum(lines.values())
    return {
        "lines": lines,
        "biggest_share": round(max(lines.values()) / total, 3),
        "gateway_modules_at_top": len(list((tree / "gateway").glob("*.py"))),
        "gateway_imports_of_trainer": imports,
        "gateway_imports_of_the_learner": trainer_imports,
        "serving": {
            "answers": served["codes"],
            "modules_loaded": served["modules"],
            "own_modules_loaded": len(served["own"]),
            "commands_or_learner_loaded": [
                m for m in served["own"] if "command" in m or LEARNER.match(f"from {m}") or m == "gateway.cli"
            ],
            "peak_rss_mib": round(served["peak_rss_kib"] / 1024, 1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ref", help="Also measure this older commit.")
    parser.add_argument("--out", type=Path, default=ROOT / "tests/bench/results/layout.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: dict[str, Any] = {"command": " ".join(["python -m tests.bench.bench_layout", *sys.argv[1:]])}
    if args.ref:
        with tempfile.TemporaryDirectory() as work:
            tree = Path(work) / "tree"
            result["before"] = {"commit": unpack(args.ref, tree), **measure(tree)}
    result["after"] = measure(ROOT)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s: %s", args.out, json.dumps(result))


if __name__ == "__main__":
    main()
