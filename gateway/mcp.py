"""`/mcp/<policy>`: the gateway as the MCP server of a policy's tools (streamable HTTP, the official `mcp` SDK).

An app that runs an agent through Kaizen can take its tools from here too: the same keys, scopes (`chat`) and
model allow-lists as `/v1`, the policy's MCP servers and Python functions behind it (`trainer.control.tools`), and
every call recorded in `tool_calls` with the episode its request names (`X-Episode-Id`, as chat calls do), after
the policy's redaction. The tools then run where the trainer runs them too, so an episode that used them can be
rolled out again. A failing or slow tool answers with an error result, never a 5xx.

The endpoint is stateless (each POST stands alone, so any replica answers it) and answers with JSON, not a
stream. The SDK, whose types take seconds to build, is imported on the first request to `/mcp`, not at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import Receive, Scope, Send

from gateway.auth import Principal, authenticate_client, principal_in, set_principal
from gateway.errors import NotFound, PermissionDenied
from gateway.redaction import Redactor
from gateway.routing import PoliciesUnavailable
from storage.database import Database
from storage.policies import get_policy
from storage.tool_calls import record_tool_call
from trainer.control.policy_config import InvalidPolicyConfig, ToolsConfig, load_policy_config
from trainer.control.tools import ToolBox

log = logging.getLogger(__name__)

PATH = "/mcp"
#: Where a listed tool comes from (its MCP server's name, or `function`), in the tool's `_meta`.
SOURCE_META = "kaizen/source"
EPISODE_HEADER = "x-episode-id"
_EPISODE_ID_LENGTH = 64


def policy_of(scope: Scope) -> str:
    """The policy a request to `/mcp/<policy>` names ('' for `/mcp` itself)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode(errors="replace").split("?", 1)[0]
    return path.removeprefix(PATH).strip("/")


class ToolHost:
    """One policy's `ToolBox`, opened and closed by a task of its own: the SDK's transports must be closed by the
    task that opened them, while calls come from every request's task."""

    def __init__(self, config: ToolsConfig) -> None:
        self.config = config
        self._box: asyncio.Future[ToolBox] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._task = asyncio.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            async with ToolBox(self.config) as box:
                self._box.set_result(box)
                await self._closing.wait()
        except BaseException as exc:
            if not self._box.done():
                self._box.set_exception(exc)
            raise

    async def box(self) -> ToolBox:
        return await asyncio.shield(self._box)

    async def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(BaseException):
            await self._task


@dataclass
class _Held:
    fingerprint: str
    host: ToolHost
    read_at: float


class PolicyTools:
    """Each policy's tools, opened on first use and reopened when its `tools` section changes (re-read at most
    every `refresh_s`)."""

    def __init__(self, database: Database, refresh_s: float) -> None:
        self.database = database
        self.refresh_s = refresh_s
        self._held: dict[str, _Held] = {}
        self._lock = asyncio.Lock()

    async def box(self, policy: str) -> ToolBox:
        held = self._held.get(policy)
        if held is not None and time.monotonic() - held.read_at < self.refresh_s:
            return await held.host.box()
        async with self._lock:
            config = await self._config(policy)
            fingerprint = hashlib.sha256(config.model_dump_json().encode()).hexdigest()
            held = self._held.get(policy)
            if held is not None and held.fingerprint == fingerprint:
                held.read_at = time.monotonic()
            else:
                if held is not None:
                    await held.host.close()
                held = self._held[policy] = _Held(fingerprint, ToolHost(config), time.monotonic())
        return await held.host.box()

    async def _config(self, policy: str) -> ToolsConfig:
        async with self.database.session() as session:
            row = await get_policy(session, policy)
        if row is None:
            raise NotFound(f"no policy named {policy!r}", param="policy", code="policy_not_found")
        try:
            return load_policy_config(row.config).tools
        except InvalidPolicyConfig as exc:  # stored before a check existed: no tools, said clearly
            log.error("policy %s: invalid configuration, no tools offered: %s", policy, exc)
            return ToolsConfig()

    async def close(self) -> None:
        for held in self._held.values():
            await held.host.close()
        self._held.clear()


