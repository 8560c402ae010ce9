"""What rate limiting adds to each /v1 request, isolated from the network and the engine.

The end-to-end overhead benchmark (``bench_overhead``) cannot resolve tens of microseconds on a shared machine,
so this one drives a trivial /v1 chat handler through Litestar in-process, with the rate-limit middleware
attached (limits set so high nothing is refused) and without it, in alternating batches:

    python -m tests.bench.bench_rate_limits [--rounds 15] [--batch 5000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Router, post
from litestar.types import ASGIApp, HTTPRequestEvent, Message

from gateway.auth import KeyRing
from gateway.rate_limits import SPENDS_TOKENS, Limits, RateLimiter, rate_limit_middleware, token_meter

log = logging.getLogger("bench_rate_limits")


@post("/chat/completions", opt={SPENDS_TOKENS: True}, status_code=200)
async def _chat(request: Request[Any, Any, Any]) -> dict[str, bool]:
    meter = token_meter(request.scope)
    if meter is not None:  # as the chat service does with a call's usage
        meter(30)
    return {"ok": True}


def _app(limited: bool) -> Litestar:
    limiter = RateLimiter(Limits(10**12, 10**12), window_s=60.0)
    middleware = [rate_limit_middleware(limiter, KeyRing([]))] if limited else []
    return Litestar([Router("/v1", route_handlers=[_chat], middleware=middleware)], openapi_config=None)


async def _batch(app: ASGIApp, n: int) -> float:
    """Mean microseconds per request over `n` sequential requests."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", b"Bearer bench"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    statuses: set[int] = set()

    async def receive() -> HTTPRequestEvent:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.add(message["status"])

    started = time.perf_counter()
    for _ in range(n):
        await app({**scope, "state": {}}, receive, send)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    if statuses != {200}:
        raise RuntimeError(f"unexpected statuses {statuses}")
    return elapsed / n * 1e6


async def _run(rounds: int, batch: int) -> dict[str, Any]:
    apps = {"off": _app(limited=False), "on": _app(limited=True)}
    for app in apps.values():
        await _batch(app, batch)
    per_round: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(rounds):
        for name, app in apps.items():
            per_round[name].append(await _batch(app, batch))
    added = [on - off for on, off in zip(per_round["on"], per_round["off"], strict=True)]
    return {
        "rounds": rounds,
        "batch": batch,
        "us_per_request": {name: statistics.median(values) for name, values in per_round.items()},
        # The fastest round of each side: the least disturbed by other work on a shared machine.
        "us_per_request_min": {name: min(values) for name, values in per_round.items()},
        "added_us_median": statistics.median(added),
        "per_round": per_round,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = asyncio.run(_run(args.rounds, args.batch))
    log.info(
        "per request (median, fastest round): %.1f, %.1f us without limits; %.1f, %.1f us with; "
        "added (median of rounds) %.1f us",
        result["us_per_request"]["off"],
        result["us_per_request_min"]["off"],
        result["us_per_request"]["on"],
        result["us_per_request_min"]["on"],
        result["added_us_median"],
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
