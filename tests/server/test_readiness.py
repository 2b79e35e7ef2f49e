"""Readiness: /health answers 200 only once every model has run a first request's work;
/v1/models shows each model's state meanwhile."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import MODEL_NAME, free_port, start_server, write_config

pytestmark = pytest.mark.slow


def test_ready_only_after_load_and_warm_up(tmp_path):
    port = free_port()
    server = start_server(write_config(tmp_path / "omlx.toml", port=port), port, tmp_path / "server.log",
                          wait_ready=False)
    seen_before_ready: set[str] = set()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.output()
            try:
                models = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"]
                health = httpx.get(f"{server.url}/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if health.status_code == 200:
                break
            assert health.json()["status"] == "starting"
            seen_before_ready.add(models[0]["state"])
            time.sleep(0.05)
        assert health.status_code == 200, server.output()
        # The server listens before the model is ready, and says so in both places.
        assert seen_before_ready & {"pending", "loading"}
        assert "ready" not in seen_before_ready
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["state"]) for m in models] == [(MODEL_NAME, "ready")]
        status = httpx.get(f"{server.url}/admin/api/status").json()["models"][0]
        assert status["warm_up_s"] > 0
        assert status["shapes_to_warm"] == 0  # batched start shapes are warmed on GPUs only
        assert status["small_matmul"] == {}  # chosen where our kernel runs (CUDA) only
        # Nothing of the warm-up reaches the cache or the request history.
        assert status["recent_requests"] == []
        cache = httpx.get(f"{server.url}/admin/api/cache").json()
        assert cache["models"][MODEL_NAME].get("saved_blocks", 0) == 0
        assert cache["tiers"]["memory"]["blocks"] == 0
        assert "warmed up in" in server.output()
    finally:
        assert server.stop() == 0


def test_a_stand_in_warms_up_beside_the_load(tmp_path):
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, extra='warm_up_beside_load = "on"')
    server = start_server(config, port, tmp_path / "server.log")
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        out = server.output()
        # On the engine's thread, before the model's own (shorter) warm-up.
        assert out.index("warmed up beside its load, on a 1-layer stand-in") < out.index("warmed up in")
        cache = httpx.get(f"{server.url}/admin/api/cache").json()
        assert cache["tiers"]["memory"]["blocks"] <= 1  # the request's; nothing of the stand-in
    finally:
        assert server.stop() == 0
