"""Resampling through the serving engine: what is asked of the gateway, how its answer becomes exact samples, and
RULER judging the resamples together with the original reply."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from storage.episodes import EpisodeTranscript
from tests.support.ports import free_port
from tests.unit.test_trainer_data import FixedSampler, Template, trajectory
from trainer.control.gateway_requests import EngineSamplingError
from trainer.control.policy_config import TrainConfig
from trainer.control.scoring import GroupScore, Score
from trainer.learner.dataset import DataReport
from trainer.learner.engine_sampling import EngineEndpoint, parse_choices
from trainer.learner.grouping import PolicyReplyScorer, resample_groups
from trainer.learner.tokens import tokenize


def choice(index: int, tokens: list[tuple[int, float]], content: str | None = "hi") -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
        "logprobs": {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in tokens
            ]
        },
    }


def test_token_id_strings_become_ids_with_their_logprobs() -> None:
    response = {
        "choices": [choice(0, [(61, -4.25), (2, -0.2)], "Red."), choice(1, [(7, float("-inf"))], None)]
    }
    first, second = parse_choices(response, [1, 2, 3])
    assert (first.text, first.prompt_token_ids, first.token_ids, first.logprobs) == (
        "Red.",
        [1, 2, 3],
        [61, 2],
        [-4.25, -0.2],
    )
    assert (second.text, second.token_ids, second.logprobs) == ("", [7], [-9999.0])


def test_a_tool_call_is_kept_as_the_app_would_get_it_with_why_the_reply_ended() -> None:
    """A resampled tool call was once kept as its (empty) text and scored as an empty answer."""
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "x"}'}}
    ]
    called = choice(0, [(40, -0.1), (2, -0.1)], None)
    called["message"]["tool_calls"] = calls
    called["finish_reason"] = "tool_calls"
    cut = choice(1, [(5, -0.1)], "an unfinished")
    cut["finish_reason"] = "length"
    tool, truncated = parse_choices({"choices": [called, cut]}, [1])
    assert tool.message == {"role": "assistant", "content": None, "tool_calls": calls}
    assert tool.tool_calls == calls and tool.finish_reason == "tool_calls"
    assert truncated.finish_reason == "length" and truncated.text == "an unfinished"


def test_text_tokens_or_missing_logprobs_are_refused() -> None:
    text_token = {
        "choices": [{"message": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": -1}]}}]
    }
    with pytest.raises(EngineSamplingError, match="return_tokens_as_token_ids"):
        parse_choices(text_token, [])
    with pytest.raises(EngineSamplingError, match="without logprobs"):
        parse_choices({"choices": [{"message": {"content": "a"}, "logprobs": None}]}, [])


class FakeGateway:
    """A stand-in for the gateway's /v1/chat/completions: answers `not_found` 404s first, then `restarting` 503s
    (an engine restarting), then drops `dropped` connections without an answer, then `n` choices."""

    def __init__(self, not_found: int = 0, restarting: int = 0, dropped: int = 0) -> None:
        self.not_found = not_found
        self.restarting = restarting
        self.dropped = dropped
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if owner.not_found > 0:
                    owner.not_found -= 1
                    self._answer(404, {"error": {"message": "no version 3 yet"}})
                    return
                if owner.restarting > 0:
                    owner.restarting -= 1
                    self._answer(503, {"error": {"message": "the engine is restarting"}})
                    return
                if owner.dropped > 0:
                    owner.dropped -= 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                choices = [choice(i, [(10 + i, -0.5), (2, -0.1)], f"reply {i}") for i in range(body["n"])]
                self._answer(200, {"choices": choices, "usage": {"prompt_tokens": 4}})

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def fake_gateway() -> Iterator[FakeGateway]:
    gateway = FakeGateway(not_found=1)
    thread = threading.Thread(target=gateway.server.serve_forever, daemon=True)
    thread.start()
    yield gateway
    gateway.server.shutdown()


def test_sampler_asks_the_version_for_token_ids_unlogged_and_waits_for_it(fake_gateway: FakeGateway) -> None:
    endpoint = EngineEndpoint(fake_gateway.url, "sk-test", max_n=4, wait_s=10)
    sampler = endpoint.sampler("bot@3", Template(), max_tokens=16, temperature=0.7)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    forced = {"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False}
    samples = asyncio.run(sampler.sample([{"role": "user", "content": "q"}], tools, 7, forced))
    assert [s.token_ids for s in samples] == [[10, 2], [11, 2], [12, 2], [13, 2], [10, 2], [11, 2], [12, 2]]
    assert all(s.prompt_token_ids == [100, 1, 101] and s.logprobs == [-0.5, -0.1] for s in samples)
    # one 404 (a version the gateway does not know yet) retried, then n=7 split by the gateway's max_n
    assert [body["n"] for _, body in fake_gateway.requests] == [4, 4, 3]
    headers, body = fake_gateway.requests[-1]
    assert headers["x-kaizen-no-log"] == "true" and headers["authorization"] == "Bearer sk-test"
    assert body["model"] == "bot@3" and body["tools"] == tools
    # The captured call's options are repeated: a forced tool call is resampled forced, not as `auto`.
    assert body["tool_choice"] == forced["tool_choice"] and body["parallel_tool_calls"] is False
    assert (
        body["max_tokens"],
        body["temperature"],
        body["logprobs"],
        body["return_tokens_as_token_ids"],
    ) == (
        16,
        0.7,
        True,
        True,
    )
    assert not any(s.app_limit for s in samples)  # the app set no limit: a cut would be the trainer's


def test_sampler_keeps_the_apps_own_reply_limit_within_its_cap(fake_gateway: FakeGateway) -> None:
    sampler = EngineEndpoint(fake_gateway.url, max_n=4, wait_s=10).sampler(
        "bot@3", Template(), max_tokens=16, temperature=1.0
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    question = [{"role": "user", "content": "q"}]
    [own] = asyncio.run(sampler.sample(question, tools, 1, {"tool_choice": "auto", "max_tokens": 12}))
    [capped] = asyncio.run(sampler.sample(question, tools, 1, {"max_tokens": 40}))
    assert [body["max_tokens"] for _, body in fake_gateway.requests[-2:]] == [12, 16]
    assert own.app_limit and not capped.app_limit


def test_a_restarting_engine_and_lost_connections_are_waited_out() -> None:
    """vLLM restarting after a crash answers 503 for a minute or more, and a gateway restarting drops its
    connections: a training run waits them out instead of failing."""
    gateway = FakeGateway(restarting=3, dropped=2)
    thread = threading.Thread(target=gateway.server.serve_forever, daemon=True)
    thread.start()
    try:
        sampler = EngineEndpoint(gateway.url, wait_s=30).sampler(
            "bot@1", Template(), max_tokens=4, temperature=1.0
        )
        samples = asyncio.run(sampler.sample([{"role": "user", "content": "q"}], None, 2, {}))
    finally:
        gateway.server.shutdown()
    assert len(samples) == 2
    assert len(gateway.requests) == 6  # 3 answered 503, 2 dropped, then the answer


def test_the_trainer_waits_long_enough_for_vllm_to_restart() -> None:
    assert EngineEndpoint("http://127.0.0.1:9/v1").wait_s >= 120


def test_an_unreachable_gateway_fails_naming_the_url_and_the_local_sampler() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    sampler = EngineEndpoint(url, wait_s=0.2).sampler("bot@1", Template(), max_tokens=4, temperature=1.0)
    with pytest.raises(EngineSamplingError, match="KAIZEN_TRAIN_SAMPLER=local") as caught:
        asyncio.run(sampler.sample([{"role": "user", "content": "q"}], None, 2, {}))
    assert url in str(caught.value)


def test_engine_reply_ids_train_on_the_template_context_with_behaviour_logprobs() -> None:
    """A resampled reply has exact ids and logprobs but no engine prompt ids: nothing is re-tokenised."""
    report = DataReport()
    t = trajectory(
        0, 1.0, prompt_token_ids=None, completion_token_ids=[7, 8, 2], completion_logprobs=[-0.1, -0.2, -0.3]
    )
    [sample] = tokenize(t, 1.0, Template(), TrainConfig(), report)
    assert sample.input_ids == [100, 1, 101, 7, 8, 2]
    assert sample.behaviour_logprobs == [None, None, None, -0.1, -0.2, -0.3]
    assert report.as_dict() == {"context_from_template": 1}


class RecordingScorer:
    """A stand-in for `trainer.control.scoring.Scorer` that records each group and scores a reply by its length."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.groups: list[list[EpisodeTranscript]] = []

    async def score(self, trajectories: Sequence[EpisodeTranscript]) -> GroupScore:
        self.groups.append(list(trajectories))
        scores = [
            Score(t.episode_id, float(len(t.messages[-1]["content"] or "")), None) for t in trajectories
        ]
        return GroupScore(self.source, "test", None, scores)


def test_ruler_judges_the_original_with_the_resamples_and_its_score_is_discarded() -> None:
    judge = RecordingScorer("judge")
    cfg = TrainConfig(grouping="resample", group_size=3)
    original = trajectory(0, 0.25, reply={"role": "assistant", "content": "the original answer"})
    [group], _ = asyncio.run(
        resample_groups([original], cfg, FixedSampler(), PolicyReplyScorer(judge, "p"), DataReport())
    )
    [judged] = judge.groups
    assert [t.episode_id for t in judged] == ["original", "resample-0", "resample-1"]
    assert judged[0].messages == [*original.context, original.reply]
    assert [m.origin for m in group.members] == ["captured", "resampled", "resampled"]
    assert group.rewards == [0.25, 7.0, 7.0]  # the original keeps its own reward, not the judge's 19


def test_other_scorers_see_only_the_new_replies() -> None:
    function = RecordingScorer("function")
    scores = asyncio.run(
        PolicyReplyScorer(function, "p").score(
            [
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]
                for reply in ("ab", "abc")
            ],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
        )
    )
    assert scores == [2.0, 3.0]
    assert [t.episode_id for t in function.groups[0]] == ["resample-0", "resample-1"]
