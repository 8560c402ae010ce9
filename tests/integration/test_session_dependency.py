"""The handlers' session dependency on SQLite and PostgreSQL: a handler's writes are committed when it succeeds,
rolled back when it raises, and a unique-key clash is an OpenAI-shaped 409, not a 500."""

from __future__ import annotations

import asyncio
import time

import httpx
import uvicorn
from litestar import Litestar, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.app import integrity_conflict, provide_session
from gateway.errors import APIError, InvalidRequest
from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.models import Policy
from storage.policies import list_policies
from tests.support.ports import free_port


@post("/policies/{name:str}")
async def create(name: FromPath[str], session: NamedDependency[AsyncSession]) -> dict[str, str]:
    session.add(Policy(name=name, base_model="base"))  # no existence check: the unique key decides
    return {"name": name}


@post("/policies/{name:str}/then-fail")
async def create_then_fail(name: FromPath[str], session: NamedDependency[AsyncSession]) -> None:
    session.add(Policy(name=name, base_model="base"))
    await session.flush()
    raise InvalidRequest("refused after writing", code="refused")


def test_session_commits_rolls_back_and_maps_conflicts(database_url: str) -> None:
    url = async_database_url(database_url)

    async def scenario() -> None:
        await upgrade_database(url)
        database = Database(url)
        app = Litestar(
            route_handlers=[create, create_then_fail],
            dependencies={
                "database": Provide(lambda: database, sync_to_thread=False),
                "session": Provide(provide_session),
            },
            exception_handlers={
                APIError: lambda _, exc: exc.to_response(),
                IntegrityError: integrity_conflict,
            },
        )
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "the app did not start"
            await asyncio.sleep(0.02)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.post("/policies/a")).status_code == 201
                clash = await client.post("/policies/a")
                assert clash.status_code == 409
                assert clash.json() == {
                    "error": {
                        "message": "the request conflicts with stored data",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "conflict",
                    }
                }
                refused = await client.post("/policies/b/then-fail")
                assert refused.status_code == 400
            async with database.session() as session:
                assert [p.name for p in await list_policies(session)] == ["a"]  # b was rolled back
        finally:
            server.should_exit = True
            await serving
            await database.dispose()

    asyncio.run(scenario())
