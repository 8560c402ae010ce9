"""`GatewayProcess` (used by `kaizen demo` and the resampling benchmark): a real `kaizen serve` child process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.commands.serve_process import GatewayProcess
from tests.support.polling import wait_until
from tests.support.proc_stats import processes_with
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.stopping import kill_what_is_left

# A `kaizen serve` child started and stopped: `make test-fast` leaves it out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

#: What `kaizen demo` does, then waits: its gateway ready, the gateway's pid in `<data dir>/pid`.
_CALLER = """
import asyncio, sys, time
from pathlib import Path
from gateway.commands.serve_process import GatewayProcess

data = Path(sys.argv[1])
gateway = GatewayProcess(
    data, sys.argv[2], data / "gateway.log",
    {"KAIZEN_ENGINE": "upstream", "KAIZEN_UPSTREAM_URL": sys.argv[3], "KAIZEN_SCHEDULER": "false"},
)
gateway.start()
asyncio.run(gateway.wait_ready(timeout_s=120))
(data / "pid").write_text(str(gateway.process.pid))
time.sleep(600)
"""


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


def test_a_sigkilled_caller_takes_its_gateway_with_it(
    tmp_path: Path, upstream: ScriptedUpstream, embedded_model: Path
) -> None:
    """A SIGKILLed `kaizen demo` (or benchmark) leaves no `kaizen serve` behind holding its port, its engine and
    its capture writer: the gateway gets SIGTERM from Linux and stops as it does on any SIGTERM."""
    marker = f"KAIZEN_DATA_DIR={tmp_path}"
    caller = subprocess.Popen(
        [sys.executable, "-c", _CALLER, str(tmp_path), str(embedded_model), upstream.url],
        cwd=REPO,
        env={**os.environ, "KAIZEN_DATA_DIR": str(tmp_path)},
    )
    try:
        wait_until(
            lambda: (tmp_path / "pid").exists() or caller.poll() is not None, "the gateway", timeout_s=120
        )
        assert caller.poll() is None
        assert processes_with(marker)
        caller.kill()
        caller.wait()
        wait_until(lambda: not processes_with(marker), "the gateway and its children to exit", timeout_s=60)
        assert "Application shutdown complete" in (tmp_path / "gateway.log").read_text()
    finally:
        kill_what_is_left(caller, marker)
