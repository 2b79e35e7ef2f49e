"""The admin API and health against the real server."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow


def test_health_is_ok_once_models_serve(server: Server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "models": {MODEL_NAME: "ready"}}


def test_status_reports_config_and_models(server: Server):
    status = httpx.get(f"{server.url}/admin/api/status").json()
    config = status["config"]
    assert config["path"] == str(server.config)
    assert len(config["hash"]) == 16
    assert config["last_error"] is None
    (model,) = status["models"]
    assert model["name"] == MODEL_NAME and model["state"] == "ready" and model["default"] is True
    assert model["context_tokens"] == 2048 and model["dtype"] == "float32"


def test_status_hash_is_the_applied_specs(server: Server):
    from appliance.config import load_spec

    status = httpx.get(f"{server.url}/admin/api/status").json()
    assert status["config"]["hash"] == load_spec(server.config).spec.hash
