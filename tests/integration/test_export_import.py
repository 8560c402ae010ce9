"""`kaizen export` and `kaizen import` as a user runs them, on SQLite and PostgreSQL: real traffic through a
gateway and an imported file become episodes; every export format loads with Hugging Face `datasets` and holds
what the episodes API shows; filters select; a bad import file writes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import httpx
import openai
import polars as pl
import pytest

from gateway.commands.main import main
from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import create_policy
from tests.conftest import query
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
IMPORTED = [
    {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        "reward": 1,
    },
    {
        "id": "ticket-7",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": [WEATHER_TOOL],
        "reward": "bad",
        "metadata": {"channel": "email"},
    },
    {
        "messages": [
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."},
        ]
    },
]


@pytest.fixture(autouse=True)
def _offline_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`datasets` reads local files without the hub; its cache goes to the test's directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def kaizen(url: str, data_dir: Path, *argv: str) -> tuple[int, dict[str, Any] | None]:
    """Run the CLI in this process as a user would; returns its exit status and the JSON it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([*argv, "--database-url", url, "--data-dir", str(data_dir)])
    lines = out.getvalue().strip().splitlines()
    return status, json.loads(lines[-1]) if lines else None


async def _create_policy(url: str, name: str, config: dict[str, Any] | None = None) -> None:
    await upgrade_database(async_database_url(url))
    database = Database(async_database_url(url))
    async with database.session() as session:
        await create_policy(session, name, "base", config)
        await session.commit()
    await database.dispose()


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _traffic(gw: GatewayServer) -> dict[str, str]:
    """Three conversations through the gateway; returns request id -> episode id."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    ids = {}
    first = client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "weather? #tool"}], tools=[WEATHER_TOOL]
    )
    ids[first.headers["x-request-id"]] = first.headers["x-episode-id"]
    reply = first.parse().choices[0].message
    follow = client.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[
            {"role": "user", "content": "weather? #tool"},
            reply.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "sunny"},  # type: ignore[index]
        ],
        tools=[WEATHER_TOOL],
    )
    ids[follow.headers["x-request-id"]] = follow.headers["x-episode-id"]
    other = client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    list(other.parse())
    ids[other.headers["x-request-id"]] = other.headers["x-episode-id"]
    gw.flush()
    httpx.post(gw.url + "/v1/feedback", json={"request_id": follow.headers["x-request-id"], "value": 0.5})
    return ids


def test_export_loads_with_datasets_in_every_format_and_holds_the_episodes(
    make_gateway: MakeGateway, database_url: str, tmp_path: Path
) -> None:
    asyncio.run(_create_policy(database_url, "bot"))
    gw = make_gateway(database_url)
    traffic = _traffic(gw)
    assert len(set(traffic.values())) == 2  # the follow-up stitched into its conversation
    status, report = kaizen(
        database_url,
        tmp_path,
        "import",
        str(_write_jsonl(tmp_path / "in.jsonl", IMPORTED)),
        "--policy",
        "bot",
    )
    assert status == 0 and report is not None
    assert (report["imported"], report["rewards"], report["bad_lines"]) == (3, 2, 0)

    episodes = {
        e: httpx.get(f"{gw.url}/v1/episodes/{e}").json()
        for e in {r["episode_id"] for r in query(database_url, "SELECT episode_id FROM trajectories")}
    }
    assert len(episodes) == 5
    cache = tmp_path / "hf-cache"
    for fmt in ("parquet", "jsonl"):
        out = tmp_path / f"all.{fmt}"
        status, report = kaizen(database_url, tmp_path, "export", str(out))
        assert status == 0 and report is not None and (report["episodes"], report["format"]) == (5, fmt)
        rows = datasets.load_dataset(
            "parquet" if fmt == "parquet" else "json",
            data_files=str(out),
            split="train",
            cache_dir=str(cache),
        )
        assert rows.num_rows == 5
        for row in rows:
            decode = _json_text if fmt == "parquet" else _same
            api = episodes[row["episode_id"]]
            assert _without_nulls(decode(row["messages"])) == _without_nulls(api["messages"]), row[
                "episode_id"
            ]
            assert row["reward"] == api["reward"]
            assert [r["value"] for r in decode(row["rewards"])] == [r["value"] for r in api["rewards"]]
            assert row["source"] == ("import" if row["policy"] == "bot" else "traffic")
            assert decode(row["reward_provenance"]) == api["reward_provenance"]
        by_id = {r["episode_id"]: r for r in rows}
        weather = by_id[traffic[next(iter(traffic))]]
        assert weather["calls"] == 2 and weather["prompt_tokens"] > 0
        assert _without_nulls(decode(weather["tools"])) == [WEATHER_TOOL]

    # OpenAI's fine-tuning format: messages (and tools) only, as its API and chat templates take them.
    for fmt in ("parquet", "jsonl"):
        out = tmp_path / f"train.{fmt}"
        status, report = kaizen(
            database_url, tmp_path, "export", str(out), "--schema", "openai", "--source", "import"
        )
        assert status == 0 and report is not None and report["episodes"] == 3
        rows = datasets.load_dataset(
            "parquet" if fmt == "parquet" else "json",
            data_files=str(out),
            split="train",
            cache_dir=str(cache),
        )
        conversations = sorted((_without_nulls(r["messages"]) for r in rows), key=len)
        assert conversations == sorted((_without_nulls(line["messages"]) for line in IMPORTED), key=len)
        (with_tools,) = [r for r in rows if r["tools"]]
        tools = json.loads(with_tools["tools"]) if fmt == "parquet" else with_tools["tools"]
        assert _without_nulls(tools) == [WEATHER_TOOL]
    assert (tmp_path / "train.jsonl").read_text().splitlines()[0].startswith('{"messages":')
    assert not list(tmp_path.glob(".*.partial"))


def _json_text(value: str | None) -> Any:
    """Kaizen's Parquet keeps free-form fields as JSON text."""
    return None if value is None else json.loads(value)


