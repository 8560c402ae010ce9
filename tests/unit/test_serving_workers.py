"""Serving workers without processes: how many `kaizen serve` runs by default, and how one scrape merges every
worker's exposition (per-process series labelled by worker, shared ones once)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.openmetrics.exposition import generate_latest

from gateway.metrics import merge_workers
from gateway.settings import Settings


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (3, 1), (6, 3), (16, 8), (64, 8)])
def test_the_default_is_half_the_usable_cores_between_one_and_eight(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(cores)))
    assert Settings.load(workers=0).serving_workers() == expected
    assert Settings.load(workers=5).serving_workers() == 5


def exposition(requests: int, engine_up: float) -> tuple[CollectorRegistry, str]:
    registry = CollectorRegistry()
    Counter("kaizen_requests", "calls", ["model"], registry=registry).labels("m").inc(requests)
    Gauge("kaizen_engine_up", "engine", registry=registry).set(engine_up)
    return registry, generate_latest(registry).decode()  # type: ignore[no-untyped-call]


def test_a_scrape_labels_each_workers_series_and_reports_shared_ones_once() -> None:
    own, _ = exposition(requests=3, engine_up=1.0)
    _, peer = exposition(requests=5, engine_up=0.0)  # a stale view of the shared engine: not reported
    families = {f.name: f for f in merge_workers(own.collect(), 0, {1: peer})}

    totals = {
        s.labels["worker"]: s.value for s in families["kaizen_requests"].samples if s.name.endswith("_total")
    }
    assert totals == {"0": 3.0, "1": 5.0}
    assert [(s.labels, s.value) for s in families["kaizen_engine_up"].samples] == [({}, 1.0)]


@pytest.mark.parametrize("accept", ["text/plain", "application/openmetrics-text; version=1.0.0"])
def test_the_merged_families_encode_in_both_formats(accept: str) -> None:
    from prometheus_client.exposition import choose_encoder

    from gateway.metrics import _Families

    own, _ = exposition(requests=3, engine_up=1.0)
    _, peer = exposition(requests=5, engine_up=1.0)
    encoder, _ = choose_encoder(accept)
    text = encoder(_Families(merge_workers(own.collect(), 0, {1: peer}))).decode()  # type: ignore[arg-type]
    assert 'kaizen_requests_total{model="m",worker="1"} 5.0' in text
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))  # one block per family, both workers' samples in it


def test_workers_refuse_a_port_that_another_server_holds() -> None:
    """`SO_REUSEPORT` would let two gateways share a port silently: a held port is an error, as for one worker."""
    import socket

    from gateway.workers import listening_sockets

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match="in use"):
            listening_sockets("127.0.0.1", held.getsockname()[1], 2)
    sockets = listening_sockets("127.0.0.1", 0, 2)
    assert len({s.getsockname() for s in sockets}) == 1  # two sockets, one port
    for sock in sockets:
        sock.close()
