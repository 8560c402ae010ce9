"""`POST /v1/feedback`: one item or a batch; signed (webhook secret) or API-key authenticated."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency

from gateway.feedback import FeedbackResult, FeedbackService


class FeedbackController(Controller):
    # Not under the /v1 router's key guard: with a webhook secret the signature replaces the API key, and
    # checking it needs the raw body.
    path = "/v1/feedback"

    @post("", status_code=200)
    async def submit(
        self, request: Request[Any, Any, Any], feedback: NamedDependency[FeedbackService]
    ) -> Response[FeedbackResult]:
        body = await request.body()
        principal, signature = feedback.authenticate(request.headers, body)
        return Response(await feedback.submit(body, signature, principal))