def _same(value: Any) -> Any:
    return value


def _without_nulls(value: Any) -> Any:
    """Arrow gives every struct field to every row (absent ones as None); JSON lines keep what was written."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_filters_select_episodes(make_gateway: MakeGateway, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'filters.db'}"
    asyncio.run(_create_policy(url, "bot"))
    gw = make_gateway(url)
    _traffic(gw)
    kaizen(url, tmp_path, "import", str(_write_jsonl(tmp_path / "in.jsonl", IMPORTED)), "--policy", "bot")

    def exported(*argv: str) -> int:
        out = tmp_path / "f.parquet"
        status, report = kaizen(url, tmp_path, "export", str(out), *argv)
        assert status == 0 and report is not None
        assert pl.read_parquet(out).height == report["episodes"]
        return int(report["episodes"])

    assert exported() == 5
    assert exported("--policy", "bot") == 3
    assert exported("--policy", "scripted-1") == 2
    assert exported("--source", "traffic") == 2
    assert exported("--source", "traffic", "--source", "import") == 5
    assert exported("--min-reward", "0.75") == 1  # the imported 1.0; "bad" is 0, the feedback 0.5
    assert exported("--max-reward", "0.5") == 2
    assert exported("--since", "1h") == 5
    assert exported("--until", "1h") == 0
    assert exported("--until", "2999-01-01") == 5
    assert exported("--version", "1") == 0  # upstream traffic and imports have no adapter version
    assert exported("--batch-size", "1") == 5  # one row group per episode: the pages join up
    # A trajectory that ends without a reply cannot teach; OpenAI's format leaves it out and says so.
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model="scripted-1", messages=[{"role": "user", "content": "#error 500"}]
        )
    gw.flush()
    status, report = kaizen(url, tmp_path, "export", str(tmp_path / "o.jsonl"), "--schema", "openai")
    assert status == 0 and report is not None and (report["episodes"], report["skipped"]) == (5, 1)


def test_a_bad_import_file_writes_nothing_and_names_its_lines(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    asyncio.run(_create_policy(database_url, "bot"))
    lines: list[Any] = [
        IMPORTED[0],
        '{"messages": [',  # line 2: not JSON
        {"messages": [{"role": "user", "content": "no reply"}]},  # line 3
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},  # line 4
        {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "reward": "meh",
        },
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "colour": 1},
        IMPORTED[2],
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    status, _ = kaizen(database_url, tmp_path, "import", str(path), "--policy", "bot")
    assert status == 2
    text = caplog.text
    assert "5 of 7 lines are invalid; nothing was imported" in text
    for number, words in (
        (2, "not JSON"),
        (3, "assistant's reply"),
        (4, "wizard"),
        (5, "unknown label 'meh'"),
        (6, "colour"),
    ):
        assert f"line {number}: " in text and words in text, (number, words)
    assert query(database_url, "SELECT count(*) AS n FROM episodes")[0]["n"] == 0
    assert query(database_url, "SELECT count(*) AS n FROM rewards")[0]["n"] == 0

    status, report = kaizen(
        database_url, tmp_path, "import", str(path), "--policy", "bot", "--skip-bad-lines"
    )
    assert status == 0 and report is not None
    assert (report["imported"], report["bad_lines"], report["rewards"]) == (2, 5, 1)
    status, report = kaizen(
        database_url, tmp_path, "import", str(path), "--policy", "bot", "--skip-bad-lines"
    )
    assert report is not None and (report["imported"], report["existing"]) == (0, 2)  # idempotent
    assert query(database_url, "SELECT count(*) AS n FROM calls")[0]["n"] == 2
    assert query(database_url, "SELECT count(*) AS n FROM rewards")[0]["n"] == 1

    status, _ = kaizen(database_url, tmp_path, "import", str(path), "--policy", "nobody")
    assert status == 2 and "no policy named 'nobody'" in caplog.text


def test_imported_conversations_are_trajectories_redacted_like_traffic(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'redacted.db'}"
    asyncio.run(_create_policy(url, "bot", {"privacy": {"mode": "mask"}}))
    conversation = {
        "messages": [
            {"role": "user", "content": "Mail jane@example.com please"},
            {"role": "assistant", "content": "Sent to jane@example.com."},
        ],
        "group_key": "mail",
    }
    status, report = kaizen(
        url,
        tmp_path,
        "import",
        str(_write_jsonl(tmp_path / "pii.jsonl", [conversation, conversation])),
        "--policy",
        "bot",
    )
    assert status == 0 and report is not None and (report["imported"], report["repeated"]) == (1, 1)
    gw = make_gateway(url)
    (row,) = query(url, "SELECT episode_id, source, group_key, calls FROM trajectories")
    assert (row["source"], row["group_key"], row["calls"]) == ("import", "mail", 1)
    episode = httpx.get(f"{gw.url}/v1/episodes/{row['episode_id']}").json()
    assert episode["messages"] == [
        {"role": "user", "content": "Mail [EMAIL] please"},
        {"role": "assistant", "content": "Sent to [EMAIL]."},
    ]
    assert "jane@example.com" not in json.dumps(query(url, "SELECT * FROM calls"), default=str)
