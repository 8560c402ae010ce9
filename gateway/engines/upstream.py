"""The `upstream` engine: any OpenAI-compatible API (capture-only mode: learn from traffic another model serves)."""

from __future__ import annotations

from typing import Any

from gateway.engines.base import Engine, EngineCapabilities, EngineStream
from gateway.engines.http import OpenAIHTTPClient
from gateway.settings import Settings


class UpstreamEngine(Engine):
    name = "upstream"

    def __init__(self, settings: Settings) -> None:
        self.capabilities = EngineCapabilities(
            logprobs=settings.upstream_logprobs, token_ids=settings.upstream_token_ids, adapters=False
        )
        self.client = OpenAIHTTPClient(
            settings.upstream_url,
            api_key=settings.upstream_api_key,
            timeout_s=settings.engine_timeout_s,
            connect_timeout_s=settings.engine_connect_timeout_s,
            max_connections=settings.engine_max_connections,
        )

    async def close(self) -> None:
        await self.client.close()

    async def chat(self, body: dict[str, Any]) -> Any:
        return await self.client.chat(body)

    async def open_stream(self, body: dict[str, Any]) -> EngineStream:
        return await self.client.open_stream(body)

    async def relay(self, path: str, body: dict[str, Any]) -> Any:
        return await self.client.request(path, body)

    async def open_relay_stream(self, path: str, body: dict[str, Any]) -> EngineStream:
        return await self.client.open_stream(body, path)

    async def list_models(self) -> list[str]:
        return await self.client.list_models()

    async def health(self) -> bool:
        try:
            await self.client.list_models()
        except Exception:
            return False
        return True
