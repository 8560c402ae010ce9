"""The dashboard's writes, as JSON fetches from its pages: log in and out, and label an episode or a call
(through the feedback service). Promote, roll back, pause and resume are the admin API's own handlers
(`gateway.controllers.policy_actions`), registered again under /dashboard by `dashboard_routers`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import KeyRing, LoginThrottle, client_address, counted_lookup, digest, principal_of
from gateway.dashboard.sessions import SessionSigner, session_of
from gateway.errors import AuthenticationError, InvalidRequest, PermissionDenied
from gateway.feedback import FeedbackResult, FeedbackService, Id
from storage.logouts import record_logout

LABEL_NAME = "dashboard"
"""The reward name of a label given in the dashboard (its source is `feedback`, as for any person's rating)."""


class Login(msgspec.Struct, forbid_unknown_fields=True):
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    next: Annotated[str, msgspec.Meta(max_length=2048)] = "/dashboard"


class LoggedIn(msgspec.Struct):
    next: str
    actor: str


class Label(msgspec.Struct, forbid_unknown_fields=True):
    """A person's rating of an episode or of one call: thumbs (true/false) or a score, and a comment."""

    value: bool | float
    episode_id: Id | None = None
    request_id: Id | None = None
    comment: Annotated[str, msgspec.Meta(max_length=10_000)] | None = None


def safe_next(target: str) -> str:
    """Where to go after logging in: a dashboard path of this site, never another site."""
    if target.startswith("/dashboard") and not target.startswith("//") and "\\" not in target:
        return target
    return "/dashboard"


class DashboardLogin(Controller):
    """The one dashboard write without a session: exchanging a key for one (the login page posts here)."""

    path = "/dashboard/session"

    @post("", status_code=200)
    async def login(
        self, data: JSONBody[Login], keys: NamedDependency[KeyRing], request: Request[Any, Any, Any]
    ) -> Response[LoggedIn]:
        """Log in with the admin key or a managed key with the `admin` scope; answers with the session cookie.
        An address that failed too often is refused for a while, whatever key it sends."""
        throttle: LoginThrottle = request.app.state.login_throttle
        address = client_address(request)
        principal = counted_lookup(keys, throttle, address, f"Bearer {data.key}")
        if principal is None:
            raise AuthenticationError("Unknown or revoked key.", code="invalid_api_key")
        if "admin" not in principal.scopes:
            throttle.failed(address)
            raise PermissionDenied(
                "This key lacks the `admin` scope the dashboard needs.", code="insufficient_scope"
            )
        throttle.succeeded(address)
        signer: SessionSigner = request.app.state.dashboard_signer
        response = Response(LoggedIn(safe_next(data.next), principal.actor))
        response.set_cookie(signer.cookie(signer.issue(digest(data.key))))
        return response


class DashboardActions(Controller):
    """Writes of a logged-in session (the router they are registered on checks it, and its CSRF token)."""

    path = "/"

    @post("/logout", status_code=200)
    async def logout(
        self,
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        keys: NamedDependency[KeyRing],
    ) -> Response[dict[str, str]]:
        """End the session everywhere: the cookie is cleared, and a copy of it is refused by every gateway
        (at once by this one, by the others at their next key refresh)."""
        current = session_of(request)
        await record_logout(session, current.nonce, datetime.fromtimestamp(current.expires, UTC))
        keys.end_session(current.nonce, current.expires)
        signer: SessionSigner = request.app.state.dashboard_signer
        response = Response({"next": "/dashboard/login"})
        response.set_cookie(signer.cleared_cookie())
        return response

    @post("/feedback", status_code=200)
    async def label(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[Label],
        feedback: NamedDependency[FeedbackService],
    ) -> FeedbackResult:
        """Store a label as feedback (source `feedback`, name `dashboard`), like any other rating."""
        if (data.episode_id is None) == (data.request_id is None):
            raise InvalidRequest(
                "give exactly one of episode_id and request_id", param="episode_id", code="invalid_target"
            )
        principal = principal_of(request)
        item: dict[str, Any] = {
            "value": data.value,
            "name": LABEL_NAME,
            "metadata": {"labelled_by": principal.actor, "via": "dashboard"},
        }
        if data.comment:
            item["comment"] = data.comment
        if data.episode_id is not None:
            item["episode_id"] = data.episode_id
        else:
            item["request_id"] = data.request_id
        return await feedback.submit(msgspec.json.encode(item), None, principal)
