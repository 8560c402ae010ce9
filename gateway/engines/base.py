"""The engine interface the gateway talks to: chat, streaming, model listing, adapters and health."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest, NotFound


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can return besides text; the gateway asks for whatever is available on every call."""

    logprobs: bool
    token_ids: bool
    adapters: bool
    # `tool_choice: {"type": "allowed_tools"}` understood; otherwise the gateway narrows `tools` itself.
    allowed_tools: bool = True
    # Logprobs of the prompt served safely. vLLM with LoRA enabled crashes its engine core when two requests
    # that need them share a batch, so the gateway refuses those requests for it.
    prompt_logprobs: bool = True


def refuse_prompt_logprobs(body: Mapping[str, Any], *, echo_needs_logprobs: bool) -> None:
    """A 400 for a request that makes vLLM compute the prompt's logprobs: its `prompt_logprobs` extra, or `echo`
    (on completions only with `logprobs`; on chat completions always, since vLLM then takes `top_logprobs`,
    default 0)."""
    if body.get("prompt_logprobs") is not None:
        raise InvalidRequest(
            "prompt_logprobs is not served by this engine: vLLM with LoRA adapters crashes computing them",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    if body.get("echo") and (not echo_needs_logprobs or body.get("logprobs") is not None):
        also = " with logprobs" if echo_needs_logprobs else ""
        raise InvalidRequest(
            f"echo{also} asks for the prompt's logprobs, which this engine cannot serve safely (vLLM with LoRA "
            "adapters crashes computing them)",
            param="echo",
            code="unsupported_parameter",
        )


class EngineStream(ABC):
    """An open streamed answer: iterate decoded chunks; `close` frees the engine's slot (client went away)."""

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[Any]: ...

    def ready(self) -> bool:
        """Whether the next chunk (or the stream's end) is already here, so reading it will not wait. The relay
        sends the chunks that arrived together in one write instead of one write each."""
        return False

    @abstractmethod
    async def close(self) -> None: ...


class Engine(ABC):
    name: str
    capabilities: EngineCapabilities
    #: Times the gateway restarted this engine after it died (a supervised vLLM); 0 for the others.
    restarts: int = 0

    async def start(self) -> None:
        """Acquire resources (connection pools, a supervised server process)."""

    async def close(self) -> None:
        """Release what `start` acquired."""

    @abstractmethod
    async def chat(self, body: dict[str, Any]) -> Any:
        """One non-streamed chat completion; returns the decoded JSON body."""

    @abstractmethod
    async def open_stream(self, body: dict[str, Any]) -> EngineStream:
        """Start a streamed completion. Errors before the first chunk raise, so they become proper HTTP errors."""

    @abstractmethod
    async def list_models(self) -> list[str]:
        """Model names the engine serves."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the engine answers; never raises."""

    async def relay(self, path: str, body: dict[str, Any]) -> Any:
        """One non-streamed call to another OpenAI route the engine serves (`/completions`, `/embeddings`)."""
        raise NotFound(f"the {self.name} engine does not serve {path}", code="unsupported_route")

    async def open_relay_stream(self, path: str, body: dict[str, Any]) -> EngineStream:
        """A streamed call to another OpenAI route (`/completions`); errors before the first chunk raise."""
        raise NotFound(f"the {self.name} engine does not serve {path}", code="unsupported_route")

    def snapshot(self) -> dict[str, Any]:
        """What operators see at `GET /admin/engine`: the engine and, where it has several, its replicas."""
        return {"engine": self.name}

    def loaded_adapters(self) -> list[str]:
        """Names of the adapters loaded right now (the router unloads the idle ones); none by default."""
        return []

    async def load_adapter(self, name: str, path: str) -> None:
        raise NotImplementedError(f"the {self.name} engine does not serve LoRA adapters")

    async def unload_adapter(self, name: str) -> None:
        raise NotImplementedError(f"the {self.name} engine does not serve LoRA adapters")
