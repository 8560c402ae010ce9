"""A policy's tools: Python functions and a real MCP server over stdio, each call bounded in time and size, and
no call ever raising (a failing tool is an answer the agent reads)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from trainer.control.policy_config import InvalidPolicyConfig, ToolsConfig, load_policy_config
from trainer.control.tools import ToolBox, ToolsUnavailable

FUNCTIONS = "tests.support.tool_functions"
STDIO = {"name": "atlas", "command": [sys.executable, "-m", "tests.support.mcp_tools"], "timeout_s": 60}


def tools(**config: object) -> ToolsConfig:
    return load_policy_config({"tools": config}).tools


def test_a_function_is_a_tool_with_the_schema_of_its_annotations() -> None:
    async def scenario() -> None:
        async with ToolBox(tools(functions=[f"{FUNCTIONS}:capital", f"{FUNCTIONS}:population"])) as box:
            capital, population = box.openai_tools()
            assert capital["function"] == {
                "name": "capital",
                "description": "Give the capital of a country.",
                "parameters": {
                    "type": "object",
                    "properties": {"country": {"type": "string"}, "unit": {"enum": ["name", "code"]}},
                    "required": ["country"],
                },
            }
            assert population["function"]["parameters"]["properties"]["year"] == {"type": "integer"}
            assert (await box.call("capital", '{"country": "zorland"}')).content == "Quix"
            assert (await box.call("capital", {"country": "vellmar", "unit": "code"})).content == "OS"
            answer = await box.call("population", '{"country": "zorland"}')
            assert json.loads(answer.content) == {"country": "zorland", "year": 2026, "people": 7000}
            assert not answer.is_error
            assert [c.tool for c in box.calls] == ["capital", "capital", "population"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("capital", '{"country": "atlantis"}', "capital failed: KeyError"),  # the function raised
        ("capital", '["zorland"]', "not a JSON object"),
        ("capital", "{not json", "not a JSON object"),
        ("capital", '{"nation": "zorland"}', "capital failed: TypeError"),  # an argument it does not take
        ("weather", "{}", "there is no tool named 'weather'"),
        ("sleepy", '{"seconds": 5}', "sleepy did not answer within 0.3 s"),
    ],
)
def test_a_failing_call_is_an_error_the_agent_reads_never_an_exception(
    name: str, arguments: str, error: str
) -> None:
    config = tools(functions=[f"{FUNCTIONS}:capital", f"{FUNCTIONS}:sleepy"], timeout_s=0.3)

    async def scenario() -> None:
        async with ToolBox(config) as box:
            outcome = await box.call(name, arguments)
            assert outcome.is_error and outcome.content.startswith("Error: ")
            assert error in outcome.content
            assert box.calls[-1].is_error

    asyncio.run(scenario())


def test_a_long_result_is_cut_and_says_so() -> None:
    async def scenario() -> None:
        async with ToolBox(tools(functions=[f"{FUNCTIONS}:essay"], max_result_chars=100)) as box:
            outcome = await box.call("essay", {"words": 500})
            assert outcome.content.startswith("word word") and not outcome.is_error
            assert outcome.content.endswith("[the result was cut at 100 of 2499 characters]")

    asyncio.run(scenario())


def test_an_mcp_server_over_stdio_lists_and_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("MCP_TOOLS_LOG", str(log))
    server = {**STDIO, "env": {"MCP_TOOLS_LOG": str(log), "PATH": "/usr/bin:/bin"}}

    async def scenario() -> None:
        async with ToolBox(tools(servers=[server], functions=[f"{FUNCTIONS}:capital"])) as box:
            assert [s.name for s in box.specs] == ["lookup", "slow", "broken", "capital"]
            assert {s.source for s in box.specs} == {"atlas", "function"}
            assert (await box.call("lookup", '{"key": "zorland"}')).content == "capital: Quix"
            missing = await box.call("lookup", '{"key": "mars"}')
            assert missing.is_error and missing.content == "no entry for 'mars'"  # the server's own error
            broken = await box.call("broken", "{}")
            assert broken.is_error and "broken failed" in broken.content
            # The server keeps answering after a handler raised.
            assert (await box.call("lookup", {"key": "vellmar"})).content == "capital: Ostra"

    asyncio.run(scenario())
    assert [json.loads(line)["tool"] for line in log.read_text().splitlines()] == [
        "lookup",
        "lookup",
        "broken",
        "lookup",
    ]


def test_resampling_sees_only_the_tools_it_may_call() -> None:
    """A server with side effects (`resample` off, the default) is not opened for training at all."""
    config = tools(
        servers=[STDIO], functions=[{"path": f"{FUNCTIONS}:capital", "resample": False}, f"{FUNCTIONS}:essay"]
    )

    async def scenario() -> list[str]:
        async with ToolBox(config, for_resampling=True) as box:
            return [s.name for s in box.specs]

    assert asyncio.run(scenario()) == ["essay"]


def test_a_server_that_does_not_start_is_left_out_or_refused_when_strict() -> None:
    down = {"name": "down", "command": [sys.executable, "-c", "raise SystemExit(1)"], "timeout_s": 20}
    config = tools(servers=[down], functions=[f"{FUNCTIONS}:capital"])

    async def lenient() -> tuple[list[str], list[str]]:
        async with ToolBox(config) as box:
            return [s.name for s in box.specs], list(box.unavailable)

    assert asyncio.run(lenient()) == (["capital"], ["down"])

    async def strict() -> None:
        async with ToolBox(config, strict=True):
            pass

    with pytest.raises(ToolsUnavailable, match="MCP server 'down'"):
        asyncio.run(strict())


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"servers": [{"name": "x"}]}, "exactly one of `url` and `command`"),
        (
            {"servers": [{"name": "x", "url": "http://a", "command": ["b"]}]},
            "exactly one of `url` and `command`",
        ),
        ({"servers": [{"name": "x", "url": "http://a"}, {"name": "x", "url": "http://b"}]}, "same name"),
        ({"functions": ["not a path"]}, "module:function"),
        ({"max_result_chars": 0}, "tools.max_result_chars"),
    ],
)
def test_bad_tool_configurations_are_refused(config: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidPolicyConfig, match=problem):
        load_policy_config({"tools": config})
