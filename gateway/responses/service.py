"""The Responses API service: a `POST /v1/responses` call is translated into a chat completion and served,
captured and rewarded through `ChatService`, then answered as a `Response` (or its event stream).

Each create is one `calls` row whose request holds the translated chat messages, so training, judging,
episodes and feedback treat it like chat traffic. A `previous_response_id` chain continues the episode of the
response it names; the response itself is stored beside its call (`gateway.responses.store`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.auth import Principal
from gateway.chat import CallContext, ChatService, LastBatch
from gateway.errors import APIError, InvalidRequest
from gateway.normalize import Captured
from gateway.responses.output import (
    ResponseEvents,
    ResponseShape,
    call_id_of,
    captured_reply,
    encode,
    encode_event,
    from_captured,
    from_completion,
    response_id,
    to_builtins,
)
from gateway.responses.protocol import FunctionCallItem, FunctionCallOutputItem, InputMessageItem
from gateway.responses.request import (
    LOGPROBS_INCLUDE,
    InputItem,
    ResolvedItem,
    chat_body,
    convert,
    extra_fields,
    item_resources,
    parse_items,
    parse_request,
    references,
    to_messages,
    translate_tools,
)
from gateway.responses.store import KnownResponse, ResponseStore
from storage.records import ResponseRecord

_ITEM_MODELS: dict[str, type[ResolvedItem]] = {
    "message": InputMessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


@dataclass
class ResponseCall:
    """One create: the chat call it was translated into and what its response echoes."""

    ctx: CallContext
    shape: ResponseShape

    @property
    def stream(self) -> bool:
        return bool(self.shape.request.stream)


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    # ------------------------------------------------------------------ create
    async def prepare(
        self, raw_body: bytes, headers: Mapping[str, str], principal: Principal
    ) -> ResponseCall:
        """Validate and translate a create. Raises `APIError` (4xx) and writes nothing on bad input.

        Only a `previous_response_id` or an `item_reference` this replica does not hold reads the database."""
        started = time.perf_counter()
        body = self.chat.decode_body(raw_body)
        request = parse_request(body)
        items = parse_items(request.input)
        tools = translate_tools(request)
        previous: KnownResponse | None = None
        if request.previous_response_id is not None:
            previous = await self.store.find(request.previous_response_id, principal)
            if previous is None:
                raise InvalidRequest(
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        referenced = await self._resolve(items, principal)
        messages = to_messages(
            request.instructions, previous.conversation if previous else [], items, referenced
        )
        ctx = self.chat.prepare_body(
            chat_body(request, messages, tools, extra_fields(body)),
            headers,
            principal,
            started=started,
            continues=previous.episode_id if previous is not None and previous.episode_resolved else None,
        )
        shape = ResponseShape(
            ctx.call_id,
            int(time.time()),
            request,
            tools.tools,
            logprobs=LOGPROBS_INCLUDE in (request.include or ()),
        )
        call = ResponseCall(ctx, shape)
        if request.store is not False:
            earlier = previous.chain_items() if previous is not None else []
            ctx.store_response = lambda captured: self._store(call, earlier, items, referenced, captured)
        return call

    async def _resolve(self, items: Sequence[InputItem], principal: Principal) -> dict[str, ResolvedItem]:
        """The stored items that `item_reference` inputs name, by id (of responses the key's project sees)."""
        found: dict[str, ResolvedItem] = {}
        responses: dict[str, KnownResponse | None] = {}
        for index, item_id in references(items):
            call_id = call_id_of(item_id)
            item: dict[str, Any] | None = None
            if call_id is not None:
                owner = response_id(call_id)
                if owner not in responses:
                    responses[owner] = await self.store.find(owner, principal)
                known = responses[owner]
                item = known.item(item_id) if known is not None else None
            model = _ITEM_MODELS.get(str(item.get("type"))) if item is not None else None
            if item is None or model is None:
                raise InvalidRequest(
                    f"Item with id '{item_id}' not found.", param=f"input[{index}]", code="item_not_found"
                )
            found[item_id] = convert(item, model, f"input[{index}]")
        return found

    def _store(
        self,
        call: ResponseCall,
        earlier: list[dict[str, Any]],
        items: Sequence[InputItem],
        referenced: Mapping[str, ResolvedItem],
        captured: Captured,
    ) -> ResponseRecord:
        """What is stored of a served create (as its call is, redacted), kept in memory for continuations.

        Its input items are those of the whole chain (`earlier`: what the responses it continues were given
        and answered), as OpenAI lists them."""
        ctx, shape = call.ctx, call.shape
        body = to_builtins(from_captured(shape, captured))
        input_items = [*earlier, *item_resources(items, referenced, ctx.call_id)]
        skip = 1 if shape.request.instructions is not None else 0
        conversation = [*ctx.body["messages"][skip:], captured_reply(captured)["message"]]
        redactor = self.chat.router.redactor(ctx.route.policy)
        if redactor is not None:
            body, input_items, conversation = redactor.value([body, input_items, conversation])
        self.store.remember(
            shape.id,
            KnownResponse(
                body,
                input_items,
                conversation,
                ctx.episode_id,
                ctx.episode_resolved,
                ctx.principal.project,
                durable=ctx.capture,
            ),
        )
        return ResponseRecord(
            id=shape.id,
            body=body,
            input_items=input_items,
            previous_response_id=shape.request.previous_response_id,
        )

    async def complete(self, call: ResponseCall) -> bytes:
        """A non-streamed create: the encoded `Response`, once the call is durably logged."""
        completion = await self.chat.answer(call.ctx)
        return encode(from_completion(call.shape, completion))

    async def stream(self, call: ResponseCall) -> AsyncIterator[bytes]:
        """Open the engine stream (errors raise here, before any byte is sent) and return the event relay.

        The call is recorded (and its response stored) before the terminal event is sent."""
        chunks = await self.chat.stream_chunks(call.ctx)
        events = ResponseEvents(call.shape)

        async def relay() -> AsyncIterator[bytes]:
            try:
                yield b"".join(encode_event(e) for e in events.start())
                async for batch in chunks:
                    fed = [event for chunk in batch for event in events.feed(chunk)]
                    if type(batch) is LastBatch:  # the call is recorded: the closing events go with these
                        closing, _ = events.finish()
                        yield b"".join([encode_event(e) for e in [*fed, *closing]])
                        return
                    if fed:
                        yield b"".join([encode_event(e) for e in fed])
            except APIError as exc:
                yield encode_event(events.fail(exc.message))
            finally:
                await chunks.aclose()  # on a client disconnect, records the partial reply

        return relay()
