"""The admin API's edits of omlx.toml, their refusals, against the real server: an edit the
config would reject never reaches the file."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow


def test_unloading_the_only_model_is_refused_with_its_toml_path(server: Server):
    before = server.config.read_text()
    r = httpx.post(f"{server.url}/admin/api/models/{MODEL_NAME}/unload", timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_config"
    assert [i["path"] for i in error["issues"]] == ["models"]
    assert server.config.read_text() == before
    models = httpx.get(f"{server.url}/admin/api/models").json()["models"]
    assert [(m["name"], m["state"]) for m in models] == [(MODEL_NAME, "ready")]


def test_unknown_models_are_404(server: Server):
    for verb in ("unload", "load", "default"):
        r = httpx.post(f"{server.url}/admin/api/models/no-such-model/{verb}", timeout=60)
        assert r.status_code == 404, verb
        assert r.json()["error"]["code"] == "model_not_found"


def test_making_the_default_model_default_again_changes_nothing(server: Server):
    r = httpx.post(f"{server.url}/admin/api/models/{MODEL_NAME}/default", timeout=60)
    assert r.status_code == 200
    assert r.json()["applied"] is True and r.json()["actions"] == []


def test_config_text_round_trips_and_bad_text_names_its_error(server: Server):
    got = httpx.get(f"{server.url}/admin/api/config/file").json()
    assert got["path"] == str(server.config) and got["text"] == server.config.read_text()
    r = httpx.put(f"{server.url}/admin/api/config/file", json={"text": got["text"] + "\n[server\n"})
    assert r.status_code == 400
    assert "line" in r.json()["error"]["message"]  # TOML syntax errors say where
    assert ".pending-" not in r.json()["error"]["message"]  # the real file is named, not the temp one
    bad = got["text"].replace("max_queued = 8", "max_queued = -1")
    r = httpx.put(f"{server.url}/admin/api/config/file", json={"text": bad})
    assert r.status_code == 400
    assert [i["path"] for i in r.json()["error"]["issues"]] == ["batching.max_queued"]
    assert server.config.read_text() == got["text"]
    r = httpx.put(f"{server.url}/admin/api/config/file", json={"text": got["text"]})
    assert r.status_code == 200 and r.json()["applied"] is True
    assert httpx.put(f"{server.url}/admin/api/config/file", content=b"not json").status_code == 400


def test_config_text_masks_keys_and_keeps_them_on_save(server: Server):
    original = server.config.read_text()
    key = "config-edits-test-admin-key"
    with_key = original.replace("[server]", f'[server]\nadmin_key = "{key}"')
    auth = {"Authorization": f"Bearer {key}"}
    try:
        r = httpx.put(f"{server.url}/admin/api/config/file", json={"text": with_key})
        assert r.status_code == 200 and r.json()["applied"] is True
        assert httpx.get(f"{server.url}/admin/api/config/file").status_code == 401
        shown = httpx.get(f"{server.url}/admin/api/config/file", headers=auth).json()["text"]
        assert key not in shown and 'admin_key = "**********"' in shown
        # Saving the masked text back (with another change) keeps the real key.
        edited = shown.replace("max_queued = 8", "max_queued = 9")
        r = httpx.put(f"{server.url}/admin/api/config/file", json={"text": edited}, headers=auth)
        assert r.status_code == 200 and r.json()["applied"] is True
        assert f'admin_key = "{key}"' in server.config.read_text()
        assert "max_queued = 9" in server.config.read_text()
    finally:
        server.config.write_text(original)
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/admin/api/status").status_code != 200:
        assert time.monotonic() < deadline, "the admin key never went away"
        time.sleep(0.2)
