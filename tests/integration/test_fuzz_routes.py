"""Malformed requests on every route: never a 5xx, every error in OpenAI's shape, nothing written.

The cases are a table of the app's routes crossed with mutators (body, path parameter, query parameter,
auth header), sent over real HTTP to a real gateway on SQLite and on PostgreSQL. The dashboard's pages answer
HTML: their errors are HTML pages with a 4xx (or a redirect to the login form), never a 5xx; its fetch
endpoints answer JSON in OpenAI's shape like every other route. Dashboard routes authenticate with the
session cookie (and, for writes, the CSRF header) of a login made at the start of the test.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.body_depth import MAX_JSON_DEPTH
from gateway.http_protocol import OpenAIH11Protocol, OpenAIHttpToolsProtocol
from gateway.settings import Settings
from tests.conftest import query
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate

MAX_BODY = 64 * 1024
API_KEY = "sk-fuzz"
ADMIN_KEY = "admin-fuzz"
DEEP = 990  # deeper than the decoders' recursion allows
TABLES = (
    "calls",
    "rewards",
    "episodes",
    "policies",
    "adapters",
    "training_runs",
    "api_keys",
    "audit",
    "responses",
    "rollouts",
    "version_pins",
)
SESSION = (
    "dashboard-session"  # as a route's `key`: the dashboard's cookie (and CSRF header), not a bearer key
)


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # with `{param}` for a path parameter
    key: str | None  # the bearer token the route wants
    body: dict[str, Any] | None = None  # a valid body, for routes that take one
    fields: dict[str, list[Any]] = field(default_factory=dict)  # body field -> values of the wrong type/range
    params: dict[str, str] = field(default_factory=dict)  # path parameter -> a well-formed value
    query: dict[str, list[str]] = field(default_factory=dict)  # query parameter -> malformed values
    reads_only: bool = False  # GET routes that answer 200 to input they ignore
    required: tuple[str, ...] = ()  # body fields whose absence is an error
    number_field: str = "n"  # where "huge number" puts its 400-digit integer (a field the route checks)
    html: bool = False  # a dashboard page: errors are HTML pages (or a redirect to the login form)


USER = [{"role": "user", "content": "hi"}]

ROUTES = [
    Route(
        "POST",
        "/v1/chat/completions",
        API_KEY,
        {"model": "scripted-1", "messages": USER},
        {
            "model": [12, None, "", "no-such-model", ["scripted-1"]],
            "messages": [[], "hi", [1], [{"role": "wizard", "content": "x"}], None],
            "n": [0, -1, 10**30, "2"],
            "max_tokens": [0, -5, 10**30, 1e400, "ten"],
            "temperature": [-1, 10**30, "hot"],
            "seed": [10**30, -(10**30)],
            "max_completion_tokens": [2**31, 0],
            "stream": ["yes", 1],
            "tools": [{"type": "function"}, [{"type": "function", "function": {}}]],
        },
        required=("model", "messages"),
    ),
    Route(
        "POST",
        "/v1/responses",
        API_KEY,
        {"model": "scripted-1", "input": "hi"},
        {
            "model": [12, None, "", "no-such-model", ["scripted-1"]],
            "input": [[], 5, None, [1], [{"type": "nope"}], [{"role": "wizard", "content": "x"}]],
            "instructions": [5, ["x"]],
            "tools": [{"type": "function"}, [{"type": "function"}], [{"type": "web_search"}]],
            "tool_choice": ["sometimes", {"type": "function"}, {"type": "function", "name": "nope"}],
            "text": ["x", {"format": {"type": "json_schema"}}],
            "max_output_tokens": [0, 15, 10**30, 1e400, "ten"],
            "temperature": [-1, 10**30, "hot"],
            "previous_response_id": [5, "", "resp_none", "nul\u0000"],
            "include": ["x", ["everything"]],
            "metadata": [[], {"k": 5}],
            "stream": ["yes", 1],
            "user": ["nul\u0000"],
        },
        required=("model", "input"),
    ),
    Route("GET", "/v1/responses/{response_id}", API_KEY, params={"response_id": "resp_none"}),
    Route(
        "GET",
        "/v1/responses/{response_id}/input_items",
        API_KEY,
        params={"response_id": "resp_none"},
        query={"limit": ["abc", "-1", "0", "101", "1e400", ""], "order": ["up", ""]},
    ),
    Route("DELETE", "/v1/responses/{response_id}", API_KEY, params={"response_id": "resp_none"}),
    Route(
        "POST",
        "/v1/completions",
        API_KEY,
        {"model": "scripted-1", "prompt": "hi"},
        {
            "model": [12, None, "", "no-such-model"],
            "prompt": [None, 5, [], [{"a": 1}], ["a", 1], [[]]],
            "max_tokens": [-1, 10**30, "ten"],
            "logprobs": [-1, 6, "x"],
            "logit_bias": [{"role": 1}, {"-1": 1}, {"1": 101}],
            "n": [0, 10**30],
            "stream": ["yes"],
            "stream_options": [{"include_usage": True}],
        },
        required=("model", "prompt"),
    ),
    Route(
        "POST",
        "/v1/embeddings",
        API_KEY,
        {"model": "scripted-1", "input": "hi"},
        {
            "model": [12, None, "", "no-such-model"],
            "input": [None, 5, "", [], [""], ["a", 1], {"a": 1}],
            "encoding_format": ["hex", 5],
            "dimensions": [0, "x"],
        },
        required=("model", "input"),
        number_field="dimensions",
    ),
    Route("GET", "/v1/models/{model_id}", API_KEY, params={"model_id": "scripted-1"}),
    Route(
        "POST",
        "/v1/feedback",
        API_KEY,
        {"request_id": "req-does-not-exist", "value": 1.0},
        {
            "value": [None, [], {"a": 1}, 1e400, "nul\u0000"],
            "request_id": [12, None, "x" * 10_000, "nul\u0000"],
            "items": [5, [1]],
            "comment": [5],
        },
        required=("value",),
    ),
    Route("GET", "/v1/episodes/{episode_id}", API_KEY, params={"episode_id": "ep-none"}),
    Route(
        "PUT",
        "/v1/episodes/{episode_id}",
        API_KEY,
        {"metadata": {"k": "v"}},
        {
            "metadata": [[], "x", 5, {"k": "nul\u0000"}],
            "tags": ["x", [1, 2], {"a": 1}, ["nul\u0000"]],
            "unknown": [1],
        },
        params={"episode_id": "ep-none"},
    ),
    Route("GET", "/v1/models", API_KEY, reads_only=True),
    Route("GET", "/healthz", None, reads_only=True),
    Route("GET", "/readyz", None, reads_only=True),
    Route("GET", "/metrics", ADMIN_KEY, reads_only=True),  # the gateway has keys: on loopback too
    Route("GET", "/admin/capture", ADMIN_KEY, reads_only=True),
    Route("GET", "/admin/engine", ADMIN_KEY, reads_only=True),
    Route("GET", "/admin/policies", ADMIN_KEY, reads_only=True),
    Route(
        "POST",
        "/admin/policies",
        ADMIN_KEY,
        {"name": "fuzz", "base_model": "no-such-base-model"},
        {
            "name": [None, 5, [], "", "nul\u0000"],
            "config": ["x", [1]],
            "base_model": [5, "/no/such/model"],
            "project": [5, "", "nul\u0000", "x" * 200],
            "shared": ["yes", None],
        },
        required=("name",),
    ),
    Route(
        "POST",
        "/admin/policies/{name}/owner",
        ADMIN_KEY,
        {"shared": True},
        {"project": [5, "", "nul\u0000", "shop"], "shared": ["yes", 5, None], "unknown": [1]},
        params={"name": "nope"},
    ),
    Route(
        "POST",
        "/admin/policies/{name}/promote",
        ADMIN_KEY,
        {"version": 1},
        {"version": [-1, 10**30, "one", None, 1.5]},
        params={"name": "nope"},
        required=("version",),
    ),
    *[
        Route("POST", f"/admin/policies/{{name}}/{action}", ADMIN_KEY, params={"name": "nope"})
        for action in ("rollback", "judge", "retention", "pause", "resume")
    ],
    Route(
        "GET",
        "/admin/policies/{name}/versions/rewards",
        ADMIN_KEY,
        params={"name": "nope"},
        query={"since": ["yesterday", "2026-13-01", "%00", "5"]},
    ),
    Route(
        "GET",
        "/admin/policies/{name}/versions/compare",
        ADMIN_KEY,
        params={"name": "nope"},
        query={"a": ["abc", "-1", "99999999999999999999999", "1e400", ""], "b": ["1.5", "%00"]},
    ),
    Route(
        "GET",
        "/admin/policies/{name}/rollouts",
        ADMIN_KEY,
        params={"name": "nope"},
        query={"limit": ["abc", "-1", "0", "99999999999999999999999", ""]},
    ),
    Route(
        "POST",
        "/admin/policies/{name}/rollouts",
        ADMIN_KEY,
        {"version": 1, "share": 0.1},
        {
            "version": [-1, 10**30, "one", None, 1.5],
            "share": [0, -0.5, 1.5, "half", None, 10**30],
            "mode": ["blue-green", 5, None],
            "rule": ["x", [1], {"alpha": 2}, {"nope": 1}],
            "unknown": [1],
        },
        params={"name": "nope"},
        required=("version", "share"),
    ),
    Route(
        "POST",
        "/admin/policies/{name}/rollouts/{rollout_id}/end",
        ADMIN_KEY,
        {"status": "stopped"},
        {"status": ["done", 5, None], "reason": [5, ["x"]], "unknown": [1]},
        params={"name": "nope", "rollout_id": "1"},
        required=("status",),
    ),
    Route("GET", "/admin/policies/{name}/pins", ADMIN_KEY, params={"name": "nope"}),
    Route(
        "POST",
        "/admin/policies/{name}/pins",
        ADMIN_KEY,
        {"scope": "project", "subject": "shop", "version": 1},
        {
            "scope": ["team", 5, None],
            "subject": [5, "", "nul\u0000", "x" * 200],
            "version": [-1, 10**30, "one", None],
            "unknown": [1],
        },
        params={"name": "nope"},
        required=("scope", "subject", "version"),
    ),
    Route(
        "DELETE",
        "/admin/policies/{name}/pins/{pin_scope}/{subject}",
        ADMIN_KEY,
        params={"name": "nope", "pin_scope": "project", "subject": "shop"},
    ),
    Route(
        "POST",
        "/admin/policies/{name}/train",
        ADMIN_KEY,
        {"overrides": {"mode": "sft"}, "since": "2026-01-01T00:00:00Z"},
        {
            "overrides": ["x", [1], {"lerning_rate": 1}, {"mode": "dance"}],
            "since": ["yesterday", 5, "2026-13-01"],
            "unknown": [1],
        },
        params={"name": "nope"},
    ),
    Route(
        "GET",
        "/admin/runs",
        ADMIN_KEY,
        query={"limit": ["abc", "-1", "0", "99999999999999999999999", "1e400", ""]},
        reads_only=True,
    ),
    Route("GET", "/admin/runs/{run_id}", ADMIN_KEY, params={"run_id": "1"}),
    Route(
        "POST",
        "/admin/keys",
        ADMIN_KEY,
        {"name": "fuzz", "scopes": ["chat"]},
        {
            "name": [None, 5, "", "nul\u0000", "x" * 200],
            "scopes": ["chat", [], ["root"], [5], None],
            "project": [5, "", "nul\u0000"],
            "models": ["x", [5]],
        },
        required=("name", "scopes"),
    ),
    Route("GET", "/admin/keys", ADMIN_KEY, reads_only=True),
    Route("DELETE", "/admin/keys/{key_id}", ADMIN_KEY, params={"key_id": "key_none"}),
    Route("POST", "/admin/keys/{key_id}/revoke", ADMIN_KEY, params={"key_id": "key_none"}),
    Route(
        "GET",
        "/admin/audit",
        ADMIN_KEY,
        query={"limit": ["abc", "-1", "0", "99999999999999999999999", "1e400", ""]},
        reads_only=True,
    ),
    # The dashboard: pages (HTML) and the fetches its script makes (JSON).
    Route("GET", "/dashboard/login", None, query={"next": ["%00", "x" * 3000]}, html=True),
    Route(
        "POST",
        "/dashboard/session",
        None,
        {"key": "not-a-key"},
        {"key": [None, 5, "", "x" * 5000], "next": [5, "x" * 3000]},
        required=("key",),
    ),
    Route(
        "GET",
        "/dashboard",
        SESSION,
        query={"window": ["9y", "%00"], "policy": ["%00", "x" * 300]},
        reads_only=True,
        html=True,
    ),
    Route(
        "GET",
        "/dashboard/episodes",
        SESSION,
        query={
            "version": ["abc", "-1", "99999999999999999999999"],
            "min_reward": ["abc", "nan", "1e400"],
            "max_reward": ["inf"],
            "feedback": ["maybe"],
            "rewarded": ["2"],
            "since": ["yesterday", "2025-13-45"],
            "until": ["%00"],
            "q": ["%00", "x" * 300],
            "after": ["not-a-cursor", "~", "2025-01-01T00:00:00~%00"],
        },
        reads_only=True,
        html=True,
    ),
    Route(
        "GET",
        "/dashboard/episodes/{episode_id}",
        SESSION,
        params={"episode_id": "ep-none"},
        query={"queue": ["sideways"]},
        html=True,
    ),
    Route("GET", "/dashboard/review", SESSION, query={"part": ["middle"], "after": ["%00"]}, html=True),
    Route("GET", "/dashboard/policies", SESSION, reads_only=True, html=True),
    Route("GET", "/dashboard/policies/{name}", SESSION, params={"name": "nope"}, html=True),
    Route(
        "GET",
        "/dashboard/runs",
        SESSION,
        query={"kind": ["dance"], "status": ["?"], "before": ["abc", "-5"]},
        reads_only=True,
        html=True,
    ),
    Route("GET", "/dashboard/runs/{run_id}", SESSION, params={"run_id": "1"}, html=True),
    Route(
        "GET",
        "/dashboard/judge",
        SESSION,
        query={"window": ["forever"], "status": ["fine"], "before": ["x"]},
        reads_only=True,
        html=True,
    ),
    Route("GET", "/dashboard/static/{name}", None, params={"name": "dashboard.css"}),
    Route(
        "POST",
        "/dashboard/feedback",
        SESSION,
        {"episode_id": "ep-none", "value": True},
        {
            "value": [None, [], {"a": 1}, "good", 1e400],
            "episode_id": [5, "", "x" * 100, "nul\u0000"],
            "request_id": [5, "bad id with spaces"],
            "comment": [5, "x" * 10_001],
        },
        required=("value",),
    ),
    Route("POST", "/dashboard/logout", SESSION),
    Route(
        "POST",
        "/dashboard/policies/{name}/promote",
        SESSION,
        {"version": 1},
        {"version": [-1, 10**30, "one", None, 1.5]},
        params={"name": "nope"},
        required=("version",),
    ),
    *[
        Route("POST", f"/dashboard/policies/{{name}}/{action}", SESSION, params={"name": "nope"})
        for action in ("rollback", "pause", "resume")
    ],
]


@dataclass(frozen=True)
class Case:
    name: str
    route: Route
    path: str
    content: bytes | None
    headers: dict[str, str | bytes]
    rejected: bool  # must be a 4xx


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BodyMutator = Callable[[dict[str, Any]], bytes]

BODY_MUTATORS: dict[str, BodyMutator] = {
    "empty body": lambda _: b"",
    "truncated json": lambda b: _json(b)[:-3],
    "array body": lambda b: _json([b]),
    "string body": lambda _: b'"hello"',
    "number body": lambda _: b"12",
    "null body": lambda _: b"null",
    "empty object": lambda _: b"{}",
    "deep nesting": lambda _: _nested(DEEP).encode(),
    "deep nesting in a field": lambda b: _json(b)[:-1] + b', "deep": ' + _nested(DEEP).encode() + b"}",
    # Just within what the decoders take, but not what storing, schema checks or templates take after them.
    "decodable deep nesting in a field": lambda b: (
        _json(b)[:-1] + b', "deep": ' + _nested(960).encode() + b"}"
    ),
    "nesting past the limit in a field": lambda b: (
        _json(b)[:-1] + b', "deep": ' + _nested(MAX_JSON_DEPTH).encode() + b"}"
    ),
    "invalid utf-8": lambda b: _json(b)[:-1] + b', "x": "\xff\xfe"}',
    "invalid utf-8 in a key": lambda b: _json(b)[:-1] + b', "\xc3\x28": 1}',
    "nul bytes": lambda b: b"\x00" + _json(b),
    "form encoded": lambda _: b"model=scripted-1&messages=hi",
    "oversized body": lambda b: _json({**b, "pad": "x" * (MAX_BODY + 10)}),
    "huge number": lambda b: _json(b)[:-1] + b', "{number_field}": 1' + b"0" * 400 + b"}",
}

PATH_MUTATIONS = ["99999999999999999999999", "-5", "0", "%00", "%ff%fe", "x" * 5000, "a%2Fb", "%20"]

AUTH_MUTATIONS: dict[str, str | bytes] = {
    "wrong key": "Bearer wrong",
    "basic scheme": "Basic dXNlcjpwYXNz",
    "no token": "Bearer",
    "latin-1 bytes": "Bearer \u00e9\u00e9".encode("latin-1"),
}


def _url(route: Route, **params: str) -> str:
    return route.path.format(**{**route.params, **params})


def _auth(route: Route) -> dict[str, str]:
    if route.key == SESSION:
        return {"x-fuzz-session": "with-csrf"}  # replaced by the login's cookie and CSRF header when sent
    return {"authorization": f"Bearer {route.key}"} if route.key else {}


def build_cases() -> list[Case]:
    cases: list[Case] = []
    json_headers = {"content-type": "application/json"}
    for route in ROUTES:
        rid = f"{route.method} {route.path}"
        headers = {**_auth(route), **json_headers}
        if route.body is not None:
            for name, mutate in BODY_MUTATORS.items():
                content = mutate(route.body).replace(b"{number_field}", route.number_field.encode())
                if name == "form encoded":
                    headers = {**headers, "content-type": "application/x-www-form-urlencoded"}
                cases.append(Case(f"{rid}: {name}", route, _url(route), content, headers, True))
                headers = {**_auth(route), **json_headers}
            for key in route.required:
                body = {k: v for k, v in route.body.items() if k != key}
                cases.append(Case(f"{rid}: missing {key}", route, _url(route), _json(body), headers, True))
            for key, values in route.fields.items():
                for value in values:
                    content = _json({**route.body, key: value}) if value != 1e400 else b""
                    if value == 1e400:
                        content = _json(route.body)[:-1] + f', "{key}": 1e400}}'.encode()
                    cases.append(
                        Case(f"{rid}: {key}={value!r:.30}", route, _url(route), content, headers, True)
                    )
        for name, param in [(n, p) for p in route.params for n in PATH_MUTATIONS]:
            content = _json(route.body) if route.body is not None else None
            cases.append(
                Case(
                    f"{rid}: {param}={name:.20}", route, _url(route, **{param: name}), content, headers, True
                )
            )
        for param, values in route.query.items():
            for value in values:
                cases.append(
                    Case(
                        f"{rid}: ?{param}={value:.20}",
                        route,
                        f"{_url(route)}?{param}={value}",
                        None,
                        headers,
                        True,
                    )
                )
        if route.key is not None:
            for name, value in AUTH_MUTATIONS.items():
                content = _json(route.body) if route.body is not None else None
                bad = {**json_headers, "authorization": value}
                cases.append(Case(f"{rid}: auth {name}", route, _url(route), content, bad, True))
            content = _json(route.body) if route.body is not None else None
            cases.append(Case(f"{rid}: no auth", route, _url(route), content, json_headers, True))
        if route.key == SESSION:
            content = _json(route.body) if route.body is not None else None
            forged = {**json_headers, "cookie": "kaizen_dashboard=e30.AAAA"}
            cases.append(Case(f"{rid}: forged session", route, _url(route), content, forged, True))
            if route.method == "POST":
                no_csrf = {**json_headers, "x-fuzz-session": "without-csrf"}
                cases.append(Case(f"{rid}: no csrf token", route, _url(route), content, no_csrf, True))
        if route.reads_only:
            cases.append(
                Case(f"{rid}: junk query", route, _url(route) + "?%ff=%00&limit", None, headers, False)
            )
    return cases


CASES = build_cases()


def _counts(url: str) -> dict[str, int]:
    return {t: query(url, f"SELECT count(*) AS n FROM {t}")[0]["n"] for t in TABLES}


def _raw_request(port: int, request: bytes) -> bytes:
    """Bytes no HTTP client library will send (a bare LF inside a header value)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_table_covers_every_route_and_is_large() -> None:
    assert len(CASES) >= 100
    served = {(r.method, r.path) for r in ROUTES}
    from gateway.app import build_services, create_app  # the app's own route list, so new routes get fuzzed
    from gateway.settings import Settings

    settings = Settings.load(engine="upstream", upstream_url="http://127.0.0.1:9/v1", scheduler=False)
    app = create_app(build_services(settings))
    for route in app.routes:
        path = route.path.replace(":str}", "}").replace(":int}", "}").replace(":path}", "}")
        for method in route.methods - {"OPTIONS", "HEAD"}:
            assert (method, path) in served, f"{method} {path} is not fuzzed"


