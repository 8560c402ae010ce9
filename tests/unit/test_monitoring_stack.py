"""docker/compose.yaml's Prometheus and Grafana, checked for what a broken file would break: Prometheus scrapes
the gateway's port with the key compose gives both, Grafana finds its datasource and the dashboard, and the
dashboard's panels query that datasource. (Docker does not run here; what the dashboard's queries name is
checked against a real scrape in tests/integration/test_metrics.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (named volumes left out)."""
    found = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if source.startswith("."):
            found[target] = DOCKER / source
    return found


def test_prometheus_scrapes_every_gateway_with_the_metrics_key() -> None:
    compose = _load(DOCKER / "compose.yaml")
    services = compose["services"]
    gateway, prometheus = services["gateway"], services["prometheus"]
    key_variable = re.fullmatch(
        r"\$\{(KAIZEN_METRICS_KEY):\?.+\}", gateway["environment"]["KAIZEN_METRICS_KEY"]
    )
    assert key_variable is not None, "compose must refuse to start without a metrics key"
    config_path = _mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    config = _load(config_path)
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (discovery,) = job["dns_sd_configs"]
    assert discovery["names"] == ["gateway"] and discovery["type"] == "A"
    published = {int(p.split(":")[-1]) for p in gateway["ports"]}
    assert discovery["port"] in published  # the port `kaizen serve` listens on in the image
    assert job["authorization"]["type"] == "Bearer"
    targets = {c["target"]: c["source"] for c in prometheus["configs"]}
    key_config = compose["configs"][targets[job["authorization"]["credentials_file"]]]
    assert key_config["content"].startswith("${KAIZEN_METRICS_KEY")
    assert prometheus["depends_on"] == ["gateway"]
    # Prometheus and Grafana are for this host's operators only.
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    grafana = _load(DOCKER / "compose.yaml")["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = _load(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = _load(provisioning / "dashboards" / "kaizen.yaml")["providers"]
    dashboards = mounts[provider["options"]["path"]]
    files = sorted(dashboards.glob("*.json"))
    assert [f.name for f in files] == ["kaizen.json"]
    dashboard = json.loads(files[0].read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    queried = [p for p in panels if p["type"] != "row"]
    assert len(queried) >= 20
    for panel in queried:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]


def test_dashboard_panels_do_not_overlap() -> None:
    panels = json.loads((DOCKER / "grafana" / "dashboards" / "kaizen.json").read_text())["panels"]
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def grafana_panel() -> dict[str, Any]:
    """The dashboard docs/operations.md offers to import ("Grafana panel")."""
    guide = (DOCKER.parent / "docs" / "operations.md").read_text()
    block = re.search(r"### Grafana panel\n.*?```json\n(.*?)```", guide, re.S)
    assert block is not None, "docs/operations.md has no Grafana panel"
    loaded: dict[str, Any] = json.loads(block.group(1))
    return loaded


def test_the_documented_grafana_panel_imports_with_any_prometheus() -> None:
    dashboard = grafana_panel()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    (panel,) = dashboard["panels"]
    assert panel["repeat"] == "version" and "version" in variables and "policy" in variables
    assert panel["datasource"]["uid"] == "${datasource}"
    legends = set()
    for target in panel["targets"]:
        assert target["datasource"]["uid"] == "${datasource}"
        assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        assert 'policy="$policy"' in target["expr"], target["expr"]
        legends.add(target["legendFormat"])
    assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    # Each band fills down to a series the panel draws (a legend's {{label}} stands for any value).
    names = [re.compile(".+".join(map(re.escape, re.split(r"\{\{\w+\}\}", legend)))) for legend in legends]
    for override in panel["fieldConfig"]["overrides"]:
        for prop in override["properties"]:
            if prop["id"] == "custom.fillBelowTo":
                assert any(name.fullmatch(prop["value"]) for name in names), prop["value"]
