"""`ModelRouter.resolve` for models that are not policies: what the engine lists is served, by its own name; and
`ModelRouter.admit`: who may call a policy a project owns."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import CLIENT_SCOPES, Principal
from gateway.engines.upstream import UpstreamEngine
from gateway.errors import InvalidRequest, NotFound
from gateway.routing import ModelRouter, Route
from gateway.settings import Settings
from storage.models import POLICY_NAME_LENGTH


def test_an_engine_model_whose_name_cannot_be_stored_is_refused(tmp_path: Path) -> None:
    # Calls of a plain model are stored with its name as their policy, a bounded text column: an engine attached
    # with a long served name (a path, say) would have every answered call dropped by the writer.
    settings = Settings.load(data_dir=tmp_path, engine="upstream", upstream_url="http://127.0.0.1:9/v1")
    router = ModelRouter(UpstreamEngine(settings), 60.0)
    fits, too_long = "m" * POLICY_NAME_LENGTH, "m" * (POLICY_NAME_LENGTH + 1)
    router.engine_models = {fits, too_long, "with\u0000nul"}
    assert router.resolve(fits).policy == fits
    for name in (too_long, "with\u0000nul"):
        with pytest.raises(InvalidRequest) as refused:
            router.resolve(name)
        assert (refused.value.param, refused.value.code) == ("model", "invalid_value")


def test_an_owned_policy_admits_its_project_and_admin_keys_at_every_version(tmp_path: Path) -> None:
    settings = Settings.load(data_dir=tmp_path, engine="upstream", upstream_url="http://127.0.0.1:9/v1")
    router = ModelRouter(UpstreamEngine(settings), 60.0)
    router.owners = {"bot": "shop"}
    shop = Principal("key_1", "shop-app", CLIENT_SCOPES, "shop")
    other = Principal("key_2", "ops-app", CLIENT_SCOPES, "ops")
    admin = Principal("admin-key", "admin-key", frozenset({"chat", "admin"}), "default", all_projects=True)
    for model, route in (
        ("bot", Route("bot@2", "bot", 2, "/a/2")),
        ("bot@1", Route("bot@1", "bot", 1, "/a/1")),
    ):
        assert router.admit(model, route, shop) is shop
        with pytest.raises(NotFound) as refused:
            router.admit(model, route, other)
        assert (refused.value.code, str(refused.value.message)) == (
            "model_not_found",
            f"The model `{model}` does not exist or you do not have access to it.",
        )
        assert router.admit(model, route, admin).project == "shop"  # recorded under the owner
    shared = Route("base", "base", None)
    assert router.admit("base", shared, other) is other
    assert [router.visible(name, other) for name in ("bot", "base")] == [False, True]
    assert router.visible("bot", admin) and router.visible("bot", shop)
