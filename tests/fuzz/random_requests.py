"""Random structural fuzzing of the gateway's routes: valid requests with random parts broken, over real HTTP.

`test_fuzz_routes` sends a fixed table of malformed requests. This sends random ones: each starts from a rich,
valid body of a route (tools, tool calls, images, response formats, feedback items...) and replaces, deletes or
adds one to three values anywhere in its JSON tree with values from `VALUES` (wrong types, huge numbers, empty
and deeply nested containers, NUL and lone surrogates, 70 kB strings, impossible dates). A share of requests also
carries random values in the headers the gateway reads, and a share are reads with random query strings. A
request fails the run when the gateway answers it with a 5xx, the connection breaks, or a 4xx is not in OpenAI's
error shape.

The engine is the scripted upstream, which answers like vLLM (a 400 for a schema it cannot compile), or real CPU
vLLM. Against vLLM a second check applies: when the engine refuses a request the gateway passed on (an
`engine_4xx` error), the request must be within OpenAI's spec. One that is not is a spec gap: the gateway should
have refused it itself, with a message that names the field, and without recording a call.

`tests/integration/test_fuzz_random.py` runs short seeded bursts in CI; for a long run, one command:

    python -m tests.fuzz.random_requests --seconds 600 --seed 3 [--database postgres] [--engine vllm]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub.constants

from gateway.settings import Settings

log = logging.getLogger(__name__)

API_KEY = "sk-random-fuzz"
ADMIN_KEY = "admin-random-fuzz"
REQUEST_ID = "{request_id}"  # replaced by the request id of a call the gateway served
EPISODE_ID = "{episode_id}"
RESPONSE_ID = "{response_id}"
MODEL = "{model}"  # replaced by the served model's name

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "find a thing",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            "strict": True,
        },
    }
]
_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "developer", "content": [{"type": "text", "text": "answer in English"}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "found"},
    {"role": "user", "content": "again", "name": "bob"},
]


@dataclass(frozen=True)
class Target:
    method: str
    path: str
    key: str
    body: dict[str, Any]
    spec: str | None = None  # the request's schema in OpenAI's spec, for routes that reach the engine
    limit: str | None = None  # the field that bounds how many tokens the engine generates


TARGETS = [
    Target(
        "POST",
        "/v1/chat/completions",
        API_KEY,
        {
            "model": MODEL,
            "messages": _MESSAGES,
            "tools": _TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
            },
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {"1": -100},
            "stop": ["\n", "END"],
            "max_completion_tokens": 16,
            "n": 1,
            "seed": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "user": "user-1",
            "metadata": {"k": "v"},
            "parallel_tool_calls": True,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "reasoning_effort": "low",
            "modalities": ["text"],
            "service_tier": "auto",
            "store": False,
            "prediction": {"type": "content", "content": "x"},
        },
        "CreateChatCompletionRequest",
        "max_completion_tokens",
    ),
    Target(
        "POST",
        "/v1/chat/completions",
        API_KEY,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 8,
        },
        "CreateChatCompletionRequest",
        "max_tokens",
    ),
    Target(
        "POST",
        "/v1/responses",
        API_KEY,
        {
            "model": MODEL,
            "instructions": "be brief",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "hi"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
                    ],
                },
                {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "found"},
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}],
                },
                {"role": "user", "content": "again"},
            ],
            "tools": [
                {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": False}
            ],
            "tool_choice": "auto",
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
            "max_output_tokens": 32,
            "temperature": 0.3,
            "top_p": 0.9,
            "store": True,
            "metadata": {"a": "b"},
            "include": [],
            "parallel_tool_calls": True,
            "reasoning": {"effort": "low"},
            "truncation": "disabled",
            "user": "user-1",
        },
        "CreateResponse",
        "max_output_tokens",
    ),
    Target(
        "POST",
        "/v1/responses",
        API_KEY,
        {"model": MODEL, "input": "hi", "stream": True},
        "CreateResponse",
        "max_output_tokens",
    ),
    Target(
        "POST",
        "/v1/completions",
        API_KEY,
        {
            "model": MODEL,
            "prompt": ["hi", "there"],
            "max_tokens": 8,
            "logprobs": 2,
            "echo": False,
            "stop": "x",
            "n": 1,
            "suffix": None,
            "logit_bias": {"1": 1},
        },
        "CreateCompletionRequest",
        "max_tokens",
    ),
    Target(
        "POST",
        "/v1/embeddings",
        API_KEY,
        {
            "model": MODEL,
            "input": ["a", "b"],
            "encoding_format": "float",
            "dimensions": 8,
            "user": "u",
        },
        # No `spec`: the embedded model is generative, so vLLM refuses every embeddings request.
    ),
    Target(
        "POST",
        "/v1/feedback",
        API_KEY,
        {
            "request_id": REQUEST_ID,
            "value": 1.0,
            "comment": "good",
            "items": [{"request_id": REQUEST_ID, "value": 0.5}],
            "source": "thumbs",
            "metadata": {"a": 1},
        },
    ),
    Target("PUT", f"/v1/episodes/{EPISODE_ID}", API_KEY, {"metadata": {"k": "v"}, "tags": ["a", "b"]}),
    Target(
        "POST",
        "/admin/policies",
        ADMIN_KEY,
        {"name": "fuzzed", "base_model": "/no/such/model", "config": {"train": {"learning_rate": 1e-4}}},
    ),
    Target("POST", "/admin/policies/default/promote", ADMIN_KEY, {"version": 0}),
    Target("POST", "/admin/policies/default/owner", ADMIN_KEY, {"shared": True}),
    Target(
        "POST",
        "/admin/policies/default/train",
        ADMIN_KEY,
        {"overrides": {"learning_rate": 1e-5}, "since": "2026-01-01T00:00:00Z"},
    ),
    Target(
        "POST",
        "/admin/keys",
        ADMIN_KEY,
        {"name": "fuzzed", "scopes": ["chat", "feedback"], "project": "p", "models": [MODEL]},
    ),
]

# The routes that reach the engine, with the request schema their bodies are checked against.
ENGINE_TARGETS = [target for target in TARGETS if target.spec is not None]
GENERATION_CAP = 16  # tokens, for a real engine's generation request that lost its limit
LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SLOW_S = 30.0  # a real engine's answer to a request of at most 16 tokens that takes longer is a failure

VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 10**40, -(10**40), 1.5, -0.0, 1e308, "", "x", "\u0000", "\ud800",
    "\udfff", "\U0001f600", "x" * 70_000, [], {}, [None], [[]], {"": None}, {"\ud800": 1}, ["\ud800"],
    [1, "a", None], {"type": "x"}, [{"type": "text"}], "NaN", "-1", "2026-02-30T00:00:00Z",
]  # fmt: skip
HEADERS = [
    "x-request-id", "x-kaizen-no-log", "x-episode-id", "x-kaizen-source", "x-kaizen-signature",
    "x-kaizen-group-key", "x-kaizen-model", "accept", "origin", "traceparent", "tracestate", "content-type",
]  # fmt: skip
HEADER_VALUES: list[str | bytes] = [
    "", "x" * 9000, "1", "0", "true", "-1", "nan", "a b", "00-zz-zz-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b"\xe9\xe9", "text/event-stream",
    "application/json; charset=latin-1", "*/*", "null", "sha256=abc", "%00", "../../etc",
]  # fmt: skip
READS = [
    "/v1/models", f"/v1/models/{MODEL}", "/v1/models/%00", f"/v1/episodes/{EPISODE_ID}",
    f"/v1/responses/{RESPONSE_ID}", f"/v1/responses/{RESPONSE_ID}/input_items", "/admin/runs", "/admin/audit",
    "/admin/keys", "/admin/policies", "/admin/capture", "/admin/engine", "/metrics", "/readyz", "/healthz",
]  # fmt: skip
QUERY_KEYS = ["limit", "order", "after", "before", "include", "since", "until", "policy", "version", "q"]
QUERY_VALUES = [
    "", "-1", "0", "1", "100", "101", "1e400", "abc", "%00", "%ff", "x" * 3000, "2026-02-30", "asc", "desc",
    "nan", "99999999999999999999999",
]  # fmt: skip


@dataclass
class Report:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # one line per distinct (route, status)
    # Requests the gateway passed on and the engine refused: each is checked against OpenAI's spec.
    engine_refusals: int = 0
    # Those of them that break OpenAI's spec: the gateway should have answered them itself. One line per distinct
    # (route, place in the request).
    spec_gaps: list[str] = field(default_factory=list)


def _paths(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def mutate(body: dict[str, Any], rng: random.Random, most: int = 3) -> Any:
    """A deep copy of `body` with one to `most` values replaced, deleted or added (the whole body, sometimes)."""
    mutated: Any = copy.deepcopy(body)
    for _ in range(rng.randint(1, most)):
        path = rng.choice(list(_paths(mutated)))
        value = copy.deepcopy(rng.choice(VALUES))
        if not path:
            mutated = value
            continue
        parent = mutated
        for step in path[:-1]:
            parent = parent[step]
        action = rng.choice(["replace", "replace", "delete", "add"])
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[rng.choice(["type", "role", "content", "extra", "\ud800"])] = value
        else:
            parent[path[-1]] = value
    return mutated


def capped(target: Target, body: Any) -> Any:
    """`body` with `target`'s token limit set to `GENERATION_CAP` when the mutation took every limit away. A
    limit of null counts as none: the engine then generates up to the model's context (98 s on CPU vLLM)."""
    if target.limit is None or not isinstance(body, dict) or any(body.get(k) is not None for k in LIMITS):
        return body
    return {**body, target.limit: GENERATION_CAP}


