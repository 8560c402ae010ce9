"""Tools Kaizen can run for a policy: its MCP servers' tools and its Python functions (`tools` in its
configuration), each call bounded by a time limit and a result size limit.

The gateway offers them to apps as an MCP server (`gateway.mcp`), the trainer calls them when it rolls an agent
episode out again (`trainer.control.rollouts`; only tools whose source allows it: a tool with side effects must
not run once per resampled attempt), and MCP•RL bootstrapping writes scenarios from their list. A call never
raises: a failing, slow or unknown tool answers with an error the agent reads, as it would read any result.

The `mcp` SDK is imported only when a policy names an MCP server: building its types takes seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import time
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.control.policy_config import FunctionToolConfig, McpServerConfig, ToolsConfig
from trainer.control.rollouts import ToolOutcome
from trainer.control.scoring import load_function

logger = logging.getLogger(__name__)

#: The names OpenAI's chat API (and vLLM) accept for a function tool.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}


class ToolsUnavailable(RuntimeError):
    """A tool source could not be opened (an MCP server that does not start or answer)."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model is offered it, and where its calls go."""

    name: str
    description: str
    parameters: dict[str, Any]
    #: The MCP server's name, or `function`.
    source: str
    #: May the trainer call it while resampling (the source's `resample` flag)?
    resample: bool

    def openai(self) -> dict[str, Any]:
        """The tool as a chat completion request's `tools` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


Call = Callable[[dict[str, Any]], Awaitable[ToolOutcome]]


@dataclass
class ToolCallRecord:
    """What one call did, for the episode it belongs to (`tool_calls`) and the run's counters."""

    tool: str
    source: str
    arguments: dict[str, Any] | str
    content: str
    is_error: bool
    latency_ms: float


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    base = origin or annotation
    if base is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def function_spec(function: Callable[..., Any], config: FunctionToolConfig) -> ToolSpec:
    """A Python function as a tool: its name, the first paragraph of its docstring, and a JSON schema of its
    parameters read from their annotations (those with a default are optional)."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)
    properties: dict[str, Any] = {}
    required = []
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[name] = _json_type(hints.get(name, Any))
        if parameter.default is parameter.empty:
            required.append(name)
    doc = inspect.getdoc(function) or ""
    return ToolSpec(
        name=config.name or function.__name__,
        description=doc.split("\n\n")[0].replace("\n", " ").strip(),
        parameters={"type": "object", "properties": properties, "required": required},
        source="function",
        resample=config.resample,
    )


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[the result was cut at {limit} of {len(text)} characters]"


def _arguments(raw: str | Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments as the JSON object a tool takes; raises ValueError for anything else."""
    value = (json.loads(raw) if raw.strip() else {}) if isinstance(raw, str) else dict(raw)
    if not isinstance(value, dict):
        raise ValueError("the arguments must be a JSON object")
    return value


