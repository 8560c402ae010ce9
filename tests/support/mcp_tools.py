"""A small MCP server for the tests, built on the official SDK: `python -m tests.support.mcp_tools` speaks MCP
over stdio, `... --http PORT` over streamable HTTP at `/mcp` (stateless).

Tools: `lookup(key)` answers from a fixed table (an unknown key is an `is_error` result, as a server reports one),
`slow(seconds)` answers after a pause, `broken()` raises in its handler. Every call is appended to the file named
by `MCP_TOOLS_LOG`, if set, so a test can count what reached the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

FACTS = {"zorland": "Quix", "vellmar": "Ostra", "k17": "blue"}


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(line)


def build_server() -> Any:
    import mcp_types as types
    from mcp.server.lowlevel import Server

    tools = [
        types.Tool(
            name="lookup",
            description="Look up the capital stored under a country's key.",
            input_schema={
                "type": "object",
                "properties": {"key": {"type": "string", "description": "a country, lower case"}},
                "required": ["key"],
            },
        ),
        types.Tool(
            name="slow",
            description="Answer after a pause.",
            input_schema={"type": "object", "properties": {"seconds": {"type": "number"}}},
        ),
        types.Tool(
            name="broken", description="Always fails.", input_schema={"type": "object", "properties": {}}
        ),
    ]

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = params.arguments or {}
        log = os.environ.get("MCP_TOOLS_LOG")
        if log:
            line = json.dumps({"tool": params.name, "arguments": arguments}) + "\n"
            await asyncio.to_thread(_append, log, line)
        if params.name == "lookup":
            key = str(arguments.get("key", ""))
            if key not in FACTS:
                return types.CallToolResult(
                    content=[types.TextContent(text=f"no entry for {key!r}")], is_error=True
                )
            return types.CallToolResult(content=[types.TextContent(text=f"capital: {FACTS[key]}")])
        if params.name == "slow":
            await asyncio.sleep(float(arguments.get("seconds", 5)))
            return types.CallToolResult(content=[types.TextContent(text="done")])
        raise RuntimeError("the broken tool broke")

    return Server("kaizen-test-tools", version="1", on_list_tools=list_tools, on_call_tool=call_tool)


async def serve_stdio() -> None:
    from mcp.server.stdio import stdio_server

    server = build_server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def http_app() -> Any:
    from litestar import Litestar
    from litestar.handlers import asgi
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    manager = StreamableHTTPSessionManager(app=build_server(), stateless=True, json_response=True)

    @asgi("/mcp", is_mount=True)
    async def mount(scope: Any, receive: Any, send: Any) -> None:
        await manager.handle_request(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        async with manager.run():
            yield

    return Litestar(route_handlers=[mount], lifespan=[lifespan], logging_config=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, help="Serve streamable HTTP on this loopback port.")
    args = parser.parse_args()
    if args.http is None:
        asyncio.run(serve_stdio())
        return
    import uvicorn

    uvicorn.run(http_app(), host="127.0.0.1", port=args.http, log_level="warning")


if __name__ == "__main__":
    main()
