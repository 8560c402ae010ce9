"""The web dashboard served by the gateway at /dashboard: pages rendered on the server from Jinja2 templates,
one small script and one stylesheet of our own (no CDN, no build step), charts as inline SVG.

Everything but the login form and the static assets needs a session of a key with the `admin` scope
(`gateway.dashboard.sessions`). Nothing here runs on the chat path: the routes only add entries to the app's
route table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Request, Response, Router, get
from litestar.datastructures import ResponseHeader
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.params import FromPath
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.template.config import TemplateConfig

from gateway.controllers.params import PathName
from gateway.controllers.policy_actions import PolicyActions
from gateway.dashboard.actions import DashboardActions, DashboardLogin
from gateway.dashboard.formatting import FILTERS
from gateway.dashboard.pages import DashboardPages, LoginPage
from gateway.dashboard.sessions import LoginRequired, SessionSigner, requires_login
from gateway.errors import APIError, NotFound
from gateway.keyfile import generated_key
from gateway.settings import Settings

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
MEDIA_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
# Only our own script and stylesheet; inline SVG needs no exception. No framing, no referrer (URLs hold ids).
SECURITY_HEADERS = [
    ResponseHeader(
        name="content-security-policy",
        value="default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ResponseHeader(name="x-frame-options", value="DENY"),
    ResponseHeader(name="x-content-type-options", value="nosniff"),
    ResponseHeader(name="referrer-policy", value="no-referrer"),
    ResponseHeader(name="cache-control", value="no-store"),
]


ASSETS: dict[str, tuple[bytes, str]] = {
    path.name: (path.read_bytes(), MEDIA_TYPES[path.suffix]) for path in sorted((HERE / "static").iterdir())
}
"""The static assets, read once: a request can only name one of these (no file system lookup per request)."""


@get("/dashboard/static/{name:str}", include_in_schema=False)
async def static_asset(name: FromPath[PathName]) -> Response[bytes]:
    """The dashboard's own script and stylesheet (public: they hold no data and no secret)."""
    asset = ASSETS.get(name)
    if asset is None:
        raise NotFound(f"no asset {name!r}", code="not_found")
    content, media_type = asset
    return Response(content, media_type=media_type, headers={"cache-control": "public, max-age=300"})


def dashboard_state(settings: Settings) -> dict[str, Any]:
    """What the dashboard keeps in the app's state: the session signer."""

    def secret() -> bytes:
        return settings.dashboard_secret.encode() or generated_key(settings.data_dir / "dashboard.key")

    return {
        "dashboard_signer": SessionSigner(
            secret, settings.dashboard_session_ttl_s, secure=settings.dashboard_secure_cookie
        ),
    }


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    environment = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(FILTERS)
    return TemplateConfig(instance=JinjaTemplateEngine.from_environment(environment))


def _page_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Errors on pages are pages too: a login redirect, or the status with a short explanation."""
    if isinstance(exc, LoginRequired):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return Redirect(f"/dashboard/login?{urlencode({'next': target})}", status_code=303)
    if isinstance(exc, APIError):
        status, message = exc.status_code, exc.message
    elif isinstance(exc, NotFoundException):
        status, message = 404, "Not found."
    elif isinstance(exc, ValidationException):
        status, message = 400, str(exc.detail)
    elif isinstance(exc, HTTPException):
        status, message = exc.status_code, str(exc.detail)
    else:  # pragma: no cover (only the exception types registered below reach here)
        raise exc
    if status >= 500:
        log.error("error on %s: %s", request.url.path, message, exc_info=exc)
    return Template(
        "error.html.j2", context={"page": "error", "status": status, "message": message}, status_code=status
    )


def dashboard_routers() -> list[Router]:
    """The dashboard's routes: pages, login and actions under /dashboard, and its static assets."""
    pages = Router(
        path="/",
        route_handlers=[LoginPage, DashboardPages],
        exception_handlers={LoginRequired: _page_error, APIError: _page_error, HTTPException: _page_error},
        response_headers=SECURITY_HEADERS,
    )
    login = Router(path="/", route_handlers=[DashboardLogin], response_headers=SECURITY_HEADERS)
    # The policy actions are the admin API's handlers, here behind a session instead of an admin key.
    actions = Router(
        path="/dashboard",
        route_handlers=[DashboardActions, PolicyActions],
        guards=[requires_login(page=False)],
        response_headers=SECURITY_HEADERS,
    )
    static = Router(path="/", route_handlers=[static_asset], response_headers=SECURITY_HEADERS[:3])
    return [pages, login, actions, static]
