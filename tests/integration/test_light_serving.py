"""The serving process runs without the training stack: torch, transformers, PEFT, TRL and polars are the `train`
extra's. Work that needs a model loaded with torch (version 0 of a new policy, the embedded model's conversion)
runs in child processes of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gateway.base_models import EMBEDDED_MODELS
from tests.support.scripted_upstream import ScriptedUpstream

HEAVY = ("torch", "transformers", "peft", "trl", "polars")
EMBEDDED = "smollm2-135m-instruct"

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


#: Runs in a fresh interpreter like `_SERVE`, with the app started, one step that needs torch: `create-policy`
#: creates a policy through the admin API on the base model directory argv[2] (version 0 is built); `pull`
#: resolves the embedded model into the models directory argv[2] (the first start of a gateway on an embedded
#: model does that: its GGUF is converted).
_MODEL_JOB = textwrap.dedent(
    """
    import asyncio, json, pathlib, sys

    import gateway.commands.main
    from litestar.testing import AsyncTestClient

    from gateway.app import build_services, create_app
    from gateway.base_models import is_complete, resolve_base_model
    from gateway.settings import Settings
    from migrations.runner import upgrade_database

    step, path = sys.argv[1], sys.argv[2]

    async def create_policy(client: AsyncTestClient, settings: Settings) -> dict:
        created = await client.post(
            "/admin/policies",
            json={{"name": "light", "base_model": path}},
            headers={{"authorization": "Bearer light-admin"}},
            timeout=600,
        )
        version_0 = settings.data_dir / "adapters" / "light" / "0"
        return {{
            "created": created.status_code,
            "active_version": created.json().get("active_version"),
            "version_0": sorted(p.name for p in version_0.iterdir()) if version_0.is_dir() else [],
        }}

    async def pull(client: AsyncTestClient, settings: Settings) -> dict:
        resolved = pathlib.Path(await asyncio.to_thread(resolve_base_model, {embedded!r}, pathlib.Path(path)))
        return {{
            "resolved": str(resolved),
            "complete": is_complete(resolved),
            "model_files": sorted(p.name for p in resolved.iterdir()),
        }}

    async def run() -> dict:
        settings = Settings.load(None)
        await upgrade_database(settings.database_url)
        async with AsyncTestClient(create_app(build_services(settings)), base_url="http://localhost") as client:
            answers = await (create_policy if step == "create-policy" else pull)(client, settings)
            ready = await client.get("/readyz")
        return {{"readyz": ready.status_code, **answers}}

    answers = asyncio.run(run())
    print(json.dumps({{"after_job": sorted(m for m in {heavy} if m in sys.modules), **answers}}))
    """
).format(heavy=repr(set(HEAVY)), embedded=EMBEDDED)


def _light_env(tmp_path: Path, upstream: ScriptedUpstream) -> dict[str, str]:
    return {
        **os.environ,
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream.url,
        "KAIZEN_DATA_DIR": str(tmp_path),
        "KAIZEN_DATABASE_URL": "",
        "KAIZEN_SCHEDULER": "true",
        "KAIZEN_ADMIN_KEY": "light-admin",
    }


def test_serving_process_loads_neither_torch_nor_polars(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVE],
        env=_light_env(tmp_path, upstream),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert (seen["readyz"], seen["chat"]) == (200, 200)
    assert seen["pages"] == [200] * 5
    assert seen["after_import"] == []
    assert seen["after_serving"] == []


def _run_model_job(
    tmp_path: Path, upstream: ScriptedUpstream, step: str, path: Path
) -> tuple[dict[str, Any], str]:
    """What the serving process saw in `_MODEL_JOB`'s `step`, and its log (its stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", _MODEL_JOB, step, str(path)],
        env=_light_env(tmp_path / "data", upstream),
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["readyz"] == 200, done.stderr
    return seen, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_policy_is_created_without_torch_in_the_serving_process(
    tmp_path: Path, upstream: ScriptedUpstream, embedded_model: Path
) -> None:
    """Version 0 loads the base model with PEFT: a child process does it, and its log reaches the gateway's."""
    seen, log = _run_model_job(tmp_path, upstream, "create-policy", embedded_model)

    assert (seen["created"], seen["active_version"]) == (201, 0), log
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(seen["version_0"])
    assert "version 0 ready at" in log
    assert seen["after_job"] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_embedded_model_is_converted_without_torch_in_the_serving_process(
    tmp_path: Path, upstream: ScriptedUpstream, embedded_model: Path
) -> None:
    """The first start on an embedded model dequantises its GGUF and checks the result: a child process does it."""
    gguf_name = Path(EMBEDDED_MODELS[EMBEDDED].wheel_member).name
    extracted = embedded_model.parent / ".cache" / gguf_name
    assert extracted.is_file(), f"the embedded model's pull left no {extracted}"
    models = tmp_path / "fresh-models"
    (models / ".cache").mkdir(parents=True)
    (models / ".cache" / gguf_name).symlink_to(extracted)  # extracted already: no download

    seen, log = _run_model_job(tmp_path, upstream, "pull", models)

    assert (seen["resolved"], seen["complete"]) == (str(models / EMBEDDED), True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(seen["model_files"])
    assert "verified greedy output of saved model" in log
    assert seen["after_job"] == []
