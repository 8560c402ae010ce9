"""`GatewayProcess` (used by `kaizen demo` and the resampling benchmark): a real `kaizen serve` child process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from gateway.commands.serve_process import GatewayProcess
from tests.support.scripted_upstream import ScriptedUpstream

# A `kaizen serve` child started and stopped: `make test-fast` leaves it out.
pytestmark = pytest.mark.slow


def test_child_gateway_starts_creates_a_policy_once_and_stops(
    tmp_path: Path, upstream: ScriptedUpstream, embedded_model: Path
) -> None:
    gateway = GatewayProcess(
        tmp_path,
        str(embedded_model),
        tmp_path / "gateway.log",
        {"KAIZEN_ENGINE": "upstream", "KAIZEN_UPSTREAM_URL": upstream.url, "KAIZEN_SCHEDULER": "false"},
    )
    gateway.start()
    try:
        asyncio.run(gateway.wait_ready(timeout_s=120))
        asyncio.run(gateway.create_policy("bot", {"train": {"group_size": 4}}))
        with pytest.raises(RuntimeError, match=r"creating policy 'bot' failed: 400 .*policy_exists"):
            asyncio.run(gateway.create_policy("bot"))
        listed = httpx.get(
            f"{gateway.url}/admin/policies", headers={"Authorization": f"Bearer {gateway.admin_key}"}
        )
        [policy] = listed.json()
        assert (policy["name"], policy["active_version"]) == ("bot", 0)
        assert policy["config"]["train"]["group_size"] == 4
        # Named by no project and not shared: the creating key's, the admin key's built-in project.
        assert (policy["project"], policy["shared"]) == ("default", False)
        # The creation is an admin change like any other: audited once (the refused second one is not).
        audit = httpx.get(
            f"{gateway.url}/admin/audit",
            params={"target": "bot"},
            headers={"Authorization": f"Bearer {gateway.admin_key}"},
        ).json()
        assert [
            (e["action"], e["actor"], e["details"]["config"], e["details"]["project"]) for e in audit
        ] == [("policy.create", "admin-key", {"train": {"group_size": 4}}, "default")]
        assert httpx.get(f"{gateway.url}/admin/policies").status_code == 401
    finally:
        gateway.stop()
    assert gateway.process is not None and gateway.process.returncode is not None
    assert (tmp_path / "kaizen.db").exists()
