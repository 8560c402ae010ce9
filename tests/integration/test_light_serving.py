"""The serving process starts without the training stack: torch and polars are the `train` extra's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.scripted_upstream import ScriptedUpstream

HEAVY = ("torch", "polars")

#: Runs in a fresh interpreter, so the test process's own imports cannot hide one: imports the serving
#: entry point, starts the app (engine, capture, router, scheduler), answers /readyz and one captured call,
#: and renders the dashboard's pages.
_SERVE = textwrap.dedent(
    """
    import asyncio, json, sys

    import gateway.commands.main
    from litestar.testing import AsyncTestClient

    from gateway.app import build_services, create_app
    from gateway.settings import Settings
    from migrations.runner import upgrade_database

    after_import = sorted(m for m in {heavy} if m in sys.modules)

    async def serve() -> dict:
        settings = Settings.load(None)
        await upgrade_database(settings.database_url)
        # An open gateway answers loopback host names only (not the test client's `testserver.local`).
        async with AsyncTestClient(create_app(build_services(settings)), base_url="http://localhost") as client:
            ready = await client.get("/readyz")
            chat = await client.post(
                "/v1/chat/completions",
                json={{"model": "scripted-1", "messages": [{{"role": "user", "content": "a b"}}]}},
            )
            await client.post("/dashboard/session", json={{"key": "light-admin"}})
            pages = [
                (await client.get(page)).status_code
                for page in ("/dashboard", "/dashboard/episodes", "/dashboard/policies", "/dashboard/runs",
                             "/dashboard/judge")
            ]
        return {{"readyz": ready.status_code, "chat": chat.status_code, "pages": pages}}

    answers = asyncio.run(serve())
    print(json.dumps({{
        "after_import": after_import,
        "after_serving": sorted(m for m in {heavy} if m in sys.modules),
        **answers,
    }}))
    """
).format(heavy=repr(set(HEAVY)))


def test_serving_process_loads_neither_torch_nor_polars(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    env = {
        **os.environ,
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream.url,
        "KAIZEN_DATA_DIR": str(tmp_path),
        "KAIZEN_DATABASE_URL": "",
        "KAIZEN_SCHEDULER": "true",
        "KAIZEN_ADMIN_KEY": "light-admin",
    }
    done = subprocess.run(
        [sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert (seen["readyz"], seen["chat"]) == (200, 200)
    assert seen["pages"] == [200] * 5
    assert seen["after_import"] == []
    assert seen["after_serving"] == []
