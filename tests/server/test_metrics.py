"""`GET /metrics` against the real server, parsed with prometheus-client's own parser."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8, "temperature": 0}


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    """Returns every sample of /metrics by (name, sorted labels)."""
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_name_every_family(server: Server):
    samples = scrape(server)
    names = {name for name, _ in samples}
    for expected in ("omlx_cache_bytes", "omlx_cache_budget_bytes", "omlx_cache_blocks", "omlx_cache_hits_total",
                     "omlx_cache_evictions_total", "omlx_model_load_seconds", "omlx_model_state",
                     "omlx_reconcile_applies_total", "omlx_reconcile_failures_total"):
        assert expected in names, expected
    assert value(samples, "omlx_model_state", model=MODEL_NAME, state="ready") == 1
    assert value(samples, "omlx_model_load_seconds", model=MODEL_NAME) > 0
    assert value(samples, "omlx_cache_budget_bytes", tier="ssd") > 0


def test_counters_move_as_requests_are_served(server: Server):
    before = scrape(server)
    for path in ("/v1/chat/completions", "/chat/completions"):  # one API, served under two paths
        assert httpx.post(f"{server.url}{path}", json=CHAT, timeout=120).status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "The sky is", "max_tokens": 4},
                      timeout=120).status_code == 200
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": "no-such-model"}).status_code == 404
    after = scrape(server)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("omlx_requests_total", api="/v1/chat/completions", model=MODEL_NAME, status="200") == 2
    assert moved("omlx_requests_total", api="/v1/completions", model=MODEL_NAME, status="200") == 1
    # A client's made-up model name never becomes a label of its own.
    assert moved("omlx_requests_total", api="/v1/chat/completions", model="unknown", status="404") == 1
    assert moved("omlx_time_to_first_token_seconds_count", model=MODEL_NAME) == 3
    assert moved("omlx_queue_seconds_count", model=MODEL_NAME) == 3
    assert moved("omlx_inter_token_seconds_count", model=MODEL_NAME) >= 1
    assert moved("omlx_output_tokens_total", model=MODEL_NAME) >= 3
    assert moved("omlx_prompt_tokens_total", model=MODEL_NAME) > 10
    # The same chat twice: the second restores its prefix from the memory tier.
    assert moved("omlx_cached_prompt_tokens_total", model=MODEL_NAME, tier="memory") > 0
    assert moved("omlx_model_cache_hits_total", model=MODEL_NAME) >= 1
    # Where the engine's time went: every request was admitted, started and decoded.
    assert moved("omlx_engine_steps_total", model=MODEL_NAME) >= 3
    assert moved("omlx_engine_prefill_calls_total", model=MODEL_NAME) >= 2  # the repeat restored its prompt
    for phase in ("admit", "start", "decode", "deliver"):
        assert moved("omlx_engine_phase_seconds_total", model=MODEL_NAME, phase=phase) > 0, phase


def test_reconcile_counters_move_with_applies_and_failures(server: Server):
    before = scrape(server)
    good = httpx.get(f"{server.url}/admin/api/config/file").json()["text"]
    broken = good.replace("max_queued = 8", "max_queued = -1")
    bad = httpx.put(f"{server.url}/admin/api/config/file", json={"text": broken})
    assert bad.status_code == 400  # refused before the file: not a reconcile failure
    try:
        server.config.write_text(good.replace("max_queued = 8", "max_queued = -1"))  # the watcher rejects it
        deadline = time.monotonic() + 60
        while value(scrape(server), "omlx_reconcile_failures_total") == value(before, "omlx_reconcile_failures_total"):
            assert time.monotonic() < deadline, "the failure was never counted"
            time.sleep(0.2)
    finally:
        server.config.write_text(good)
    applied = httpx.put(f"{server.url}/admin/api/config/file", json={"text": good})
    assert applied.status_code == 200
    after = scrape(server)
    assert value(after, "omlx_reconcile_applies_total") > value(before, "omlx_reconcile_applies_total")
    assert value(after, "omlx_reconcile_failures_total") >= value(before, "omlx_reconcile_failures_total") + 1