def test_malformed_requests_get_openai_shaped_4xx_and_write_nothing(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    session = login(gw.url, ADMIN_KEY)
    cookie = "; ".join(f"{name}={value}" for name, value in session.cookies.items())
    csrf = str(session.headers["x-kaizen-csrf"])
    before = _counts(database_url)
    statuses: dict[str, int] = {}
    failures: list[str] = []
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for case in CASES:
            headers = dict(case.headers)
            mode = headers.pop("x-fuzz-session", None)
            if mode is not None:
                headers["cookie"] = cookie
                if mode == "with-csrf":
                    headers["x-kaizen-csrf"] = csrf
            response = client.request(case.route.method, case.path, content=case.content, headers=headers)
            statuses[case.name] = response.status_code
            if response.status_code >= 500:
                failures.append(f"{case.name}: {response.status_code} {response.text[:200]}")
                continue
            refused = 400 <= response.status_code < 500 or (case.route.html and response.status_code == 303)
            if case.rejected and not refused:
                failures.append(f"{case.name}: expected a 4xx, got {response.status_code}")
            if case.route.html and response.headers["content-type"].startswith("text/html"):
                continue  # a page's error is a page (a URL no route matches gets the app's JSON 404)
            if response.status_code >= 400:
                try:
                    validate("ErrorResponse", response.json())
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
                except Exception as exc:
                    failures.append(
                        f"{case.name}: error body not OpenAI-shaped: {response.text[:200]} ({exc})"
                    )
        raw = _raw_request(gw.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\nb\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    validate("ErrorResponse", json.loads(body))
    gw.flush()
    assert failures == [], "\n".join(failures)
    assert _counts(database_url) == before
    sent = len(statuses) + 1
    assert sent >= 100
    assert sum(1 for s in statuses.values() if 400 <= s < 500) >= 100
    assert gw.services.sink.snapshot()["queued"] == 0


def test_text_postgresql_cannot_store_is_a_400(
    make_gateway: Callable[..., GatewayServer], postgres: Any
) -> None:
    """A NUL character is valid JSON, but PostgreSQL text cannot hold it: the request's fault, not a 500."""
    url = postgres.create_database("fuzz_nul")
    gw = make_gateway(url)
    call = httpx.post(gw.url + "/v1/chat/completions", json={"model": "scripted-1", "messages": USER})
    gw.flush()
    before = _counts(url)
    body = {"request_id": call.headers["x-request-id"], "value": 1.0, "comment": "nul\u0000"}
    response = httpx.post(gw.url + "/v1/feedback", json=body)
    assert response.status_code == 400, response.text
    validate("ErrorResponse", response.json())
    assert _counts(url) == before


@pytest.mark.parametrize("http", [OpenAIHttpToolsProtocol, OpenAIH11Protocol], ids=["httptools", "h11"])
def test_requests_the_http_parser_rejects_get_an_openai_shaped_400(
    http: type[asyncio.Protocol], tmp_path: Path
) -> None:
    """Both of uvicorn's parsers (httptools, and h11 where httptools is not installed) answer OpenAI-shaped."""
    settings = Settings.load(
        data_dir=tmp_path,
        engine="upstream",
        upstream_url="http://127.0.0.1:9/v1",
        scheduler=False,
        port=0,
    )
    gw = GatewayServer(settings, http=http).start()
    try:
        for request in (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\nb\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
            b"NOT HTTP AT ALL\r\n\r\n",
        ):
            raw = _raw_request(gw.port, request)
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), raw
            assert b"content-type: application/json" in head.lower(), raw
            validate("ErrorResponse", json.loads(body))
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    finally:
        gw.stop()


def test_json_nested_to_the_limit_is_stored_and_one_level_more_is_refused(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key=ADMIN_KEY)
    call = httpx.post(gw.url + "/v1/chat/completions", json={"model": "scripted-1", "messages": USER})
    episode = call.headers["x-episode-id"]
    gw.flush()

    def metadata(depth: int) -> bytes:  # {"metadata": {"m": [[...]]}}: `depth` containers in all
        return b'{"metadata": {"m": ' + _nested(depth - 2).encode() + b"}}"

    url = f"{gw.url}/v1/episodes/{episode}"
    json_headers = {"content-type": "application/json"}
    stored = httpx.put(url, content=metadata(MAX_JSON_DEPTH), headers=json_headers)
    assert stored.status_code == 200, stored.text
    [row] = query(database_url, "SELECT metadata FROM episodes WHERE id = :e", e=episode)
    assert str(row["metadata"]).count("[") == MAX_JSON_DEPTH - 2
    for depth in (MAX_JSON_DEPTH + 1, 960):  # 960: once decoded, then a 500 when stored
        refused = httpx.put(url, content=metadata(depth), headers=json_headers)
        assert refused.status_code == 400, refused.text
        validate("ErrorResponse", refused.json())
        assert refused.json()["error"]["code"] == "invalid_json"
    [after] = query(database_url, "SELECT metadata FROM episodes WHERE id = :e", e=episode)
    assert after == row

    # A policy whose configuration cannot be stored leaves no adapter directory behind either.
    created = httpx.post(
        gw.url + "/admin/policies",
        content=b'{"name": "deep", "config": {"train": {"m": ' + _nested(960).encode() + b"}}}",
        headers={**json_headers, "authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert created.status_code == 400, created.text
    assert not (gw.settings.data_dir / "adapters" / "deep").exists()