def _error(text: str) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-shaped error body, or None when the body is not one."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    ):
        return error
    return None


class Fuzzer:
    """Sends random requests to one gateway; `run` returns what it saw.

    `model` is the model the requests name. `targets` narrows the routes written to (reads are sent only with
    all of them: a gateway other tests share keeps its state). `real_engine`, for vLLM serving a small text-only
    model: image parts are taken out of the bodies, a generation request that lost its token limit in the
    mutation gets 16 tokens (CPU vLLM is not asked for thousands while the other requests wait), an answer that
    takes over 30 s is a failure, each route's unmutated body must be served first, and a request has one change:
    an engine refusal is down to that change.
    """

    def __init__(
        self,
        base_url: str,
        seed: int,
        *,
        model: str = "scripted-1",
        targets: Sequence[Target] = TARGETS,
        real_engine: bool = False,
    ) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=60)
        self.rng = random.Random(seed)
        self.ids = {REQUEST_ID: "req-none", EPISODE_ID: "ep-none", RESPONSE_ID: "resp-none", MODEL: model}
        self.reads = 0.15 if list(targets) == TARGETS else 0.0
        self.targets = [without_images(t) for t in targets] if real_engine else list(targets)
        self.real_engine = real_engine
        self.report = Report()

    def run(self, requests: int | None = None, seconds: float | None = None) -> Report:
        self._seed_ids()
        if self.real_engine:
            self._check_bases()
        deadline = time.monotonic() + seconds if seconds is not None else None
        while (requests is None or self.report.sent < requests) and (
            deadline is None or time.monotonic() < deadline
        ):
            if self.rng.random() < self.reads:
                self._read()
            else:
                self._write()
            if self.report.sent % 5000 == 0:
                log.info("%d requests sent, %s", self.report.sent, dict(sorted(self.report.statuses.items())))
        self.client.close()
        return self.report

    def _seed_ids(self) -> None:
        """One good call, so feedback, episode and response routes also see ids that exist."""
        chat = self.client.post(
            "/v1/chat/completions",
            json={"model": self.ids[MODEL], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        chat.raise_for_status()
        self.ids[REQUEST_ID] = chat.headers["x-request-id"]
        self.ids[EPISODE_ID] = chat.headers.get("x-episode-id", "ep-none")
        response = self.client.post(
            "/v1/responses",
            json={"model": self.ids[MODEL], "input": "hi", "store": True, "max_output_tokens": 16},
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        response.raise_for_status()
        self.ids[RESPONSE_ID] = response.json()["id"]

    def _check_bases(self) -> None:
        """Each engine route's unmutated body is served; a refusal goes into the report's failures. A body without
        a token limit gets the mutated bodies' cap: uncapped, the streamed Responses body took 186 s of a 500
        request burst on CPU vLLM."""
        for target in self.targets:
            if target.spec is None:
                continue
            answer = self.client.request(
                target.method,
                self._fill(target.path),
                content=self._fill(json.dumps(capped(target, target.body))).encode(),
                headers={"authorization": f"Bearer {target.key}", "content-type": "application/json"},
            )
            if answer.status_code != 200:
                self.report.failures.append(
                    f"{target.method} {target.path}: the unmutated body got {answer.status_code} {answer.text[:300]!r}"
                )
                log.error("%s", self.report.failures[-1])

    def _fill(self, text: str) -> str:
        for placeholder, value in self.ids.items():
            text = text.replace(placeholder, value)
        return text

    def _read(self) -> None:
        path = self._fill(self.rng.choice(READS))
        pairs = [
            f"{self.rng.choice(QUERY_KEYS)}={self.rng.choice(QUERY_VALUES)}"
            for _ in range(self.rng.randint(0, 3))
        ]
        key = ADMIN_KEY if path.startswith("/admin") else API_KEY
        url = path + ("?" + "&".join(pairs) if pairs else "")
        self._send("GET", path, url, None, {"authorization": f"Bearer {key}"})

    def _write(self) -> None:
        target = self.rng.choice(self.targets)
        body = mutate(target.body, self.rng, 1 if self.real_engine else 3)
        if self.real_engine:
            body = capped(target, body)
        text = self._fill(json.dumps(body))
        headers: dict[str, str | bytes] = {
            "authorization": f"Bearer {target.key}",
            "content-type": "application/json",
        }
        if self.rng.random() < 0.3:
            for _ in range(self.rng.randint(1, 3)):
                headers[self.rng.choice(HEADERS)] = self.rng.choice(HEADER_VALUES)
        path = self._fill(target.path)
        error = self._send(target.method, path, path, text.encode("utf-8", "surrogatepass"), headers)
        if error is not None and target.spec is not None and str(error.get("code")).startswith("engine_"):
            self._check_spec(target.spec, path, json.loads(text), error["message"])

    def _send(
        self, method: str, route: str, url: str, content: bytes | None, headers: dict[str, str | bytes]
    ) -> dict[str, Any] | None:
        """Send one request and judge the answer; return its error object when it is a shaped 4xx."""
        try:
            raw = [(k.encode(), v if isinstance(v, bytes) else v.encode()) for k, v in headers.items()]
            started = time.monotonic()
            answer = self.client.request(method, url, content=content, headers=raw)
            status, text = answer.status_code, answer.text
            took = time.monotonic() - started
        except httpx.HTTPError as exc:
            status, text, took = -1, repr(exc), 0.0
        self.report.sent += 1
        self.report.statuses[status] += 1
        error = _error(text) if 400 <= status < 500 else None
        slow = self.real_engine and took > SLOW_S
        if status >= 500 or status < 0 or (400 <= status < 500 and error is None) or slow:
            line = f"{method} {route}: {status}" + (" slow" if slow else "")
            if not any(f.startswith(line + " ") for f in self.report.failures):
                sent = (content or b"")[:300].decode("utf-8", "replace")
                took_s = f"({took:.0f} s) " if slow else ""
                self.report.failures.append(f"{line} {took_s}{text[:300]!r} for {url[:200]} {sent}")
                log.error("%s", self.report.failures[-1])
        return error

    def _check_spec(self, spec: str, route: str, body: Any, refusal: str) -> None:
        """The engine refused a request the gateway let through: fine when the request is within OpenAI's spec
        (a prompt too long, a number out of the engine's range), a gap in the gateway's checks when it is not.
        Top-level fields the spec does not know are not counted: the gateway passes them on to the engine."""
        from jsonschema.exceptions import best_match

        from tests.support.openai_schema import request_errors

        self.report.engine_refusals += 1
        errors = [
            error
            for error in request_errors(spec, body)
            if error.validator != "additionalProperties" or error.absolute_path
        ]
        error = best_match(errors)
        if error is None:
            return
        place = "/".join("*" if isinstance(step, int) else str(step) for step in error.absolute_path)
        line = f"{route} {place or '(body)'}:"
        if not any(gap.startswith(line) for gap in self.report.spec_gaps):
            self.report.spec_gaps.append(f"{line} {error.message[:300]} (the engine: {refusal[:200]})")
            log.error("passed to the engine against the spec: %s", self.report.spec_gaps[-1])
            log.error("the request: %s", json.dumps(body)[:2000])


def without_images(target: Target) -> Target:
    """`target` with the image parts taken out of its body, for an engine serving a text-only model."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, list):
            images = ("image_url", "input_image")
            return [
                strip(item) for item in value if not (isinstance(item, dict) and item.get("type") in images)
            ]
        return value

    return dataclasses.replace(target, body=strip(target.body))


EMBEDDED_MODEL = "smollm2-135m-instruct"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to send requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument(
        "--engine",
        choices=["scripted", "vllm"],
        default="scripted",
        help="the scripted upstream (fast), or real CPU vLLM serving the embedded model (start-up ~1 min)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Start an engine, a database and a gateway, fuzz it for `--seconds`; exit 1 on any failure or spec gap."""
    from tests.support.postgres import PostgresServer, find_bin_dir

    args = parse_args(argv)
    # Random base model names are looked up on the hub: offline, the loader refuses them at once, not after retries.
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    work = Path(tempfile.mkdtemp(prefix="kaizen-fuzz-"))
    postgres = None
    if args.database == "postgres":
        bin_dir = find_bin_dir()
        if bin_dir is None:
            log.error("PostgreSQL server binaries not found")
            return 2
        postgres = PostgresServer(bin_dir)
        postgres.init()
        postgres.start()
        postgres.wait_ready()
    try:
        url = postgres.create_database("fuzz") if postgres else f"sqlite:///{work / 'kaizen.db'}"
        report = _fuzz(args, work / "data", url)
    finally:
        if postgres is not None:
            postgres.destroy()
        shutil.rmtree(work, ignore_errors=True)
    log.info(
        "%d requests, statuses %s, %d engine refusals checked against the spec",
        report.sent,
        dict(sorted(report.statuses.items())),
        report.engine_refusals,
    )
    for failure in report.failures:
        log.error("failure: %s", failure)
    for gap in report.spec_gaps:
        log.error("spec gap: %s", gap)
    return 1 if report.failures or report.spec_gaps else 0


def _fuzz(args: argparse.Namespace, data_dir: Path, database_url: str) -> Report:
    from tests.support.gateway_server import GatewayServer
    from tests.support.scripted_upstream import ScriptedUpstream

    if args.engine == "vllm":
        from gateway.base_models import pull_base_model
        from tests.support.ports import free_port

        # The embedded model is built once into the checkout's data directory, as the test session does.
        models = Path(__file__).resolve().parents[2] / "kaizen-data" / "models"
        pull_base_model(EMBEDDED_MODEL, models)
        data_dir.mkdir(parents=True)
        (data_dir / "models").symlink_to(models)
        settings = fuzz_settings(
            data_dir, database_url, engine="vllm", vllm_port=free_port(), base_model=EMBEDDED_MODEL
        )
        gateway = GatewayServer(settings, startup_timeout_s=900).start()
        try:
            fuzzer = Fuzzer(gateway.url, args.seed, model=EMBEDDED_MODEL, real_engine=True)
            return fuzzer.run(seconds=args.seconds)
        finally:
            gateway.stop()
    with ScriptedUpstream() as upstream:
        settings = fuzz_settings(
            data_dir, database_url, engine="upstream", upstream_url=upstream.url, upstream_token_ids=True
        )
        gateway = GatewayServer(settings).start()
        try:
            return Fuzzer(gateway.url, args.seed).run(seconds=args.seconds)
        finally:
            gateway.stop()


def fuzz_settings(data_dir: Path, database_url: str, **engine: Any) -> Settings:
    """The fuzzed gateway: keys required, no background jobs, the given engine. With the scripted one, the base
    model of new policies fails to load at once (a policy created without one would otherwise build the embedded
    model for minutes)."""
    options: dict[str, Any] = {"base_model": "/no/such/model", **engine}
    return Settings.load(
        data_dir=data_dir,
        database_url=database_url,
        port=0,
        scheduler=False,
        capture_flush_ms=5.0,
        api_keys=[API_KEY],
        admin_key=ADMIN_KEY,
        **options,
    )


if __name__ == "__main__":
    sys.exit(main())
