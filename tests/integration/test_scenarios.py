"""The scenario writer of `kaizen bootstrap` against a scripted OpenAI-compatible model (through litellm, over
HTTP): batches, what the writer is shown, repeats, malformed answers and failures, with exact answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.scripted_judge import ScriptedJudge
from trainer.control.ruler import JudgeSettings, import_litellm, takes_seed
from trainer.control.scenarios import ScenarioError, parse_scenarios, write_scenarios

TASK = "Answer questions about train timetables between Swiss cities."


@pytest.fixture
def writer() -> Iterator[ScriptedJudge]:
    with ScriptedJudge() as server:
        yield server


def settings(writer: ScriptedJudge, **overrides: Any) -> JudgeSettings:
    return JudgeSettings(
        **{
            "model": "writer-model",
            "api_base": writer.url,
            "backoff_s": 0.01,
            "temperature": 1.0,
            **overrides,
        }
    )


def batch(*messages: str) -> str:
    return json.dumps({"scenarios": [{"message": m} for m in messages]})


def test_scenarios_are_written_in_batches_and_repeats_are_dropped(writer: ScriptedJudge) -> None:
    writer.script.extend(
        [
            batch("When is the next train from Bern to Basel?", "Zurich to Geneva, leaving after 6pm?"),
            # a repeat (other case and spacing) and one new; the writer is asked for 2 and sends 3: one is cut
            batch(
                "when is the next train  from Bern to Basel?", "Is there a night train to Lugano?", "extra"
            ),
            batch("Which platform does the 8:02 to Chur leave from?"),
        ]
    )
    progress: list[tuple[int, int]] = []
    written = asyncio.run(
        write_scenarios(
            TASK, 4, settings(writer), batch_size=2, progress=lambda d, t: progress.append((d, t))
        )
    )
    assert written.messages == [
        "When is the next train from Bern to Basel?",
        "Zurich to Geneva, leaving after 6pm?",
        "Is there a night train to Lugano?",
        "Which platform does the 8:02 to Chur leave from?",
    ]
    assert (written.requests, written.duplicates) == (3, 1)
    assert progress == [(2, 4), (3, 4), (4, 4)]
    first, _, third = writer.requests
    assert [r["model"] for r in writer.requests] == ["writer-model"] * 3
    assert first["temperature"] == 1.0
    assert first["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["maxItems"] == 2
    assert third["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["maxItems"] == 1
    prompts = writer.prompts()
    assert all(TASK in p for p in prompts)
    assert "already written" not in prompts[0] and prompts[0].endswith("Write 2 new scenarios.")
    # later batches are shown what exists, so they can differ from it
    assert "- Zurich to Geneva, leaving after 6pm?" in prompts[1]
    assert "- Is there a night train to Lugano?" in prompts[2] and prompts[2].endswith(
        "Write 1 new scenario."
    )
    # writing scenarios is not traffic: a gateway stores nothing of these calls
    assert all({k.lower(): v for k, v in h.items()}["x-kaizen-no-log"] == "true" for h in writer.headers)


def test_malformed_answers_are_retried_and_a_dry_writer_stops(writer: ScriptedJudge) -> None:
    writer.script.extend(
        [
            "no json at all",
            500,
            "```json\n" + batch("Bern to Thun?") + "\n```",  # fenced JSON is read too
            batch("Bern to Thun?"),  # nothing new, twice: the writer has run dry
            batch("bern to thun?"),
        ]
    )
    written = asyncio.run(write_scenarios(TASK, 3, settings(writer, max_retries=2), batch_size=3))
    assert written.messages == ["Bern to Thun?"]
    assert (written.requests, written.duplicates) == (5, 2)


def test_a_writer_that_keeps_failing_is_an_error(writer: ScriptedJudge) -> None:
    writer.script.extend([500, batch(""), '{"scenarios": "many"}'])
    with pytest.raises(ScenarioError, match="scenario writer writer-model failed"):
        asyncio.run(write_scenarios(TASK, 2, settings(writer, max_retries=2)))
    assert len(writer.requests) == 3


@pytest.mark.parametrize(
    ("seed", "sent"),
    [(None, ["no seed"] * 3), (7, [7, 8, 9]), (2**63 - 2, [2**63 - 2, 2**63 - 1, 0])],
)
def test_a_seeded_writer_sends_one_seed_per_request_retries_included(
    writer: ScriptedJudge, seed: int | None, sent: list[int | str]
) -> None:
    # request 1 is refused and retried; a retry with the same seed would draw the same refused answer
    writer.script.extend(
        ["no json at all", batch("Bern to Thun?", "Basel to Olten?"), batch("Chur to Sion?")]
    )
    written = asyncio.run(write_scenarios(TASK, 3, settings(writer, seed=seed), batch_size=2))
    assert written.messages == ["Bern to Thun?", "Basel to Olten?", "Chur to Sion?"]
    # past 2^63 - 1 the seeds wrap to 0; unseeded, the field is left out (not sent as null)
    assert [r.get("seed", "no seed") for r in writer.requests] == sent


def test_the_seed_goes_only_to_providers_that_take_one() -> None:
    litellm = asyncio.run(import_litellm())
    assert takes_seed(litellm, JudgeSettings(model="writer-model", api_base="http://127.0.0.1:9/v1"))
    assert takes_seed(litellm, JudgeSettings(model="openai/gpt-4o-mini"))
    # litellm would refuse a whole call to Anthropic that carries `seed`
    assert not takes_seed(litellm, JudgeSettings(model="anthropic/claude-3-5-sonnet-20240620"))


def test_parse_scenarios_accepts_plain_strings_and_skips_empty_entries() -> None:
    assert parse_scenarios('{"scenarios": ["a", {"message": " b "}, {"message": ""}, 5]}') == ["a", "b"]
