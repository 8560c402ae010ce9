"""`POST /v1/responses`, `GET /v1/responses/{id}` (and its input items) and `DELETE /v1/responses/{id}`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, Parameter
from litestar.response import Stream

from gateway.auth import principal_of, requires
from gateway.controllers.chat import call_headers, unless_disconnected
from gateway.controllers.params import PathName
from gateway.errors import APIError, NotFound
from gateway.rate_limits import SPENDS_TOKENS, token_meter
from gateway.responses.protocol import ResponseDeleted, ResponseItemList
from gateway.responses.service import ResponsesService
from gateway.responses.store import KnownResponse

ItemLimit = Annotated[int, Parameter(ge=1, le=100)]
ItemId = Annotated[str, Parameter(max_length=256)]


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found"
    )


class ResponsesController(Controller):
    """Stored responses are confined to the key's project: another project's is answered 404."""

    path = "/responses"
    guards = [requires("chat")]  # noqa: RUF012

    @post("", status_code=200, opt={SPENDS_TOKENS: True})
    async def create(
        self, request: Request[Any, Any, Any], responses: NamedDependency[ResponsesService]
    ) -> Response[bytes] | Stream:
        call = await responses.prepare(await request.body(), request.headers, principal_of(request))
        call.ctx.charge_tokens = token_meter(request.scope)
        # As a chat completion's: feedback takes x-request-id or the response id.
        headers = call_headers(call.ctx)
        try:
            if call.stream:
                relay = await responses.stream(call)
                return Stream(
                    relay, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
                )
            reply = await unless_disconnected(responses.complete(call), request.receive)
            return Response(reply, media_type="application/json", headers=headers)
        except APIError as exc:  # the call was recorded: its error answer carries its ids too
            exc.headers.update(headers)
            raise

    async def _find(
        self, request: Request[Any, Any, Any], responses: ResponsesService, response_id: str
    ) -> KnownResponse:
        found = await responses.store.read(response_id, principal_of(request))
        if found is None:
            raise _not_found(response_id)
        return found

    @get("/{response_id:str}")
    async def read(
        self,
        request: Request[Any, Any, Any],
        response_id: FromPath[PathName],
        responses: NamedDependency[ResponsesService],
    ) -> dict[str, Any]:
        return (await self._find(request, responses, response_id)).body

    @get("/{response_id:str}/input_items")
    async def input_items(
        self,
        request: Request[Any, Any, Any],
        response_id: FromPath[PathName],
        responses: NamedDependency[ResponsesService],
        limit: FromQuery[ItemLimit] = 20,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
        after: FromQuery[ItemId | None] = None,
    ) -> ResponseItemList:
        """The input items of the response, newest first unless `order=asc`, paged by `after` (an item id)."""
        items = (await self._find(request, responses, response_id)).input_items
        ordered = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item.get("id") for item in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        page = ordered[:limit]
        return ResponseItemList(
            data=page,
            first_id=page[0]["id"] if page else "",
            last_id=page[-1]["id"] if page else "",
            has_more=len(ordered) > limit,
        )

    @delete("/{response_id:str}", status_code=200)
    async def remove(
        self,
        request: Request[Any, Any, Any],
        response_id: FromPath[PathName],
        responses: NamedDependency[ResponsesService],
    ) -> ResponseDeleted:
        """Delete the stored response; its call stays captured (and trainable) like any other."""
        if not await responses.store.delete(response_id, principal_of(request)):
            raise _not_found(response_id)
        return ResponseDeleted(response_id)
