"""RULER against a scripted OpenAI-compatible judge (through litellm, over HTTP): prompt structure, parsing,
retries, wrong counts, failure isolation, and the judge job storing rewards on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.commands.main import main
from gateway.settings import async_database_url
from gateway.signing import verify
from storage.database import Database
from storage.models import Call, Episode
from tests.conftest import query
from tests.integration.test_feedback import add_policy, episode
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_judge import ScriptedJudge
from tests.support.sql import in_session
from trainer.control.ruler import JudgeSettings, MalformedJudgement, build_prompt, judge_group, parse_scores
from trainer.control.scheduler import JobRunner, RunnerConfig

MakeGateway = Callable[..., GatewayServer]

SYSTEM = {"role": "system", "content": "You answer arithmetic questions."}
QUESTION = {"role": "user", "content": "What is 2+2? Show the unique marker Q-17."}


def attempt(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, QUESTION, {"role": "assistant", "content": text}]


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge() as server:
        yield server


def settings(judge: ScriptedJudge, **overrides: Any) -> JudgeSettings:
    return JudgeSettings(**{"model": "judge-model", "api_base": judge.url, "backoff_s": 0.01, **overrides})


def test_prompt_shows_the_shared_context_once() -> None:
    tool_call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}
    conversations = [
        attempt("4, good"),
        [
            SYSTEM,
            QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        attempt("5"),
    ]
    system, user = build_prompt(conversations, "Correct answers win.")
    assert "Correct answers win." in system["content"] and '"scores"' in system["content"]
    text = user["content"]
    assert text.count("Q-17") == 1 and text.count("You answer arithmetic") == 1
    shared, rest = text.split("</shared_context>")
    assert shared.startswith("<shared_context>\n[system]\nYou answer arithmetic questions.\n\n[user]\n")
    assert '<trajectory id="t1">\n[assistant]\n4, good\n</trajectory>' in rest
    assert '<tool_call name=\'calc\'>{"x": "2+2"}</tool_call>' in rest and "[tool (tool result)]\n4" in rest
    assert '<trajectory id="t3">\n[assistant]\n5\n</trajectory>' in rest
    assert rest.strip().endswith("Score each of the 3 trajectories (t1, t2, t3) against the rubric.")
    # Identical trajectories still show each one's last message.
    _, same = build_prompt([attempt("4"), attempt("4")], "r")
    assert same["content"].count("[assistant]\n4") == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"scores": [{"trajectory_id": "t2", "explanation": "b", "score": 0.5},'
            ' {"trajectory_id": "t1", "explanation": "a", "score": 1}]}',
            [(1.0, "a"), (0.5, "b")],
        ),
        (
            '```json\n{"scores": [{"trajectory_id": "1", "explanation": "a", "score": "0.25"},'
            ' {"trajectory_id": "2", "explanation": "", "score": 0}]}\n```',
            [(0.25, "a"), (0.0, "")],
        ),
        (
            'Sure! {"scores": [{"trajectory_id": "t1", "explanation": "x", "score": 0.1},'
            ' {"trajectory_id": "t2", "explanation": "y", "score": 0.2}]} Done.',
            [(0.1, "x"), (0.2, "y")],
        ),
    ],
)
def test_parse_scores(text: str, expected: list[tuple[float, str]]) -> None:
    assert parse_scores(text, 2) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no json here", "no JSON object"),
        ('{"scores": [}', "not valid JSON"),
        ('{"ranking": []}', "no `scores` list"),
        ('{"scores": [{"trajectory_id": "t1", "explanation": "", "score": 1}]}', "expected 2 scores, got 1"),
        (
            '{"scores": [{"trajectory_id": "t1", "score": 1}, {"trajectory_id": "t1", "score": 1}]}',
            "repeated",
        ),
        (
            '{"scores": [{"trajectory_id": "t1", "score": 7}, {"trajectory_id": "t2", "score": 1}]}',
            "in [0, 1]",
        ),
        (
            '{"scores": [{"trajectory_id": "t1", "score": true}, {"trajectory_id": "t2", "score": 1}]}',
            "in [0, 1]",
        ),
    ],
)
def test_parse_scores_rejects_malformed_answers(text: str, message: str) -> None:
    with pytest.raises(MalformedJudgement, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_scores(text, 2)


def test_judge_group_through_litellm(judge: ScriptedJudge) -> None:
    outcome = asyncio.run(
        judge_group(
            [attempt("4, good"), attempt("5")],
            ["ep-a", "ep-b"],
            "Be right.",
            settings(judge, temperature=0.3),
        )
    )
    assert outcome.error is None and outcome.attempts == 1
    assert [(j.trajectory_id, j.score, j.explanation) for j in outcome.judgements or []] == [
        ("ep-a", 0.9, "t1 is good"),
        ("ep-b", 0.1, "t2 is poor"),
    ]
    assert outcome.latency_ms > 0 and outcome.model == "judge-model"
    [request] = judge.requests
    assert request["model"] == "judge-model" and request["temperature"] == 0.3
    schema = request["response_format"]["json_schema"]["schema"]["properties"]["scores"]
    assert (schema["minItems"], schema["maxItems"]) == (2, 2)
    assert schema["items"]["properties"]["trajectory_id"]["enum"] == ["t1", "t2"]
    assert {k.lower(): v for k, v in judge.headers[0].items()}["x-kaizen-no-log"] == "true"


#: Runs in a fresh interpreter (the test process may have imported litellm already): a ticker measures how late
#: the event loop wakes it while the process's first judge call is made, as a serving gateway's scheduler makes it.
_FIRST_JUDGE_CALL = textwrap.dedent(
    """
    import asyncio, json, sys, time

    from trainer.control.ruler import JudgeSettings, judge_group

    async def main() -> dict:
        imported_before = "litellm" in sys.modules
        worst = 0.0
        ticking = True

        async def tick() -> None:
            nonlocal worst
            last = time.perf_counter()
            while ticking:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                worst, last = max(worst, now - last - 0.01), now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        conversations = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}]
                         for answer in ("4, good", "5")]
        outcome = await judge_group(
            conversations, ["a", "b"], "Be right.", JudgeSettings(model="judge-model", api_base=sys.argv[1])
        )
        ticking = False
        await ticker
        return {"imported_before": imported_before, "worst_lag_s": worst, "error": outcome.error,
                "scores": [j.score for j in outcome.judgements or []]}

    print(json.dumps(asyncio.run(main())))
    """
)


@pytest.mark.slow
def test_the_first_judge_call_never_stalls_the_event_loop(judge: ScriptedJudge) -> None:
    """litellm's import takes seconds of CPU; made on the serving loop, it would hold every call in flight."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_JUDGE_CALL, judge.url],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported_before"] is False and seen["error"] is None and seen["scores"] == [0.9, 0.1]
    assert seen["worst_lag_s"] < 1.0, seen


