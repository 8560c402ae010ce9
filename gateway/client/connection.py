"""Where a gateway is and which keys to use, and the HTTP requests the client makes to it.

Everything goes over HTTP to the gateway's public routes (`/v1/...`) and admin routes (`/admin/...`), so the
same code works against `kaizen serve` on this machine or a remote one: only the base URL and keys differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from gateway.signing import HEADER, sign


class KaizenError(RuntimeError):
    """The gateway refused a request: its HTTP status and OpenAI-shaped error (`code`, `param`, `message`)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(f"{status} {code or 'error'}: {message}")
        self.status = status
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True)
class Connection:
    """A gateway's base URL (with or without `/v1`) and the keys the client sends.

    `api_key` is a client key (scopes chat, feedback, read), `admin_key` one with the admin scope (training,
    judging, runs). With `feedback_secret`, rewards are sent signed like a feedback webhook instead.
    """

    base_url: str
    api_key: str | None = None
    admin_key: str | None = None
    feedback_secret: str | None = None
    timeout_s: float = 120.0

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def openai_base_url(self) -> str:
        return self.root + "/v1"

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def request(
        self, method: str, path: str, *, body: Any = None, admin: bool = False, signed: bool = False
    ) -> Any:
        """One request; the decoded JSON answer, or `KaizenError` for a 4xx/5xx."""
        headers = self._headers(self.admin_key if admin else self.api_key)
        content = None
        if body is not None:
            content = msgspec.json.encode(body)
            headers["Content-Type"] = "application/json"
            if signed and self.feedback_secret:
                headers = {"Content-Type": "application/json", HEADER: sign(self.feedback_secret, content)}
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            response = await client.request(method, self.root + path, content=content, headers=headers)
        if response.status_code >= 400:
            raise _error(response)
        return response.json() if response.content else None


def _error(response: httpx.Response) -> KaizenError:
    try:
        error = response.json()["error"]
        return KaizenError(
            response.status_code, str(error.get("message")), error.get("code"), error.get("param")
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return KaizenError(response.status_code, response.text[:500])
