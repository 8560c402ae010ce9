"""`GET /v1/models`."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency

from gateway.protocol import ModelCard, ModelList
from gateway.routing import ModelRouter


class ModelsController(Controller):
    path = "/models"

    @get("")
    async def list_models(self, router: NamedDependency[ModelRouter]) -> ModelList:
        return ModelList([ModelCard(name, router.created, "kaizen") for name in router.listed()])