def test_retries_malformed_wrong_count_and_errors_then_succeeds(judge: ScriptedJudge) -> None:
    judge.script.extend(["not json", '{"scores": []}', 500])
    outcome = asyncio.run(
        judge_group([attempt("good"), attempt("bad")], ["a", "b"], "r", settings(judge, max_retries=3))
    )
    assert outcome.attempts == 4 and outcome.error is None
    assert [j.score for j in outcome.judgements or []] == [0.9, 0.1]
    assert len(judge.requests) == 4


def test_gives_up_after_max_retries_with_the_error(judge: ScriptedJudge) -> None:
    judge.script.extend(['{"scores": [{"trajectory_id": "t1", "explanation": "", "score": 1}]}'] * 3)
    outcome = asyncio.run(
        judge_group([attempt("x"), attempt("y")], ["a", "b"], "r", settings(judge, max_retries=2))
    )
    assert outcome.judgements is None and outcome.attempts == 3
    assert outcome.error is not None and "expected 2 scores, got 1" in outcome.error


def converse(gw: GatewayServer, text: str, group: str) -> str:
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": "scripted-1",
            "messages": [SYSTEM, {"role": "user", "content": text}],
            "metadata": {"group_key": group},
        },
        timeout=10,
    )
    assert response.status_code == 200
    return response.headers["x-episode-id"]


