"""`GET /metrics` in Prometheus' text format: per-request figures observed as requests finish,
and the cache's, models' and reconciler's own counters read at scrape time.

Requests are counted by an ASGI middleware, labelled by the route that served them, so
every API (chat, completions, messages, responses, and routes added later) is counted
without its module knowing about metrics.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.engine.engine import PHASES
from appliance.server.auth import route_kind

if TYPE_CHECKING:
    from appliance.engine.request import RequestStats
    from appliance.reconcile.apply import Reconciler
    from appliance.runtime import Appliance

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
UNKNOWN_MODEL = "unknown"  # a name no config declares: never a label (clients choose it)


class Metrics:
    """The appliance's Prometheus registry: what `/metrics` serves."""

    def __init__(self, appliance: Appliance, reconciler: Reconciler):
        self.appliance = appliance
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("omlx_requests", "API requests answered, by route, model and HTTP status",
                                ["api", "model", "status"], registry=r)
        self.ttft = Histogram("omlx_time_to_first_token_seconds", "Submission to first output token",
                              ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("omlx_queue_seconds", "Submission to admission into the running batch",
                               ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.inter_token = Histogram("omlx_inter_token_seconds", "A request's mean gap between output tokens",
                                     ["model"], buckets=INTER_TOKEN_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("omlx_prompt_tokens", "Prompt tokens of finished requests", ["model"], registry=r)
        self.cached_tokens = Counter("omlx_cached_prompt_tokens", "Prompt tokens restored from the KV cache",
                                     ["model", "tier"], registry=r)
        self.output_tokens = Counter("omlx_output_tokens", "Generated tokens", ["model"], registry=r)
        self.finished = Counter("omlx_finished_requests", "Requests the engines finished, by finish reason",
                                ["model", "reason"], registry=r)
        r.register(ApplianceCollector(appliance, reconciler))
        # Plain totals for the dashboard, which turns them into rates between two polls.
        self.totals = {"output_tokens": 0, "prompt_tokens": 0, "finished_requests": 0}
        self.finished_by_model: collections.Counter[str] = collections.Counter()
        self.cached_by_tier: collections.Counter[str] = collections.Counter()  # prompt tokens restored
        self._lock = threading.Lock()

    def observe(self, model: str, stats: RequestStats) -> None:
        """Records one finished request (called on the engine's thread)."""
        with self._lock:
            self.totals["output_tokens"] += stats.completion_tokens
            self.totals["prompt_tokens"] += stats.prompt_tokens
            self.totals["finished_requests"] += 1
            self.finished_by_model[model] += 1
            self.cached_by_tier.update(stats.cached_by_tier)
        self.finished.labels(model, stats.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.output_tokens.labels(model).inc(stats.completion_tokens)
        for tier, tokens in stats.cached_by_tier.items():
            self.cached_tokens.labels(model, tier).inc(tokens)
        if stats.queue_s is not None:
            self.queue.labels(model).observe(stats.queue_s)
        if stats.ttft_s is not None:
            self.ttft.labels(model).observe(stats.ttft_s)
        if stats.finished_at is not None and stats.first_token_at is not None and stats.completion_tokens >= 2:
            gap = (stats.finished_at - stats.first_token_at) / (stats.completion_tokens - 1)
            self.inter_token.labels(model).observe(gap)

    def model_label(self, body: bytes) -> str:
        """Returns the configured model a request body names (the default for none; "" for
        a request without a body, such as GET /v1/models)."""
        if not body:
            return ""
        name = requested_model(body)
        models = self.appliance.models
        if not name:
            return self.appliance.spec.default_model.name
        return name if name in models else UNKNOWN_MODEL


class ApplianceCollector(Collector):
    """Reads the store's, models' and reconciler's counters at scrape time."""

    def __init__(self, appliance: Appliance, reconciler: Reconciler):
        self.appliance = appliance
        self.reconciler = reconciler

    def collect(self) -> Iterator:
        app = self.appliance
        yield from tier_metrics(app.store.stats() if app.store is not None else {})
        yield from model_metrics(app)
        applies = CounterMetricFamily("omlx_reconcile_applies", "Config changes applied live")
        applies.add_metric([], self.reconciler.applies)
        failures = CounterMetricFamily("omlx_reconcile_failures",
                                       "Config changes not applied (invalid file or failed action)")
        failures.add_metric([], getattr(self.reconciler, "failures", 0))
        yield applies
        yield failures


def tier_metrics(tiers: dict) -> Iterator:
    """Returns bytes, budgets, blocks, hits, misses, evictions and restore rates per tier."""
    gauges = {
        "bytes": GaugeMetricFamily("omlx_cache_bytes", "Bytes held per cache tier", labels=["tier"]),
        "budget_bytes": GaugeMetricFamily("omlx_cache_budget_bytes", "Budget per cache tier", labels=["tier"]),
        "blocks": GaugeMetricFamily("omlx_cache_blocks", "KV blocks held per cache tier", labels=["tier"]),
    }
    hits = CounterMetricFamily("omlx_cache_hits", "Blocks restored from each tier", labels=["tier"])
    evictions = CounterMetricFamily("omlx_cache_evictions", "Blocks evicted from each tier", labels=["tier"])
    misses = CounterMetricFamily("omlx_cache_misses", "Lookups a tier could not serve, by reason",
                                 labels=["tier", "reason"])
    restore = GaugeMetricFamily("omlx_cache_restore_bytes_per_second", "Measured restore rate per tier",
                                labels=["tier"])
    for tier, data in tiers.items():
        for key, family in gauges.items():
            if data.get(key) is not None:
                family.add_metric([tier], data[key])
        if data.get("hits") is not None:
            hits.add_metric([tier], data["hits"])
        if data.get("evictions") is not None:
            evictions.add_metric([tier], data["evictions"])
        for reason, count in (data.get("misses") or {}).items():
            misses.add_metric([tier, reason], count)
        if data.get("restore_gbps") is not None:
            restore.add_metric([tier], data["restore_gbps"] * 1e9)
    yield from (*gauges.values(), hits, misses, evictions, restore)


def model_metrics(app: Appliance) -> Iterator:
    """Returns per model: state, load seconds, live requests and cache lookups."""
    state = GaugeMetricFamily("omlx_model_state", "1 for the state each model is in", labels=["model", "state"])
    load = GaugeMetricFamily("omlx_model_load_seconds", "Seconds the model's last load took", labels=["model"])
    live = GaugeMetricFamily("omlx_requests_live", "Requests running or queued", labels=["model"])
    hits = CounterMetricFamily("omlx_model_cache_hits", "Lookups that restored a prefix", labels=["model"])
    misses = CounterMetricFamily("omlx_model_cache_misses", "Lookups that restored nothing", labels=["model"])
    phases = CounterMetricFamily("omlx_engine_phase_seconds", "The engine thread's time, by phase of its steps",
                                 labels=["model", "phase"])
    steps = CounterMetricFamily("omlx_engine_steps", "Engine steps run", labels=["model"])
    calls = CounterMetricFamily("omlx_engine_prefill_calls", "Batched prefill calls that started prompts",
                                labels=["model"])
    for name, entry in list(app.models.items()):
        state.add_metric([name, entry.state], 1)
        engine = entry.engine
        if engine is None:
            continue
        load.add_metric([name], engine.loaded.load_s)
        live.add_metric([name], engine.num_live)
        for phase in PHASES:
            phases.add_metric([name, phase], engine.phase_s[phase])
        steps.add_metric([name], engine.num_steps)
        calls.add_metric([name], engine.num_prefill_calls)
        if engine.cache is not None:
            counters = engine.cache.counters
            hits.add_metric([name], counters.get("hits", 0))
            misses.add_metric([name], counters.get("misses", 0))
    yield from (state, load, live, hits, misses, phases, steps, calls)


class CountRequests:
    """ASGI middleware: counts every API request by route, model and HTTP status.

    The model is read from the JSON body as it streams past (a copy, not a second read);
    the route is the one that matched, so `/chat/completions` and `/v1/chat/completions`
    count as one API.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_kind(scope["path"]) != "api":
            return await self.app(scope, receive, send)
        body: list[bytes] = []
        status = 500

        async def tee() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, tee, watch)
        finally:
            metrics: Metrics | None = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                route = scope.get("route")
                api = api_label(route.path) if isinstance(route, Route) else "other"
                metrics.requests.labels(api, metrics.model_label(b"".join(body)), str(status)).inc()


def api_label(path: str) -> str:
    """Returns the canonical /v1 path of a route served under several prefixes."""
    while path.startswith("/v1/"):
        path = path.removeprefix("/v1")
    return "/v1" + path


def requested_model(body: bytes) -> str | None:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


ROUTES = [Route("/metrics", metrics, methods=["GET"])]