@dataclass
class ToolBox:
    """A policy's tools, open for calls: `async with ToolBox(config) as tools: ...`.

    `for_resampling` keeps only the tools of sources that allow the trainer to call them. A source that cannot be
    opened is left out and named in `unavailable` (the others stay usable); `strict` raises `ToolsUnavailable`
    instead, for a start that should fail loudly (bootstrapping from a server that is not there)."""

    config: ToolsConfig
    for_resampling: bool = False
    strict: bool = False
    specs: list[ToolSpec] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    #: Every call made so far, in order (the gateway stores them with their episode).
    calls: list[ToolCallRecord] = field(default_factory=list)
    _routes: dict[str, Call] = field(default_factory=dict)
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def __aenter__(self) -> ToolBox:
        await self._stack.__aenter__()
        try:
            for server in self.config.servers:
                if self.for_resampling and not server.resample:
                    continue
                try:
                    # In this task (not wait_for's): the SDK's transports must be closed where they were opened.
                    async with asyncio.timeout(server.timeout_s):
                        await self._open_server(server)
                except Exception as exc:  # a server down must not take the others (or the run) with it
                    reason = f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
                    if self.strict:
                        raise ToolsUnavailable(f"MCP server {server.name!r}: {reason}") from exc
                    logger.warning("MCP server %s is unavailable: %s", server.name, reason)
                    self.unavailable[server.name] = reason
            for function in self.config.functions:
                if not self.for_resampling or function.resample:
                    self._add_function(function)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def openai_tools(self) -> list[dict[str, Any]]:
        return [spec.openai() for spec in self.specs]

    def can_call(self, name: str) -> bool:
        return name in self._routes

    async def call(self, name: str, arguments: str | Mapping[str, Any]) -> ToolOutcome:
        """Call a tool; whatever happens, the answer is a `ToolOutcome` (an error the agent can read)."""
        started = time.perf_counter()
        spec = next((s for s in self.specs if s.name == name), None)
        try:
            parsed: dict[str, Any] | str = _arguments(arguments)
        except ValueError as exc:
            parsed = arguments if isinstance(arguments, str) else dict(arguments)
            outcome = ToolOutcome(f"Error: the arguments of {name} are not a JSON object: {exc}", True)
        else:
            route = self._routes.get(name)
            if route is None or spec is None:
                outcome = ToolOutcome(f"Error: there is no tool named {name!r}", True)
            else:
                limit = self._limit(spec)
                try:
                    async with asyncio.timeout(limit):
                        outcome = await route(parsed)  # type: ignore[arg-type]
                except TimeoutError:
                    outcome = ToolOutcome(f"Error: {name} did not answer within {limit:g} s", True)
                except Exception as exc:  # the tool's own failure: the agent reads it
                    logger.info("tool %s failed: %r", name, exc)
                    outcome = ToolOutcome(f"Error: {name} failed: {type(exc).__name__}: {exc}"[:2000], True)
        outcome = ToolOutcome(_clip(outcome.content, self.config.max_result_chars), outcome.is_error)
        self.calls.append(
            ToolCallRecord(
                name,
                spec.source if spec is not None else "",
                parsed,
                outcome.content,
                outcome.is_error,
                (time.perf_counter() - started) * 1000,
            )
        )
        return outcome

    def _limit(self, spec: ToolSpec) -> float:
        server = next((s for s in self.config.servers if s.name == spec.source), None)
        return server.timeout_s if server is not None else self.config.timeout_s

    def _add(self, spec: ToolSpec, route: Call) -> None:
        if not TOOL_NAME.match(spec.name):
            logger.warning(
                "tool %r of %s left out: a tool's name must match %s",
                spec.name,
                spec.source,
                TOOL_NAME.pattern,
            )
            return
        if spec.name in self._routes:
            raise ToolsUnavailable(
                f"two tools are named {spec.name!r} (in {spec.source} and an earlier source)"
            )
        self.specs.append(spec)
        self._routes[spec.name] = route

    def _add_function(self, config: FunctionToolConfig) -> None:
        function = load_function(config.path)

        async def call(arguments: dict[str, Any]) -> ToolOutcome:
            if inspect.iscoroutinefunction(function):
                answer = await function(**arguments)
            else:
                # A blocking function runs in a thread, so a slow one stalls neither the gateway nor the other
                # rollouts (past its time limit its answer is no longer waited for).
                answer = await asyncio.to_thread(function, **arguments)
            return ToolOutcome(answer if isinstance(answer, str) else json.dumps(answer, default=str))

        self._add(function_spec(function, config), call)

    async def _open_server(self, server: McpServerConfig) -> None:
        from mcp import ClientSession
        from mcp_types import PaginatedRequestParams

        read, write = await self._stack.enter_async_context(_transport(server))
        session = await self._stack.enter_async_context(
            ClientSession(read, write, read_timeout_seconds=server.timeout_s)
        )
        await session.initialize()
        cursor: str | None = None
        while True:
            listed = await session.list_tools(
                params=PaginatedRequestParams(cursor=cursor) if cursor else None
            )
            for tool in listed.tools:
                spec = ToolSpec(
                    name=tool.name,
                    description=tool.description or "",
                    parameters=dict(tool.input_schema or {"type": "object", "properties": {}}),
                    source=server.name,
                    resample=server.resample,
                )
                self._add(spec, _mcp_call(session, tool.name, server.timeout_s))
            cursor = listed.next_cursor
            if not cursor:
                break


def _mcp_call(session: Any, name: str, timeout_s: float) -> Call:
    async def call(arguments: dict[str, Any]) -> ToolOutcome:
        result = await session.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        return ToolOutcome(result_text(result), bool(result.is_error))

    return call


def result_text(result: Any) -> str:
    """An MCP tool result as a chat `tool` message's text: its text blocks, other blocks as JSON."""
    import mcp_types

    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        else:
            parts.append(block.model_dump_json(by_alias=True, exclude_none=True))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, default=str))
    return "\n".join(parts)


def _transport(server: McpServerConfig) -> contextlib.AbstractAsyncContextManager[Any]:
    """The MCP transport of a server: streamable HTTP for a URL, a child process over stdio for a command."""
    if server.url:
        return _http_transport(server)
    from mcp import StdioServerParameters, stdio_client

    assert server.command
    parameters = StdioServerParameters(
        command=server.command[0], args=list(server.command[1:]), env=dict(server.env) or None, cwd=server.cwd
    )
    return stdio_client(parameters)


@contextlib.asynccontextmanager
async def _http_transport(server: McpServerConfig) -> Any:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    timeout = httpx2.Timeout(server.timeout_s, read=server.timeout_s)
    async with (
        httpx2.AsyncClient(headers=dict(server.headers), timeout=timeout) as http,
        streamable_http_client(server.url or "", http_client=http) as (read, write),
    ):
        yield read, write