def test_judge_command_scores_groups_and_isolates_failures(
    make_gateway: MakeGateway,
    database_url: str,
    judge: ScriptedJudge,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gw = make_gateway(database_url)
    good = [converse(gw, "good answer", "task-1"), converse(gw, "good again", "task-1")]
    bad = converse(gw, "bad answer", "task-1")
    failing = [converse(gw, "FAILJUDGE one", "task-2"), converse(gw, "FAILJUDGE two", "task-2")]
    converse(gw, "alone", "task-3")  # a group of one: nothing to compare yet
    gw.flush()
    # Explicit feedback on one episode: under the default rule it wins over the judge.
    assert httpx.post(gw.url + "/v1/feedback", json={"episode_id": bad, "value": 1}).status_code == 200

    # The judge is configured as a gateway's is: by the environment (or the TOML file).
    monkeypatch.setenv("KAIZEN_JUDGE_MODEL", "judge-x")
    monkeypatch.setenv("KAIZEN_JUDGE_API_BASE", judge.url)
    monkeypatch.setenv("KAIZEN_JUDGE_MAX_RETRIES", "1")
    args = ["judge", "--policy", "scripted-1", "--database-url", database_url, "--limit", "5"]
    assert main(args) == 0
    rows = query(database_url, "SELECT * FROM rewards WHERE source = 'judge' ORDER BY episode_id")
    by_episode = {r["episode_id"]: r for r in rows}
    assert set(by_episode) == {*good, bad}
    assert [by_episode[e]["value"] for e in good] == [0.9, 0.9] and by_episode[bad]["value"] == 0.1
    assert by_episode[bad]["name"] == "ruler" and by_episode[bad]["comment"].endswith("is poor")
    meta = by_episode[bad]["metadata"]
    meta = json.loads(meta) if isinstance(meta, str) else meta
    assert meta["model"] == "judge-x" and meta["latency_ms"] > 0 and meta["group"] == "key:task-1"

    groups = query(
        database_url, "SELECT group_key, status, attempts, error, model FROM judge_groups ORDER BY group_key"
    )
    assert [(g["group_key"], g["status"], g["attempts"]) for g in groups] == [
        ("key:task-1", "judged", 1),
        ("key:task-2", "failed", 2),
    ]
    assert "500" in groups[1]["error"] or "scripted failure" in groups[1]["error"]
    prompts = [p for p in judge.prompts() if "good answer" in p]
    assert len(prompts) == 1 and prompts[0].count("You answer arithmetic") == 1

    assert episode(gw, good[0])["reward"] == 0.9
    assert episode(gw, good[0])["reward_provenance"]["source"] == "judge"
    assert episode(gw, bad)["reward"] == 1.0  # feedback wins
    assert episode(gw, failing[0])["reward"] is None

    # A second run only retries what is still unjudged: the failed group.
    judge.requests.clear()
    assert main(args) == 1  # nothing judged, one failed again
    assert all("FAILJUDGE" in p for p in judge.prompts())
    assert len(query(database_url, "SELECT id FROM rewards WHERE source = 'judge'")) == 3


def test_weighted_rule_and_reward_function(
    make_gateway: MakeGateway, tmp_path: Any, judge: ScriptedJudge
) -> None:
    url = f"sqlite:///{tmp_path}/fn.db"
    gw = make_gateway(url)
    add_policy(
        url,
        "scripted-1",
        {
            "rewards": {
                "scorer": {"function": "tests.support.reward_functions:length_score"},
                "rule": {"kind": "weighted", "weights": {"function": 1.0, "feedback:user": 3.0}},
            }
        },
    )
    episode_id = converse(gw, "abcd", "g")
    gw.flush()
    assert main(["judge", "--policy", "scripted-1", "--database-url", url]) == 0
    [row] = query(url, "SELECT source, name, value, comment FROM rewards")
    assert row == {
        "source": "function",
        "name": "tests.support.reward_functions:length_score",
        "value": 0.5,
        "comment": "10 characters",
    }
    assert episode(gw, episode_id)["reward"] == 0.5
    assert httpx.post(gw.url + "/v1/feedback", json={"episode_id": episode_id, "value": 1}).status_code == 200
    body = episode(gw, episode_id)
    assert body["reward"] == pytest.approx((0.5 * 1 + 1.0 * 3) / 4)
    assert [t["term"] for t in body["reward_provenance"]["terms"]] == ["function", "feedback:user"]
    assert judge.requests == []


def test_scoring_webhook_is_signed_and_retried(
    make_gateway: MakeGateway, tmp_path: Any, judge: ScriptedJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/hook.db"
    gw = make_gateway(url)
    hook = judge.url.removesuffix("/v1") + "/score"
    add_policy(url, "scripted-1", {"rewards": {"scorer": {"webhook_url": hook, "webhook_retries": 1}}})
    episode_id = converse(gw, "score me", "g")
    gw.flush()
    judge.webhook_script.append(503)
    monkeypatch.setenv("KAIZEN_FEEDBACK_SECRET", "s3cret")
    # The scripted webhook listens on loopback, which a policy's URL may reach only by the operator's opt-in.
    monkeypatch.setenv("KAIZEN_OUTBOUND_PRIVATE_NETWORKS", "true")
    args = ["judge", "--policy", "scripted-1", "--database-url", url]
    assert main(args) == 0
    assert len(judge.webhook_calls) == 2  # the 503 was retried
    body, headers = judge.webhook_calls[-1]
    verify("s3cret", {k.lower(): v for k, v in headers.items()}["x-kaizen-signature"], body, tolerance_s=60)
    sent = json.loads(body)["trajectory"]
    assert sent["episode_id"] == episode_id and sent["messages"][-1]["content"] == "echo: score me"
    [row] = query(url, "SELECT source, name, value, comment, episode_id FROM rewards")
    assert row == {
        "source": "webhook",
        "name": "webhook",
        "value": 0.7,
        "comment": "webhook",
        "episode_id": episode_id,
    }
    assert episode(gw, episode_id)["reward"] == 0.7

    judge.webhook_script.extend([500, 500])
    converse(gw, "score me too", "h")
    gw.flush()
    assert main(args) == 1  # the only group failed; recorded, not raised
    [failed] = query(url, "SELECT scorer, status, error FROM judge_groups WHERE status = 'failed'")
    assert failed["scorer"] == "webhook" and "500" in failed["error"]


def test_a_scheduled_judge_run_leaves_a_group_an_agent_is_still_adding_to(
    make_gateway: MakeGateway, database_url: str, judge: ScriptedJudge, tmp_path: Any
) -> None:
    """An agent's episode may still be taking turns when the judge's interval comes round: a scheduled run leaves
    the whole group until its episodes have been quiet for `schedule.judge_quiet_s`; a manual run judges it now."""
    gw = make_gateway(database_url)
    add_policy(database_url, "scripted-1", {"schedule": {"judge_quiet_s": 120}})
    done = [converse(gw, "good answer", "done"), converse(gw, "bad answer", "done")]
    busy = [converse(gw, "good answer", "busy"), converse(gw, "bad answer", "busy")]
    gw.flush()
    # The finished group's calls were made ten minutes ago; the other group's second episode is still live.
    old = datetime.now(UTC) - timedelta(minutes=10)

    async def backdate(session: AsyncSession) -> None:
        finished = [*done, busy[0]]
        await session.execute(update(Call).where(Call.episode_id.in_(finished)).values(created_at=old))
        await session.execute(update(Episode).where(Episode.id.in_(finished)).values(created_at=old))

    in_session(database_url, backdate)
    config = RunnerConfig(
        data_dir=tmp_path,
        database_url=database_url,
        judge=settings(judge),
        train_command=[sys.executable, "-m", "trainer.learner"],
        gate_url="http://127.0.0.1:9/v1",
    )

    async def judge_run(trigger: str) -> dict[str, Any]:
        database = Database(async_database_url(database_url))
        try:
            run = await JobRunner(database, config).run("scripted-1", "judge", trigger)
            assert run is not None and run.status == "succeeded", run
            return dict(run.metrics or {})
        finally:
            await database.dispose()

    def judged() -> set[str]:
        return {
            r["episode_id"]
            for r in query(database_url, "SELECT episode_id FROM rewards WHERE source = 'judge'")
        }

    scheduled = asyncio.run(judge_run("interval"))
    assert (scheduled["judged"], scheduled["in_progress"]) == (1, 1)
    assert judged() == set(done)
    manual = asyncio.run(judge_run("manual"))
    assert (manual["judged"], manual["in_progress"]) == (1, 0)
    assert judged() == {*done, *busy}
