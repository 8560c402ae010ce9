"""A scripted OpenAI-compatible judge for RULER tests: records every request and answers as told.

Queued replies (`script`) are used first, one per request: a string is returned as the message content, an
int as that HTTP error status. With nothing queued the judge scores each `<trajectory id="tN">` block of the
prompt 0.9 if it contains "good", else 0.1, and fails with 500 when the prompt contains "FAILJUDGE".

`POST /score` is a scoring webhook: it records the raw body and headers and answers from `webhook_script`
(an int is an HTTP status), else `{"score": 0.7, "explanation": "webhook"}`.

With `redirect_to` set, both routes record the request and answer `307` to that URL instead (a redirect that
keeps the method and the body).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections import deque
from typing import Any

from aiohttp import web

_BLOCK = re.compile(r'<trajectory id="(t\d+)">\n(.*?)\n</trajectory>', re.S)


def default_answer(prompt: str) -> str:
    scores = [
        {
            "trajectory_id": tid,
            "explanation": f"{tid} is {'good' if 'good' in body else 'poor'}",
            "score": 0.9 if "good" in body else 0.1,
        }
        for tid, body in _BLOCK.findall(prompt)
    ]
    return json.dumps({"scores": scores})


class ScriptedJudge:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.script: deque[str | int] = deque()
        self.webhook_calls: list[tuple[bytes, dict[str, str]]] = []
        self.webhook_script: deque[int] = deque()
        self.redirect_to: str | None = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def prompts(self) -> list[str]:
        return [r["messages"][-1]["content"] for r in self.requests]

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.redirect_to is not None:
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        prompt = body["messages"][-1]["content"]
        reply: str | int = self.script.popleft() if self.script else default_answer(prompt)
        if "FAILJUDGE" in prompt:
            reply = 500
        if isinstance(reply, int):
            return web.json_response(
                {"error": {"message": "scripted failure", "type": "server_error"}}, status=reply
            )
        return web.json_response(
            {
                "id": f"judge-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )

    async def _score(self, request: web.Request) -> web.Response:
        self.webhook_calls.append((await request.read(), dict(request.headers)))
        if self.redirect_to is not None:
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        if self.webhook_script:
            return web.json_response({"error": "scripted"}, status=self.webhook_script.popleft())
        return web.json_response({"score": 0.7, "explanation": "webhook"})

    def __enter__(self) -> ScriptedJudge:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/score", self._score)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        self._loop, self._runner = loop, runner
        self._thread = threading.Thread(target=loop.run_forever, name="scripted-judge", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        assert self._loop is not None and self._runner is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
