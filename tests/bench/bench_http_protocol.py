"""What the read timeouts add to parsing each request, isolated from the network and the app.

Each request's bytes are fed to a protocol object over an in-memory transport, as uvicorn's event loop would
after a read: uvicorn's own httptools protocol against the one `kaizen serve` runs (`gateway.http_protocol`), in
alternating batches, counting CPU time (the least disturbed by other work on a shared machine). The ASGI task
each request starts is the same for both and left out, so what remains is the parser and its callbacks:

    python -m tests.bench.bench_http_protocol [--rounds 15] [--batch 20000] [--out FILE]
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

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.http_protocol import http_protocol
from gateway.settings import Settings

log = logging.getLogger("bench_http_protocol")

_CHAT = b'{"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}'
REQUESTS = {
    "get": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n",
    "chat": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer bench\r\nContent-Length: %d\r\n\r\n%s" % (len(_CHAT), _CHAT),
}


class _Transport:
    """What a protocol needs of a transport: addresses, writes (dropped), no flow control."""

    closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def _protocol(cls: type[HttpToolsProtocol]) -> HttpToolsProtocol:
    config = Config(_app, loop="asyncio", http=cls, lifespan="off")
    config.load()
    protocol = cls(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())  # type: ignore[arg-type]

    def no_task(cycle: RequestResponseCycle, app: Any) -> None:
        pass

    protocol._start_asgi_task = no_task  # type: ignore[method-assign]
    return protocol


def _batch(protocol: HttpToolsProtocol, request: bytes, n: int) -> float:
    """CPU microseconds per request over `n` requests on one kept-alive connection."""
    started = time.process_time()
    for _ in range(n):
        protocol.data_received(request)
        protocol.cycle.response_complete = True  # answered, so the next request is not queued as pipelined
    elapsed = time.process_time() - started
    if protocol.transport.is_closing():  # it refused a request: what was timed is not parsing requests
        raise RuntimeError("the protocol closed the connection")
    return elapsed / n * 1e6


async def _run(rounds: int, batch: int) -> dict[str, Any]:
    protocols = {"uvicorn": _protocol(HttpToolsProtocol), "kaizen": _protocol(http_protocol(Settings()))}
    result: dict[str, Any] = {"rounds": rounds, "batch": batch}
    for kind, request in REQUESTS.items():
        per_round: dict[str, list[float]] = {name: [] for name in protocols}
        for protocol in protocols.values():
            _batch(protocol, request, batch)  # warm-up
        for _ in range(rounds):
            for name, protocol in protocols.items():
                per_round[name].append(_batch(protocol, request, batch))
        result[kind] = {
            "us_per_request_min": {name: min(values) for name, values in per_round.items()},
            "us_per_request": {name: statistics.median(values) for name, values in per_round.items()},
            "added_us_min": min(per_round["kaizen"]) - min(per_round["uvicorn"]),
            # Rounds alternate, so each round's pair met the same conditions.
            "added_us_median": statistics.median(
                k - u for k, u in zip(per_round["kaizen"], per_round["uvicorn"], strict=True)
            ),
        }
    for protocol in protocols.values():
        protocol.connection_lost(None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = asyncio.run(_run(args.rounds, args.batch))
    for kind in REQUESTS:
        fastest = result[kind]["us_per_request_min"]
        log.info(
            "%s: %.2f us per request with uvicorn's protocol, %.2f us with kaizen's (fastest rounds); "
            "added %+.2f us (median of rounds)",
            kind,
            fastest["uvicorn"],
            fastest["kaizen"],
            result[kind]["added_us_median"],
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
