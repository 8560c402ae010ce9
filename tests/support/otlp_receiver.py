"""An OTLP/HTTP trace receiver: what a collector, Langfuse or Phoenix would be given, decoded for tests.

It accepts `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` (gzip or not), decodes it with the
`opentelemetry-proto` package and keeps every span as a plain `ReceivedSpan`, with the request headers. It
answers as a collector does (200 and an `ExportTraceServiceResponse`).

Run standalone (the overhead benchmark does): ``python -m tests.support.otlp_receiver --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.support.background_server import BackgroundServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1 Span.SpanKind
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    headers: dict[str, str]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind is not None else None


def _attributes(pairs: Sequence[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode(body: bytes, headers: dict[str, str]) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        status_code=span.status.code,
                        attributes=_attributes(span.attributes),
                        resource=resource,
                        scope=scope_spans.scope.name,
                        headers=headers,
                    )
                )
    return spans


def build_app(spans: list[ReceivedSpan]) -> web.Application:
    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="expected application/x-protobuf")
        spans.extend(decode(body, {k.lower(): v for k, v in request.headers.items()}))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", traces)
    return app


@dataclass
class OtlpReceiver:
    """The receiver on a background thread with its own event loop: `with OtlpReceiver() as receiver: ...`."""

    host: str = "127.0.0.1"
    port: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)
    _server: BackgroundServer | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """The OTLP/HTTP base URL (`/v1/traces` is appended by exporters)."""
        return f"http://{self.host}:{self.port}"

    def wait_for(self, count: int, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while len(self.spans) < count:
            assert time.monotonic() < deadline, f"expected {count} spans, received {len(self.spans)}"
            time.sleep(0.01)
        return list(self.spans)

    def start(self) -> OtlpReceiver:
        self._server = BackgroundServer(
            web.AppRunner(build_app(self.spans), access_log=None), self.host, self.port, "otlp"
        )
        self.port = self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def _serve_forever(host: str, port: int) -> None:
    spans: list[ReceivedSpan] = []
    runner = web.AppRunner(build_app(spans), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    logger.info("OTLP receiver listening on http://%s:%d/v1/traces", host, port)
    received = 0
    try:
        while True:  # keep no spans, only their count
            await asyncio.sleep(10)
            received += len(spans)
            spans.clear()
            logger.info("%d spans received so far", received)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.host, args.port))


if __name__ == "__main__":
    main()