class McpEndpoint:
    """The SDK's session manager behind the `/mcp` mount, run by a task of its own from the first request."""

    def __init__(
        self,
        database: Database,
        tools: PolicyTools,
        redactor: Callable[[str], Awaitable[Redactor | None]],
        on_call: Callable[[str, str, bool], None] | None = None,
    ) -> None:
        self.database = database
        self.tools = tools
        self.redactor = redactor
        self.on_call = on_call
        self._manager: asyncio.Future[Any] | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager = await self._started()
        await manager.handle_request(scope, receive, send)

    async def _started(self) -> Any:
        if self._manager is None:
            self._manager = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._manager))
        return await asyncio.shield(self._manager)

    async def _run(self, ready: asyncio.Future[Any]) -> None:
        try:
            from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

            manager = StreamableHTTPSessionManager(app=self._server(), stateless=True, json_response=True)
            async with manager.run():
                ready.set_result(manager)
                await self._stopping.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        await self.tools.close()

    def _server(self) -> Any:
        import mcp_types as types
        from mcp.server.lowlevel import Server

        async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
            box = await self.tools.box(policy_of(ctx.request.scope))
            return types.ListToolsResult(
                tools=[
                    types.Tool(
                        name=s.name,
                        description=s.description,
                        input_schema=s.parameters,
                        _meta={SOURCE_META: s.source},
                    )
                    for s in box.specs
                ]
            )

        async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
            request = ctx.request
            policy = policy_of(request.scope)
            box = await self.tools.box(policy)
            arguments = dict(params.arguments or {})
            started = time.perf_counter()
            outcome = await box.call(params.name, arguments)
            latency_ms = (time.perf_counter() - started) * 1000
            spec = next((s for s in box.specs if s.name == params.name), None)
            principal = principal_in(request.scope)
            await self._record(
                policy,
                principal,
                request.headers.get(EPISODE_HEADER),
                params.name,
                spec.source if spec is not None else "",
                arguments,
                outcome.content,
                outcome.is_error,
                latency_ms,
            )
            return types.CallToolResult(
                content=[types.TextContent(text=outcome.content)], is_error=outcome.is_error
            )

        return Server("kaizen", version="1", on_list_tools=list_tools, on_call_tool=call_tool)

    async def _record(
        self,
        policy: str,
        principal: Principal,
        episode_id: str | None,
        tool: str,
        source: str,
        arguments: dict[str, Any],
        result: str,
        is_error: bool,
        latency_ms: float,
    ) -> None:
        """Store the call with its episode; a database that is down loses the record, never the answer."""
        if self.on_call is not None:
            self.on_call(policy, tool, is_error)
        try:
            redactor = await self.redactor(policy)
        except PoliciesUnavailable:
            log.warning(
                "tool call %s of %s not recorded: the policy's privacy section could not be read",
                tool,
                policy,
            )
            return
        if redactor is not None:
            arguments, result = redactor.value(arguments), redactor.text(result)
        if episode_id is not None and (len(episode_id) > _EPISODE_ID_LENGTH or "\x00" in episode_id):
            episode_id = None
        try:
            async with self.database.session() as session:
                await record_tool_call(
                    session,
                    id=f"tool_{uuid.uuid4().hex}",
                    episode_id=episode_id,
                    policy=policy,
                    tool=tool[:64],
                    source=source[:64],
                    arguments=json.loads(json.dumps(arguments, default=str)),
                    result=result,
                    is_error=is_error,
                    latency_ms=latency_ms,
                    key_id=principal.key_id,
                    project=principal.project,
                )
                await session.commit()
        except Exception as exc:
            log.warning("tool call %s of %s answered but not recorded: %s", tool, policy, exc)


def requires_policy_tools(
    database: Database,
) -> Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], Any]:
    """The `/mcp` guard: a client key with the `chat` scope that may use the policy the path names, which exists
    and is shared or its project's (another project's owned policy is answered as one that does not exist; an
    admin key's tool calls on it are recorded under its owner, as its chat calls are)."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        principal = authenticate_client(
            connection.app.state.key_ring, connection.headers.get("authorization"), "chat"
        )
        set_principal(connection, principal)
        policy = policy_of(connection.scope)
        if not policy:
            raise NotFound("name a policy: /mcp/<policy>", param="policy", code="policy_not_found")
        if not principal.may_use(policy, policy):
            raise PermissionDenied(
                f"This key may not use the policy `{policy}`.", param="policy", code="model_not_allowed"
            )
        async with database.session() as session:
            found = await get_policy(session, policy)
        acting = None if found is None else principal.acting_on(found.project)
        if acting is None:
            raise NotFound(f"no policy named {policy!r}", param="policy", code="policy_not_found")
        set_principal(connection, acting)

    return guard
