"""openai-node in a real browser (Chromium), on a page of another origin that `KAIZEN_CORS_ORIGINS` allows.

The SDK is the one the Node client matrix pins (`tests/clients/node`), loaded as ES modules by the page, with
`dangerouslyAllowBrowser`: every request it makes carries its `x-stainless-*` headers, so the browser sends a
CORS preflight that must allow them, and the answer's headers the SDK reads must be exposed."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.conftest import query
from tests.integration.test_dashboard_browser import chromium
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]
NODE_MODULES = Path(__file__).resolve().parents[1] / "clients" / "node" / "node_modules"
KEY = "browser-key"

PAGE = """<!doctype html>
<script type="module">
import OpenAI from "/openai/index.mjs";
const client = new OpenAI({baseURL: GATEWAY, apiKey: KEY, dangerouslyAllowBrowser: true, maxRetries: 0});
try {
  const chat = await client.chat.completions
    .create({model: "scripted-1", messages: [{role: "user", content: "hello from a page"}]})
    .withResponse();
  let streamed = "";
  for await (const chunk of await client.chat.completions.create(
      {model: "scripted-1", messages: [{role: "user", content: "stream to a page"}], stream: true})) {
    streamed += chunk.choices[0]?.delta?.content ?? "";
  }
  const response = await client.responses.create({model: "scripted-1", input: "hello again"});
  const deleted = await client.responses.delete(response.id);
  window.outcome = {
    content: chat.data.choices[0].message.content,
    requestId: chat.response.headers.get("x-request-id"),
    streamed,
    responseText: response.output_text,
    deleted,
  };
} catch (error) {
  window.outcome = {error: String(error)};
}
</script>
"""


class _Site(SimpleHTTPRequestHandler):
    """The app's own origin: the page, and the SDK's modules under /openai/."""

    extensions_map: ClassVar[dict[str, str]] = {
        **SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
    }
    page: ClassVar[bytes] = b""

    def do_GET(self) -> None:
        if self.path == "/":
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(self.page)))
            self.end_headers()
            self.wfile.write(self.page)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def site() -> Iterator[tuple[str, type[_Site]]]:
    handler = type("Site", (_Site,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(NODE_MODULES)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", handler
    server.shutdown()
    server.server_close()


def test_openai_node_in_a_browser_calls_a_gateway_that_allows_its_origin(
    make_gateway: MakeGateway, tmp_path: Path, site: tuple[str, type[_Site]]
) -> None:
    if not (NODE_MODULES / "openai" / "index.mjs").exists():
        pytest.fail("openai-node is not installed: run `make install-clients`")
    origin, handler = site
    url = f"sqlite:///{tmp_path / 'browser.db'}"
    gw = make_gateway(url, api_keys=[KEY], cors_origins=[origin])
    # The page is served from 127.0.0.1 on another port, and calls the gateway as `localhost`: another origin.
    gateway = gw.url.replace("127.0.0.1", "localhost") + "/v1"
    handler.page = PAGE.replace("GATEWAY", json.dumps(gateway)).replace("KEY", json.dumps(KEY)).encode()
    with chromium() as browser:
        page = browser.new_page()
        page.goto(origin + "/")
        page.wait_for_function("window.outcome !== undefined")
        outcome = page.evaluate("window.outcome")
    assert "error" not in outcome, outcome
    assert outcome["content"] == "echo: hello from a page"
    assert outcome["streamed"] == "echo: stream to a page"
    assert outcome["responseText"] == "echo: hello again"
    assert outcome["deleted"]["deleted"] is True  # a DELETE, which needs its own preflight, went through
    gw.flush()
    [first] = query(url, "SELECT id FROM calls ORDER BY created_at LIMIT 1")
    assert outcome["requestId"] == first["id"]  # an exposed header: the page can send feedback on the call
    assert query(url, "SELECT count(*) AS n FROM calls")[0]["n"] == 3
