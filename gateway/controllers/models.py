"""`GET /v1/models` and `GET /v1/models/{id}`."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.auth import principal_of, requires
from gateway.errors import NotFound
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
        names = [
            name
            for name in router.listed()
            if principal.may_use(name, None) and router.visible(name, principal)
        ]
        return ModelList([ModelCard(name, router.created, "kaizen") for name in names])

    @get("/{model_id:path}")
    async def retrieve(
        self, request: Request[Any, Any, Any], router: NamedDependency[ModelRouter], model_id: FromPath[str]
    ) -> ModelCard:
        """One model this key may call: a base model, a policy, or a pinned version `policy@N`. Ids may hold
        a `/` (hub ids such as `org/model`), so the rest of the path is the id."""
        name = model_id.lstrip("/")
        route = router.resolve(name)  # 404 model_not_found for what does not exist
        principal = router.admit(name, route, principal_of(request))  # and for another project's policy
        if not principal.may_use(name, route.policy):
            # As for a model that does not exist: a key learns nothing about models it may not use.
            raise NotFound(
                f"The model `{name}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return ModelCard(name, router.created, "kaizen")
