"""Prometheus metrics of a gateway process, served at `/metrics`.

Where each number comes from decides how it is collected:

- **Counted here, on the request path**: chat calls by requested model, served model (`policy@N`) and outcome,
  latency and time-to-first-token histograms, tokens in and out, refused requests, feedback items received.
  Each replica counts its own calls; sum them across replicas. The cost per call is a dictionary lookup and a
  few locked increments (the label children are cached), measured in docs/performance.md.
- **Read when scraped, from this process**: the capture counters (`CaptureStats`, the same numbers as
  `/admin/capture`), the engine's health and restarts, the adapters loaded, the versions this replica serves
  and the calls in flight.
- **Read when scraped, from the database**, because other processes write them (a training child, a worker, a
  scheduler on another replica): the active version of each policy, stored rewards by source and status,
  judge groups with their calls and cost, job runs by status with their durations, the live reward per version,
  the time from reward to serving, and rollouts (canaries, splits, shadows). Every replica reports the
  same values (aggregate them with `max`, not `sum`); they are re-read at most every
  `KAIZEN_METRICS_DB_INTERVAL_S`, so scrapes cost the database one round of grouped queries per interval.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.auth import KeyRing
from gateway.capture.sink import CaptureSink
from gateway.engines.base import Engine
from gateway.peers import PeerLink
from gateway.routing import ModelRouter
from gateway.settings import Settings
from storage.database import Database
from storage.learning_latency import LatencyKey, LearningLatency
from storage.monitoring import LIVE_REWARD_WINDOW, StoreCounts, store_counts

if TYPE_CHECKING:  # the tap is built on the chat service, which counts calls here
    from gateway.shadow import ShadowTap

log = logging.getLogger(__name__)

# Seconds. Chat calls range from a cached few milliseconds to minutes of generation on a CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class _CallSeries:
    """The label children one kind of call increments, looked up once per label combination."""

    requests: Counter
    latency: Histogram
    ttft: Histogram
    input_tokens: Counter
    output_tokens: Counter


class CallMetrics:
    """What the request path counts. `call` is the only method the hot path runs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kaizen_requests",
            "Chat completions answered, by requested model, served model (policy@N) and outcome "
            "(ok, error, client_disconnected).",
            ["model", "served", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "kaizen_request_duration_seconds",
            "Chat completion latency to the last byte, by requested model and whether it was streamed.",
            ["model", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "kaizen_time_to_first_token_seconds",
            "Time from the request to the first content of a streamed reply, by requested model.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "kaizen_tokens",
            "Tokens of chat completions as the engine counted them: type input (prompt) or output (completion).",
            ["model", "type"],
            registry=registry,
        )
        self.rejected = Counter(
            "kaizen_requests_rejected",
            "Chat requests refused before reaching the engine (bad input, unknown model, a model the key may "
            "not use, shutting down), by error code.",
            ["code"],
            registry=registry,
        )
        self.feedback = Counter(
            "kaizen_feedback_items",
            "Feedback items this gateway accepted, by status at receipt: linked (its target was stored), "
            "pending (not yet), duplicate (an idempotency key seen before; nothing written).",
            ["status"],
            registry=registry,
        )
        self.answered = Counter(
            "kaizen_http_requests",
            "HTTP requests answered on every route, by route (its template, e.g. /v1/episodes/{episode_id}), "
            "method and status code: refusals before the handler (429 from the rate limiter, 415, 401) "
            "included; requests that match no route are not counted.",
            ["route", "method", "status"],
            registry=registry,
        )
        self._series: dict[tuple[str, str, str, bool], _CallSeries] = {}
        self._answered: dict[tuple[str, str, int], Counter] = {}

    def call(
        self,
        model: str,
        served: str,
        status: str,
        stream: bool,
        latency_s: float,
        ttft_s: float | None,
        input_tokens: int,
        output_tokens: int,
    ) -> None:
        key = (model, served, status, stream)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _CallSeries(
                self.requests.labels(model, served, status),
                self.latency.labels(model, "true" if stream else "false"),
                self.ttft.labels(model),
                self.tokens.labels(model, "input"),
                self.tokens.labels(model, "output"),
            )
        series.requests.inc()
        series.latency.observe(latency_s)
        if ttft_s is not None:
            series.ttft.observe(ttft_s)
        if input_tokens:
            series.input_tokens.inc(input_tokens)
        if output_tokens:
            series.output_tokens.inc(output_tokens)

    def answer(self, route: str, method: str, status: int) -> None:
        """One HTTP response started. Routes, methods and statuses are few, so the children are cached."""
        key = (route, method, status)
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.answered.labels(route, method, str(status))
        child.inc()

    def reject(self, code: str | None) -> None:
        self.rejected.labels(code or "unknown").inc()

    def feedback_items(self, statuses: Iterable[str]) -> None:
        for status in statuses:
            self.feedback.labels(status).inc()


def count_responses(metrics: CallMetrics) -> Callable[[ASGIApp], ASGIApp]:
    """App-wide ASGI middleware: counts each response by route template, method and status when it starts.
    It runs outside every other middleware, so what they answer themselves (the rate limiter's 429, the 415 of
    a body that is not JSON) is counted too; its cost per request is one wrapped `send` and a cached
    counter's increment (docs/performance.md)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            route, method = scope["path_template"], scope["method"]

            async def counted(message: Message) -> None:
                if message["type"] == "http.response.start":
                    metrics.answer(route, method, message["status"])
                await send(message)

            await app(scope, receive, counted)

        return middleware

    return wrap


# Which CaptureStats/snapshot fields are counters (only ever grow) and which are levels.
_CAPTURE_COUNTERS = {
    "queued": "Captured calls appended to the capture log (or handed to the writer in memory).",
    "written": "Captured calls the writer stored on its first try.",
    "spooled": "Captured calls held in the capture log while the database was down.",
    "replayed": "Held captured calls stored once the database answered again.",
    "recovered": "Captured calls left in the capture log by an earlier process, stored at start-up.",
    "dropped": "Captured calls lost: not logged and not handed to a writer, refused by the database as invalid, "
    "or an unreadable log line.",
    "log_failures": "Captured calls that could not be appended to the capture log (held in memory instead).",
    "refused": "Answered calls refused with 503 because the capture log could not take them "
    "(KAIZEN_CAPTURE_REQUIRE_DURABLE).",
    "opted_out": "Calls served with X-Kaizen-No-Log: nothing stored.",
    "writer_restarts": "Times the capture writer process exited unexpectedly and was started again.",
}
_CAPTURE_GAUGES = {
    "queue_depth": "Captured calls in the capture log that the writer has not started to store.",
    "writing": "Captured calls in the batch the writer is storing now.",
    "log_unsettled": "Captured calls in the capture log not yet committed to the database.",
    "log_bytes": "Size of the capture log on disk.",
    "spool_bytes": "Capture log bytes of the calls held for the database.",
    "database_up": "1 while the capture writer reaches the database, 0 while calls are held in the log.",
    "durable": "1 while captured calls are appended to the capture log, 0 while it cannot be written (disk full).",
    "memory_calls": "Answered calls held only in memory (the capture log could not take them), not yet stored: "
    "lost if the gateway dies.",
    "memory_bytes": "Bytes of the calls held only in memory (at most KAIZEN_CAPTURE_MEMORY_BYTES).",
}


_SHADOW_STATUSES = ("copied", "dropped", "stored", "lost", "failed", "stale")


class _ScrapeCollector(Collector):
    """Turns what `GatewayMetrics.refresh` gathered into metric families; does no I/O itself."""

    def __init__(self, owner: GatewayMetrics) -> None:
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        return []  # families vary with the data; nothing to check against at registration

    def collect(self) -> Iterable[Metric]:
        owner = self.owner
        yield from self._capture(owner.sink)
        yield from self._engine(owner)
        if owner.shadow is not None:
            yield from self._shadow(owner.shadow)
        if owner.store is not None:
            yield from self._store(owner.store)
        ok = GaugeMetricFamily(
            "kaizen_metrics_database_ok",
            "1 when the last read of the database figures succeeded (they are omitted until one has).",
        )
        ok.add_metric([], 1.0 if owner.store_ok else 0.0)
        yield ok

    @staticmethod
    def _capture(sink: CaptureSink) -> Iterable[Metric]:
        snapshot = sink.snapshot()
        for name, text in _CAPTURE_COUNTERS.items():
            yield CounterMetricFamily(f"kaizen_capture_{name}", text, value=float(snapshot[name]))
        for name, text in _CAPTURE_GAUGES.items():
            yield GaugeMetricFamily(f"kaizen_capture_{name}", text, value=float(snapshot[name]))

    @staticmethod
    def _shadow(shadow: ShadowTap) -> Iterable[Metric]:
        calls = CounterMetricFamily(
            "kaizen_shadow_calls",
            "Calls copied to a shadow rollout's candidate (copied), not copied because the queue was full "
            "(dropped), and what became of the copies: pairs stored, lost with a batch the database refused, "
            "failed in the engine, or stale (the rollout ended first).",
            labels=["status"],
        )
        for status in _SHADOW_STATUSES:
            calls.add_metric([status], float(shadow.counts[status]))
        yield calls

    @staticmethod
    def _engine(owner: GatewayMetrics) -> Iterable[Metric]:
        engine, router = owner.engine, owner.router
        yield GaugeMetricFamily(
            "kaizen_engine_up",
            "1 when the engine answered its health check at the last scrape.",
            value=1.0 if owner.engine_up else 0.0,
        )
        yield CounterMetricFamily(
            "kaizen_engine_restarts",
            "Times the gateway restarted a dead engine.",
            value=float(engine.restarts),
        )
        yield GaugeMetricFamily(
            "kaizen_engine_adapters_loaded",
            "LoRA adapter versions loaded into the engine.",
            value=float(len(engine.loaded_adapters())),
        )
        served = GaugeMetricFamily(
            "kaizen_served_version",
            "The version of each policy this gateway sends new calls to (its view of the active version).",
            labels=["policy"],
        )
        for policy, state in sorted(router.policies.items()):
            if state.active_version is not None:
                served.add_metric([policy], float(state.active_version))
        yield served
        in_flight = GaugeMetricFamily(
            "kaizen_in_flight", "Chat calls in flight, by served model.", labels=["served"]
        )
        for name, count in sorted(router.in_flight.items()):
            in_flight.add_metric([name], float(count))
        yield in_flight

    @staticmethod
    def _store(store: StoreCounts) -> Iterable[Metric]:
        active = GaugeMetricFamily(
            "kaizen_policy_active_version", "The active version of each policy (database).", labels=["policy"]
        )
        for policy, version in sorted(store.active_versions.items()):
            if version is not None:
                active.add_metric([policy], float(version))
        yield active
        rewards = GaugeMetricFamily(
            "kaizen_rewards_stored",
            "Reward rows stored, by source (feedback, judge, function, webhook) and status (linked, pending, "
            'orphaned): feedback by status is source="feedback".',
            labels=["source", "status"],
        )
        for (source, status), rows in sorted(store.rewards.items()):
            rewards.add_metric([source, status], float(rows))
        yield rewards
        groups = CounterMetricFamily(
            "kaizen_judge_groups",
            "Groups the judge scored (judged) or gave up on (failed).",
            labels=["policy", "status"],
        )
        calls = CounterMetricFamily(
            "kaizen_judge_calls", "Requests to the judge model, retries included.", labels=["policy"]
        )
        cost = CounterMetricFamily(
            "kaizen_judge_cost_usd",
            "What the judge's requests cost, as litellm priced them.",
            labels=["policy"],
        )
        per_policy: dict[str, tuple[int, float]] = {}
        for row in store.judge:
            groups.add_metric([row.policy, row.status], float(row.groups))
            n, usd = per_policy.get(row.policy, (0, 0.0))
            per_policy[row.policy] = (n + row.calls, usd + row.cost_usd)
        for policy, (n, usd) in sorted(per_policy.items()):
            calls.add_metric([policy], float(n))
            cost.add_metric([policy], usd)
        yield from (groups, calls, cost)
        runs = GaugeMetricFamily(
            "kaizen_runs",
            "Job runs by policy, kind (train, judge, retention) and status (running, succeeded, skipped, "
            "failed, rejected).",
            labels=["policy", "kind", "status"],
        )
        durations = SummaryMetricFamily(
            "kaizen_run_duration_seconds",
            "Duration of finished job runs, by policy and kind.",
            labels=["policy", "kind"],
        )
        last = GaugeMetricFamily(
            "kaizen_run_last_finished_timestamp_seconds",
            "When the newest run of each policy, kind and status finished (unix time).",
            labels=["policy", "kind", "status"],
        )
        finished: dict[tuple[str, str], tuple[int, float]] = {}
        for run in store.runs:
            runs.add_metric([run.policy, run.kind, run.status], float(run.runs))
            n, seconds = finished.get((run.policy, run.kind), (0, 0.0))
            finished[(run.policy, run.kind)] = (n + run.finished, seconds + run.duration_s)
            if run.last_finished_at is not None:
                last.add_metric([run.policy, run.kind, run.status], run.last_finished_at.timestamp())
        for (policy, kind), (n, seconds) in sorted(finished.items()):
            durations.add_metric([policy, kind], count_value=n, sum_value=seconds)
        yield from (runs, durations, last)
        yield from _ScrapeCollector._live_rewards(store)
        yield from _ScrapeCollector._learning_latency(store)
        yield from _ScrapeCollector._rollouts(store)

    @staticmethod
    def _live_rewards(store: StoreCounts) -> Iterable[Metric]:
        window = f"episodes started in the last {LIVE_REWARD_WINDOW.total_seconds() / 3600:g} h"
        labels = ["policy", "version"]
        episodes = GaugeMetricFamily(
            "kaizen_live_reward_episodes",
            f"Rewarded {window}, by policy and the version that served their first call (base: the base model).",
            labels=labels,
        )
        mean = GaugeMetricFamily(
            "kaizen_live_reward_mean", f"Mean reward of the rewarded {window}.", labels=labels
        )
        half = GaugeMetricFamily(
            "kaizen_live_reward_ci95_half_width",
            f"Half-width of the 95% interval of kaizen_live_reward_mean (normal, 1.96 sd/sqrt(n)); absent below "
            f"two episodes; {window}.",
            labels=labels,
        )
        for (policy, version), stats in sorted(
            store.live_rewards.items(), key=lambda item: (item[0][0], item[0][1] is None, item[0][1] or 0)
        ):
            key = [policy, "base" if version is None else str(version)]
            episodes.add_metric(key, float(stats.episodes))
            if stats.mean is not None:
                mean.add_metric(key, stats.mean)
            if stats.low is not None and stats.high is not None:
                half.add_metric(key, (stats.high - stats.low) / 2)
        yield from (episodes, mean, half)

    @staticmethod
    def _learning_latency(store: StoreCounts) -> Iterable[Metric]:
        seconds = GaugeMetricFamily(
            "kaizen_reward_to_serving_seconds",
            "From the arrival of the rewards the serving version was trained on to that version serving "
            "(serving_since), by policy, version and reward: newest (the freshest learning signal), median, "
            "oldest.",
            labels=["policy", "version", "reward"],
        )
        rewards = GaugeMetricFamily(
            "kaizen_reward_to_serving_rewards",
            "Reward rows the training run that produced the serving version learned from.",
            labels=["policy", "version"],
        )
        for row in store.learning_latency:
            version = str(row.version)
            for which, value in (
                ("newest", row.newest_s),
                ("median", row.median_s),
                ("oldest", row.oldest_s),
            ):
                seconds.add_metric([row.policy, version, which], value)
            rewards.add_metric([row.policy, version], float(row.rewards))
        yield from (seconds, rewards)

    @staticmethod
    def _rollouts(store: StoreCounts) -> Iterable[Metric]:
        counts = GaugeMetricFamily(
            "kaizen_rollouts",
            "Rollouts by policy and status (running, promoted, rolled_back, stopped).",
            labels=["policy", "status"],
        )
        for (policy, status), n in sorted(store.rollouts.items()):
            counts.add_metric([policy, status], float(n))
        share = GaugeMetricFamily(
            "kaizen_rollout_share",
            "Share of the policy's traffic a running rollout sends to its version (shadow: of calls copied), by "
            "mode (canary, split, shadow); absent when none runs.",
            labels=["policy", "mode", "version"],
        )
        difference = GaugeMetricFamily(
            "kaizen_rollout_difference",
            "A running rollout's last evaluation: mean reward of its version minus the baseline's (bound "
            "estimate) and the bounds the canary decides on (low, high: its confidence sequence); a bound the "
            "evaluation left undefined is absent.",
            labels=["policy", "version", "bound"],
        )
        bounds: dict[tuple[str, str], dict[str, float | None]] = {}
        for rollout in store.running_rollouts:
            version = str(rollout.version)
            share.add_metric([rollout.policy, rollout.mode, version], rollout.share)
            # Newest last: two running rollouts of one version (not expected) report the newer's evaluation.
            bounds[(rollout.policy, version)] = {
                "estimate": rollout.estimate,
                "low": rollout.low,
                "high": rollout.high,
            }
        for (policy, version), values in bounds.items():
            for bound, value in values.items():
                if value is not None:
                    difference.add_metric([policy, version, bound], value)
        yield from (counts, share, difference)


#: Families every worker reads from the same place (the database, the shared engine): reported once, from the
#: worker that answers the scrape, without a `worker` label.
SHARED_FAMILIES = frozenset(
    {
        "kaizen_engine_up",
        "kaizen_policy_active_version",
        "kaizen_rewards_stored",
        "kaizen_judge_groups",
        "kaizen_judge_calls",
        "kaizen_judge_cost_usd",
        "kaizen_runs",
        "kaizen_run_duration_seconds",
        "kaizen_run_last_finished_timestamp_seconds",
        "kaizen_metrics_database_ok",
        "kaizen_live_reward_episodes",
        "kaizen_live_reward_mean",
        "kaizen_live_reward_ci95_half_width",
        "kaizen_reward_to_serving_seconds",
        "kaizen_reward_to_serving_rewards",
        "kaizen_rollouts",
        "kaizen_rollout_share",
        "kaizen_rollout_difference",
    }
)


class _Families:
    """A fixed list of families, in the shape the exposition encoders read (`collect`)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _labelled(family: Metric, worker: int) -> Metric:
    copy = Metric(family.name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(labels={**s.labels, "worker": str(worker)}) for s in family.samples]
    return copy


#: What a sibling worker asks for its exposition (`gateway.peers`).
PEER_TOPIC = "metrics"


def merge_workers(own: Iterable[Metric], index: int, peers: dict[int, str]) -> list[Metric]:
    """One exposition for all workers: the shared families as this worker read them, every other family's
    samples from each worker with a `worker` label (sum over it for the gateway's totals). `peers` holds the
    other workers' OpenMetrics text by index."""
    merged: dict[str, Metric] = {}

    def add(family: Metric, worker: int) -> None:
        if family.name in SHARED_FAMILIES:
            if worker == index:
                merged[family.name] = family
            return
        labelled = _labelled(family, worker)
        if family.name in merged:
            merged[family.name].samples.extend(labelled.samples)
        else:
            merged[family.name] = labelled

    for family in own:
        add(family, index)
    for worker, text in sorted(peers.items()):
        for family in text_string_to_metric_families(text):  # type: ignore[no-untyped-call]
            add(family, worker)
    return list(merged.values())


class GatewayMetrics:
    """The registry of one gateway process and what `/metrics` reads when it is scraped."""

    def __init__(
        self,
        settings: Settings,
        *,
        database: Database,
        engine: Engine,
        router: ModelRouter,
        sink: CaptureSink,
        peers: PeerLink | None = None,
        shadow: ShadowTap | None = None,
    ) -> None:
        self.peers = peers
        if peers is not None:
            peers.answer(PEER_TOPIC, lambda _: openmetrics_exposition(self.registry))  # type: ignore[no-untyped-call]
        self.shadow = shadow
        self.database = database
        self.engine = engine
        self.router = router
        self.sink = sink
        self.key = settings.metrics_key
        self.db_interval_s = settings.metrics_db_interval_s
        self.registry = CollectorRegistry(auto_describe=True)
        self.calls = CallMetrics(self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_ScrapeCollector(self))
        self.engine_up = False
        self.store: StoreCounts | None = None
        self.store_ok = False
        self._store_read_at = -float("inf")
        self._store_lock = asyncio.Lock()
        # Reward-to-serving figures settle once a version serves: computed once each, not every interval.
        self._latency_memo: dict[LatencyKey, LearningLatency | None] = {}

    def open_with(self, keys: KeyRing) -> bool:
        """Whether /metrics answers without a key: only on a gateway with no key of any kind (no client key, no
        admin key, no metrics key), whose /v1 is just as open; any key closes it, whatever the bind address."""
        return not self.key and keys.open and not keys.admin_enabled

    def has_key(self, authorization: str | None) -> bool:
        """Whether this Authorization header carries the metrics key (`KAIZEN_METRICS_KEY`)."""
        return bool(
            self.key
            and authorization is not None
            and hmac.compare_digest(authorization.encode(), f"Bearer {self.key}".encode())
        )

    async def refresh(self) -> None:
        """Gather what the scrape reports: the engine's health now, the database figures when stale."""
        try:
            self.engine_up = await asyncio.wait_for(self.engine.health(), ENGINE_HEALTH_TIMEOUT_S)
        except TimeoutError:
            self.engine_up = False
        if time.monotonic() - self._store_read_at < self.db_interval_s:
            return
        async with self._store_lock:  # concurrent scrapes share one read
            if time.monotonic() - self._store_read_at < self.db_interval_s:
                return
            try:
                async with self.database.session() as session:
                    self.store = await store_counts(session, latency_memo=self._latency_memo)
                self.store_ok = True
            except Exception as exc:  # the database may be down: the last figures stay, flagged stale
                log.warning("metrics: could not read the database figures: %s", exc)
                self.store_ok = False
            self._store_read_at = time.monotonic()

    async def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for the scraper's Accept header (Prometheus text, or OpenMetrics) and its type; as one
        of several workers, every worker's (a worker that does not answer in time is left out, logged)."""
        encoder, content_type = choose_encoder(accept)
        if self.peers is None:
            return encoder(self.registry), content_type
        texts = {index: text.decode() for index, text in (await self.peers.ask(PEER_TOPIC)).items()}
        families = merge_workers(self.registry.collect(), self.peers.peers.index, texts)
        return encoder(_Families(families)), content_type  # type: ignore[arg-type]
