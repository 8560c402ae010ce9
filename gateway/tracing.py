"""OpenTelemetry traces of chat calls, exported over OTLP/HTTP, for Langfuse, Phoenix, Datadog and the like.

Off by default, and then nothing here is imported: the gateway builds a `CallTracer` only when
`KAIZEN_OTEL_TRACES` is on, and this module imports the OpenTelemetry SDK only inside `CallTracer.__init__`.

Each captured call becomes one span, created when the call is recorded (after its last byte went out) with the
call's real start and end times, so the request path holds no span open and waits on nothing: a batch
processor exports spans from its own thread. A `traceparent` header from the app makes the span a child of
the app's own trace. Attributes follow OpenTelemetry's GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.usage.input_tokens`, ...), plus `kaizen.*` for the
call, episode, policy and adapter version. The conversation itself goes on the span only with
`KAIZEN_OTEL_CONTENT`, and then as it was stored: after the policy's redaction. Calls sent with
`X-Kaizen-No-Log` are neither stored nor traced.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from gateway.settings import Settings
from storage.records import CallRecord

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")

# Request parameters and the GenAI attributes they become.
_REQUEST_ATTRIBUTES = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "n": "gen_ai.request.choice.count",
}


def _parts(content: Any) -> list[dict[str, Any]]:
    """OpenAI message content as GenAI message parts (text; other parts by their type only)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal"):
            parts.append({"type": "text", "content": part.get(kind, "")})
        else:
            parts.append({"type": str(kind or "unknown")})
    return parts


def genai_message(message: Mapping[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One OpenAI chat message in the GenAI conventions' message shape (role, parts, optional name)."""
    role = message.get("role", "assistant")
    if role == "tool":
        content = message.get("content")
        response = content if isinstance(content, str) else [p.get("content") for p in _parts(content)]
        parts = [{"type": "tool_call_response", "id": message.get("tool_call_id"), "response": response}]
    else:
        parts = _parts(message.get("content"))
        if isinstance(message.get("refusal"), str):  # an engine's refusal is the reply's text
            parts.append({"type": "text", "content": message["refusal"]})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments"),
                }
            )
    shaped: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name"):
        shaped["name"] = message["name"]
    if finish_reason is not None:
        shaped["finish_reason"] = finish_reason
    return shaped


def call_attributes(record: CallRecord, provider: str, content: bool) -> dict[str, Any]:
    """The span attributes of a recorded call."""
    params = record.request.get("params") or {}
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": record.model,
        "gen_ai.conversation.id": record.episode_id,
        "kaizen.call_id": record.id,
        "kaizen.episode_id": record.episode_id,
        "gen_ai.request.stream": record.stream,
        "kaizen.status": record.status,
    }
    for param, attribute in _REQUEST_ATTRIBUTES.items():
        value = params.get(param)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[attribute] = value
    stop = params.get("stop")
    if stop is not None:
        attributes["gen_ai.request.stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if record.engine_model is not None:
        attributes["gen_ai.response.model"] = record.engine_model
    if record.policy is not None:
        attributes["kaizen.policy"] = record.policy
    if record.adapter_version is not None:
        attributes["kaizen.adapter_version"] = record.adapter_version
    if record.ttft_ms is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = record.ttft_ms / 1000
    choices = (record.response or {}).get("choices") or []
    if record.response is not None:
        attributes["gen_ai.response.id"] = f"chatcmpl-{record.id}"
        reasons = [c.get("finish_reason") for c in choices if c.get("finish_reason")]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
    usage = record.usage or {}
    if usage.get("prompt_tokens") is not None:
        attributes["gen_ai.usage.input_tokens"] = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        attributes["gen_ai.usage.output_tokens"] = int(usage["completion_tokens"])
    if record.status != "ok":
        code = (record.error or {}).get("code")
        attributes["error.type"] = str(code or record.status)
    if content:
        messages = record.request.get("messages") or []
        attributes["gen_ai.input.messages"] = json.dumps([genai_message(m) for m in messages])
        attributes["gen_ai.output.messages"] = json.dumps(
            [genai_message(c.get("message") or {}, c.get("finish_reason")) for c in choices]
        )
        if record.request.get("tools"):
            attributes["gen_ai.tool.definitions"] = json.dumps(record.request["tools"])
    return attributes


class CallTracer:
    """Makes and exports one span per recorded call (OpenTelemetry SDK, OTLP over HTTP, batched)."""

    def __init__(self, settings: Settings) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        endpoint = settings.otel_endpoint.rstrip("/") + "/v1/traces" if settings.otel_endpoint else None
        headers = dict(_header_pairs(settings.otel_headers)) if settings.otel_headers else None
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.otel_service_name})
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, headers=headers))
        )
        self._tracer = self._provider.get_tracer("kaizen.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._client = SpanKind.CLIENT
        self._error = Status(StatusCode.ERROR)
        self.content = settings.otel_content
        self.provider_name = "vllm" if settings.engine == "vllm" else "openai"
        log.info("tracing chat calls to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")

    def record(self, record: CallRecord, parent: Mapping[str, str] | None) -> None:
        """One span for a recorded call, from its start to when it was recorded. Never raises: tracing must
        not fail a call that was served."""
        try:
            end_ns = int(record.created_at * 1e9)
            start_ns = end_ns - int(record.latency_ms * 1e6)
            context = self._propagator.extract(parent) if parent else None
            span = self._tracer.start_span(
                f"chat {record.model}",
                context=context,
                kind=self._client,
                attributes=call_attributes(record, self.provider_name, self.content),
                start_time=start_ns,
            )
            if record.status != "ok":
                span.set_status(self._error)
            span.end(end_time=end_ns)
        except Exception:
            log.exception("could not trace call %s", record.id)

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Export every finished span now (blocking); True when all went out."""
        return bool(self._provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self._provider.shutdown()


def _header_pairs(text: str) -> list[tuple[str, str]]:
    """`key=value,key2=value2` with URL-encoded values (the OTEL_EXPORTER_OTLP_HEADERS format) as pairs."""
    pairs = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTLP header {item!r} is not key=value")
        pairs.append((key.strip(), unquote(value.strip())))
    return pairs


def build_tracer(settings: Settings) -> CallTracer | None:
    return CallTracer(settings) if settings.otel_traces else None
