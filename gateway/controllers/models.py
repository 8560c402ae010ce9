"""`GET /v1/models`."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency

from gateway.auth import principal_of, requires
from gateway.protocol import ModelCard, ModelList
from gateway.routing import ModelRouter


class ModelsController(Controller):
    path = "/models"
    guards = [requires("chat")]  # noqa: RUF012

    @get("")
    async def list_models(
        self, request: Request[Any, Any, Any], router: NamedDependency[ModelRouter]
    ) -> ModelList:
        """The models and policies this key may call."""
        principal = principal_of(request)
        names = [name for name in router.listed() if principal.may_use(name, None)]
        return ModelList([ModelCard(name, router.created, "kaizen") for name in names])
