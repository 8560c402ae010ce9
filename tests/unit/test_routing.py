"""`ModelRouter.resolve` for models that are not policies: what the engine lists is served, by its own name."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.engines.upstream import UpstreamEngine
from gateway.errors import InvalidRequest
from gateway.routing import ModelRouter
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
