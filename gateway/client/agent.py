"""Agent rollouts from user code: the policy's tools through the gateway's MCP endpoint, and the loop that runs an
episode with them.

`PolicyTools` is an MCP client of `/mcp/<policy>` (the official SDK): each tool call it makes is recorded in the
episode of the trajectory it was opened for, beside that episode's chat calls. `run_agent` is the loop agents
share: the policy answers, each tool call it asks for is answered through the tools, and it answers again, up to
a turn limit; the whole conversation is captured as one episode, which the gateway can roll out again when it
trains (the same tools run there).

    async with model.tools(trajectory) as tools:
        outcome = await run_agent(trajectory, [{"role": "user", "content": scenario}], tools, max_turns=6)
    trajectory.reward = my_reward(outcome.answer)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.client.connection import Connection
from gateway.client.trajectories import Trajectory

#: Where a tool listed by `/mcp/<policy>` comes from (an MCP server's name, or `function`), in its `_meta`.
SOURCE_META = "kaizen/source"


@dataclass(frozen=True)
class ListedTool:
    name: str
    description: str
    parameters: dict[str, Any]
    source: str

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class PolicyTools:
    """An open MCP session on a policy's tools, for one episode."""

    session: Any
    listed: list[ListedTool]

    def openai_tools(self, source: str | None = None) -> list[dict[str, Any]]:
        """The tools as a chat request's `tools`; `source`: only those of one MCP server."""
        return [t.openai() for t in self.listed if source is None or t.source == source]

    async def call(self, name: str, arguments: str | Mapping[str, Any]) -> tuple[str, bool]:
        """(the result's text, whether it is an error); arguments that are not a JSON object are an error too."""
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        except ValueError as exc:
            return f"Error: the arguments of {name} are not JSON: {exc}", True
        if not isinstance(parsed, dict):
            return f"Error: the arguments of {name} are not a JSON object", True
        result = await self.session.call_tool(name, parsed)
        text = "\n".join(getattr(block, "text", "") for block in result.content)
        return text, bool(result.is_error)


@contextlib.asynccontextmanager
async def open_tools(
    connection: Connection, policy: str, trajectory: Trajectory | None = None, *, timeout_s: float = 120.0
) -> AsyncIterator[PolicyTools]:
    """An MCP session on `/mcp/<policy>` with the client key; calls made through it join `trajectory`'s episode."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {connection.api_key}"} if connection.api_key else {}
    if trajectory is not None:
        headers.update(trajectory.headers)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(timeout_s)) as http,
        streamable_http_client(f"{connection.root}/mcp/{policy}", http_client=http) as (read, write),
        ClientSession(read, write, read_timeout_seconds=timeout_s) as session,
    ):
        await session.initialize()
        listed = await session.list_tools()
        tools = [
            ListedTool(
                t.name,
                t.description or "",
                dict(t.input_schema or {"type": "object", "properties": {}}),
                str((t.meta or {}).get(SOURCE_META, "")),
            )
            for t in listed.tools
        ]
        yield PolicyTools(session, tools)


@dataclass
class AgentOutcome:
    """How an agent episode went: the whole conversation, its final answer, and what it did on the way."""

    messages: list[dict[str, Any]]
    answer: str | None
    turns: int
    tool_calls: int = 0
    tool_errors: int = 0
    #: Why it ended: `answered`, `turn_limit` (still calling tools) or `truncated` (cut by the token limit).
    ending: str = "answered"
    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool, arguments as sent)


async def run_agent(
    trajectory: Trajectory,
    messages: list[dict[str, Any]],
    tools: PolicyTools,
    *,
    max_turns: int = 8,
    source: str | None = None,
    first_tool_choice: Any = None,
    **create: Any,
) -> AgentOutcome:
    """Run one episode of the trajectory's policy with its tools: answer, call the tools asked for, answer again,
    at most `max_turns` assistant turns. `first_tool_choice` applies to the first turn only (later turns are
    `auto`); `create` goes to every `chat.completions.create` (max_tokens, temperature, seed, metadata, ...)."""
    client = trajectory.async_openai_client(max_retries=2)
    offered = tools.openai_tools(source)
    conversation = list(messages)
    outcome = AgentOutcome(conversation, None, 0)
    try:
        while True:
            options = dict(create)
            if outcome.turns == 0 and first_tool_choice is not None:
                options["tool_choice"] = first_tool_choice
            completion = await client.chat.completions.create(
                model=trajectory.model,
                messages=conversation,  # type: ignore[arg-type]
                tools=offered,  # type: ignore[arg-type]
                **options,
            )
            outcome.turns += 1
            choice = completion.choices[0]
            message = choice.message.model_dump(exclude_none=True)
            conversation.append(message)
            calls = message.get("tool_calls") or []
            if choice.finish_reason == "length":
                outcome.ending = "truncated"
            if not calls or choice.finish_reason == "length":
                outcome.answer = message.get("content")
                return outcome
            if outcome.turns >= max_turns:
                outcome.ending = "turn_limit"
                return outcome
            for call in calls:
                name, arguments = call["function"]["name"], call["function"].get("arguments") or "{}"
                text, is_error = await tools.call(name, arguments)
                outcome.tool_calls += 1
                outcome.tool_errors += is_error
                outcome.calls.append((name, arguments))
                conversation.append({"role": "tool", "tool_call_id": call["id"], "content": text})
    finally:
        await client.close()
