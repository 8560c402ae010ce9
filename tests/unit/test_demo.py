"""The demo's tasks must reward content, not format; its report must say what docs/training.md quotes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.demo.report import Cycle, summarise, write_chart, write_json
from gateway.demo.runner import DemoOptions, policy_config, run_record, summarise_run, target_met
from gateway.demo.tasks import OPPOSITES, PAST_TENSE, TASKS, reward, score
from gateway.demo.traffic import CallResult, SimulatedApp, served_version
from gateway.signing import HEADER
from trainer.control.policy_config import load_policy_config

QUESTIONS = TASKS["opposites"].questions()
HOT = next(q for q in QUESTIONS if q.word == "hot")
PAST = TASKS["past-tense"].questions()
GO = next(q for q in PAST if q.word == "go")


def test_the_right_opposite_scores_in_any_phrasing() -> None:
    assert reward("cold", HOT) == 1.0
    assert reward('The opposite of "hot" is "cold".', HOT) == 1.0
    assert reward("Cold!", HOT) == 1.0


def test_wrong_empty_hedged_and_off_topic_replies_score_nothing() -> None:
    assert reward("warm", HOT) == 0.0
    assert reward("", HOT) == 0.0
    assert reward(None, HOT) == 0.0
    assert reward("cold or small or slow", HOT) == 0.0  # covering bets with several answers
    assert reward("I like turtles.", HOT) == 0.0


def test_the_past_tense_is_checked_by_content_too() -> None:
    assert reward("went", GO) == 1.0
    assert reward('The past tense of "go" is "went".', GO) == 1.0
    assert reward("goed", GO) == 0.0
    assert reward("went or ran", GO) == 0.0  # hedged
    assert reward("", GO) == 0.0
    assert reward("I think it is went", GO) == 1.0  # "think" is a question's word, not a candidate answer


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize(
    "constant", ["cold", "went", "", "The answer is yes.", "small slow cold", "went ran ate"]
)
def test_a_constant_reply_scores_at_most_one_question_in_sixty(task: str, constant: str) -> None:
    questions = TASKS[task].questions()
    mean = sum(reward(constant, q) for q in questions) / len(questions)
    assert mean <= 1 / 60


@pytest.mark.parametrize(("task", "table"), [("opposites", OPPOSITES), ("past-tense", PAST_TENSE)])
def test_questions_are_unique_and_no_question_word_is_an_answer(task: str, table: dict[str, Any]) -> None:
    questions = TASKS[task].questions()
    assert len({q.key for q in questions}) == len({q.prompt for q in questions}) == len(table) == 60
    assert not {q.word for q in questions} & questions[0].candidates


def test_score_reads_the_trajectory_of_any_task() -> None:
    trajectory = {
        "messages": [
            {"role": "user", "content": HOT.prompt},
            {"role": "assistant", "content": "It is cold."},
        ]
    }
    assert score(trajectory) == 1.0
    went = {"messages": [{"role": "user", "content": GO.prompt}, {"role": "assistant", "content": "Went."}]}
    assert score(went) == 1.0
    with pytest.raises(ValueError, match="not a demo task"):
        score({"messages": [{"role": "user", "content": "What is 2+2?"}]})


def test_served_version_comes_from_the_header() -> None:
    assert served_version("demo@3") == 3
    assert served_version("smollm2-135m-instruct") is None
    assert served_version(None) is None


def test_the_demo_policy_config_is_valid_for_every_section() -> None:
    config = load_policy_config(
        policy_config(DemoOptions(None, Path("d"), Path("m"), "smollm2-135m-instruct"))
    )
    assert config.train.grouping == "resample"
    assert config.schedule.train_min_new_episodes == 16
    assert config.gate.holdout_fraction > 0
    assert config.rewards.scorer.kind == "function"


def call(question: str, reply: str, value: float, version: int | None, at: float) -> CallResult:
    return CallResult(question, reply, value, version, at)


def test_a_cycle_summary_counts_versions_and_diversity() -> None:
    calls = [
        call("a", "cold", 1.0, 1, 10.0),
        call("a", "cold", 1.0, 1, 11.0),  # the same answer to the same question is not a lack of diversity
        call("b", "small", 0.0, 0, 12.0),
        call("c", "", 0.0, 1, 13.0),
        CallResult("d", "", 0.0, None, 14.0, error="boom"),
    ]
    cycle = summarise(4, calls)
    assert cycle.cycle == 4 and cycle.version == 1 and cycle.n_calls == 5 and cycle.errors == 1
    assert cycle.mean_reward == pytest.approx(2 / 5)
    assert cycle.distinct_share == 1.0
    assert cycle.empty_share == pytest.approx(1 / 4)
    assert cycle.versions == {"0": 1, "1": 3}
    assert cycle.elapsed_s == 14.0


def cycle(index: int, version: int, reward_: float, distinct: float = 1.0) -> Cycle:
    return Cycle(index, version, reward_, 60, 60.0 * index, distinct, 0.0, 0)


def test_run_summary_checks_every_target(tmp_path: Path) -> None:
    options = DemoOptions(tmp_path, tmp_path / "data", tmp_path, "smollm2-135m-instruct")
    cycles = [
        cycle(1, 0, 0.2),
        cycle(2, 0, 0.3),
        cycle(3, 1, 0.5),
        cycle(4, 1, 0.6),
        cycle(5, 2, 0.85, distinct=0.9),
        cycle(6, 2, 0.9),
    ]
    summary = summarise_run(cycles, options)
    assert summary["base_reward"] == pytest.approx(0.25)
    assert summary["reached_target_at_s"] == 300.0
    assert summary["versions_served"] == [0, 1, 2]
    assert summary["promotion_regressions"] == [pytest.approx(-0.3), pytest.approx(-0.325)]
    assert all(summary["targets"].values())
    assert summary["stopped_by"] is None  # the time ran out
    assert summarise_run(cycles, options, stopped_by="SIGINT")["stopped_by"] == "SIGINT"

    regressed = [*cycles, cycle(7, 3, 0.5), cycle(8, 3, 0.5, distinct=0.3)]
    targets = summarise_run(regressed, options)["targets"]
    assert not targets["no_regression_over_0.05_at_promotion"]
    assert not targets["distinct_share_at_least_half_base"]

    write_json(tmp_path / "demo.json", cycles, summary)
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert {"version", "mean_reward", "n_calls", "elapsed_s", "distinct_share", "empty_share"} <= set(
        saved["cycles"][0]
    )
    write_chart(tmp_path / "demo.png", cycles, "test")
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")


def test_stopping_at_the_target_needs_a_trained_version_at_the_target_reward() -> None:
    task = TASKS["opposites"]
    target = task.target_reward
    assert not target_met(cycle(1, 0, 1.0), task)  # the base model answering well proves nothing learned
    assert not target_met(Cycle(2, None, 1.0, 60, 120.0, 1.0, 0.0, 60), task)  # every call failed
    assert not target_met(cycle(3, 1, target - 0.01), task)
    assert target_met(cycle(4, 1, target), task)
    assert target_met(cycle(5, 3, 1.0), task)


def test_a_training_run_is_kept_with_why_it_stopped_and_what_it_cost(tmp_path: Path) -> None:
    stopped = {
        "id": 7,
        "status": "failed",
        "from_version": 4,
        "to_version": None,
        "error": "collapse guard stopped the run: kl_to_start 0.9 > 0.5 nats/token",
        "metrics": {
            "groups": 12,
            "samples": 140,
            "kl_to_base": 1.2,
            "kl_to_start": 0.9,
            "resample": {"replies": 512, "groups_with_signal": 12},
            "collapse": [{"step": 0}, {"step": 4}, {"step": 8}],
        },
    }
    record = run_record(stopped)
    assert record["error"].startswith("collapse guard") and record["gate"] is None
    assert record["collapse"] == [{"step": 0}, {"step": 8}]  # the start and the end
    assert record["resample"]["replies"] == 512 and record["kl_to_start"] == 0.9
    gated = {
        "id": 8,
        "status": "rejected",
        "to_version": 5,
        "metrics": {"gate": {"decision": "reject", "x": 1}},
    }
    assert run_record(gated)["gate"] == {"decision": "reject"}

    options = DemoOptions(tmp_path, tmp_path / "data", tmp_path, "smollm2-135m-instruct", task="past-tense")
    summary = summarise_run([cycle(1, 0, 0.05), cycle(2, 1, 0.55)], options, [record])
    assert summary["task"] == "past-tense" and summary["runs"] == [record]
    assert summary["targets"]["reward_0.5_within_30_min"]


def test_feedback_lost_on_the_way_is_resent_signed_anew_with_one_idempotency_key() -> None:
    sent: list[httpx.Request] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if len(sent) == 1:
            raise httpx.ReadError("connection closed by the server")
        return httpx.Response(200, json={"items": []})

    async def main() -> None:
        app = SimulatedApp(
            "http://gateway.test/v1",
            "key",
            "secret",
            [],
            model="demo",
            rate=1,
            concurrency=1,
            max_tokens=8,
            seed=0,
        )
        await app.http.aclose()
        app.http = httpx.AsyncClient(transport=httpx.MockTransport(gateway))
        await app._feedback("req-1", 1.0)
        await app.close()

    asyncio.run(main())
    assert len(sent) == 2
    first, second = (json.loads(r.content) for r in sent)
    assert first == second and first["idempotency_key"] == "demo:req-1"
    assert sent[0].headers[HEADER] != sent[1].headers[HEADER]  # a resend is not a replay


def test_the_locker_task_needs_the_tool_and_the_right_field() -> None:
    """Made-up words in numbered lockers: only the tool knows them; its result also names the word the locker
    held before, so an answer that repeats the whole result names two words and scores 0."""
    from gateway.demo.agent_tasks import LOCKER_TASK, LOCKERS, open_locker, reward, right_call, score

    lockers = LOCKER_TASK.questions()
    assert len(lockers) == 60 and len({lk.word for lk in lockers}) == 60
    locker = lockers[0]
    found = json.loads(open_locker(locker.number))
    assert found == {"locker": locker.number, "secret_word": locker.word, "previous_word": locker.previous}
    assert found["previous_word"] != locker.word and LOCKERS[locker.number] == locker
    assert json.loads(open_locker(5)) == {"error": "there is no locker 5"}
    assert reward(locker.word.capitalize() + ".", locker) == 1.0
    assert reward(f"{locker.word} (it held {locker.previous} before)", locker) == 0.0
    assert reward(None, locker) == reward("I do not know.", locker) == 0.0
    assert right_call(json.dumps({"number": locker.number}), locker)
    assert not right_call(json.dumps({"number": locker.number + 1}), locker)
    assert not right_call("not json", locker) and not right_call("{}", locker)
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "function": {"name": "open_locker"}}],
    }
    user = {"role": "user", "content": locker.prompt}
    answered = {
        "messages": [
            user,
            call,
            {"role": "tool", "content": "..."},
            {"role": "assistant", "content": locker.word},
        ]
    }
    assert score(answered) == 1.0
    assert score({"messages": [user, call]}) == 0.0  # still calling tools when the episode ended
    with pytest.raises(ValueError, match="not a demo locker question"):
        score({"messages": [{"role": "user", "content": "hello"}]})


def test_an_agent_demos_policy_runs_its_tool_and_scores_whole_episodes() -> None:
    from gateway.demo.runner import DemoOptions, policy_config
    from trainer.control.policy_config import load_policy_config

    options = DemoOptions(None, Path("d"), Path("m"), "smollm2-135m-instruct", task="lockers")
    config = load_policy_config(policy_config(options))
    assert [f.path for f in config.tools.functions] == ["gateway.demo.agent_tasks:open_locker"]
    assert config.rewards.scorer.function == "gateway.demo.agent_tasks:score"
    assert config.train.grouping == "resample" and config.train.max_turns == 3
    assert config.train.max_new_tokens == options.reply_tokens == 48  # room for a tool call
    # One resampling round tops up each task of a run to a group; the gate re-runs 8 x 4 episodes per version.
    assert (
        config.train.resample_budget == (config.train.group_size - 1) * config.schedule.train_min_new_episodes
    )
    assert config.gate.samples == 4
