"""The KV cache through the real server: restarts, the admin API, tenants and `omlx cache`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import MODEL_NAME, REPO, Server, free_port, served, start_server, write_config

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful reviewer. " + " ".join(f"Rule {i}: keep functions short and named well." for i in range(40))


def chat(server: Server, question: str, **extra) -> dict:
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    data = r.json()
    return {"text": data["choices"][0]["message"]["content"], "prompt": data["usage"]["prompt_tokens"],
            "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"]}


def omlx_cache(config, *args: str) -> tuple[int, dict | str]:
    p = subprocess.run([sys.executable, "-m", "appliance", "cache", "--config", str(config), *args],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    try:
        return p.returncode, json.loads(p.stdout)
    except ValueError:
        return p.returncode, p.stderr


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory: pytest.TempPathFactory):
    with served(tmp_path_factory, "cached") as srv:
        yield srv


@pytest.mark.parametrize("bits", [16, 8])
def test_a_restarted_server_restores_from_its_ssd(tmp_path, bits):
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, cache_extra=f"host_kv_bits = {bits}\nssd_kv_bits = {bits}")
    first = start_server(config, port, tmp_path / "first.log")
    try:
        cold = chat(first, "Summarize the rules.")
    finally:
        first.stop()
    second = start_server(config, port, tmp_path / "second.log")
    try:
        warm = chat(second, "Summarize the rules.")
        stats = httpx.get(f"{second.url}/admin/api/cache").json()
    finally:
        second.stop()
    assert cold["cached"] == 0
    assert warm["cached"] == warm["prompt"] - 1
    assert warm["text"] == cold["text"]
    assert stats["tiers"]["ssd"]["hits"] > 0
    assert stats["tiers"]["ssd"]["restore_gbps"] is not None
    assert stats["tiers"]["ssd"]["kv_bits"] == stats["tiers"]["host"]["kv_bits"] == bits


def test_cache_stats_per_tier(cached_server: Server):
    chat(cached_server, "How many rules are there?")
    stats = httpx.get(f"{cached_server.url}/admin/api/cache").json()
    for tier in ("memory", "host", "ssd"):
        t = stats["tiers"][tier]
        assert {"bytes", "budget_bytes", "blocks", "hits", "evictions", "restore_gbps"} <= set(t)
        assert t["bytes"] <= t["budget_bytes"]
    assert isinstance(stats["tiers"]["ssd"]["misses"], dict)
    model = stats["models"][MODEL_NAME]
    assert model["lookups"] >= 1 and model["saved_blocks"] >= 1


def test_clear_one_model_then_everything(cached_server: Server):
    chat(cached_server, "Which rule matters most?")
    assert chat(cached_server, "Which rule matters most?")["cached"] > 0
    r = httpx.post(f"{cached_server.url}/admin/api/cache/clear", json={"model": MODEL_NAME})
    assert r.status_code == 200 and r.json()["removed_blocks"] > 0
    assert chat(cached_server, "Which rule matters most?")["cached"] == 0
    r = httpx.post(f"{cached_server.url}/admin/api/cache/clear")
    assert r.status_code == 200
    assert httpx.get(f"{cached_server.url}/admin/api/cache").json()["tiers"]["memory"]["blocks"] == 0


def test_clear_errors(cached_server: Server):
    r = httpx.post(f"{cached_server.url}/admin/api/cache/clear", json={"model": "nope"})
    assert r.status_code == 404
    r = httpx.post(f"{cached_server.url}/admin/api/cache/clear", content=b"{oops")
    assert r.status_code == 400


def test_cache_salt_separates_tenants(cached_server: Server):
    q = "Is rule 7 the same as rule 8?"
    assert chat(cached_server, q, cache_salt="alice")["cached"] == 0
    assert chat(cached_server, q, cache_salt="bob")["cached"] == 0
    again = chat(cached_server, q, cache_salt="alice")
    assert again["cached"] == again["prompt"] - 1


def test_cli_export_clear_import_round_trip(cached_server: Server, tmp_path):
    config = cached_server.config
    first = chat(cached_server, "Quote rule 3.")
    code, stats = omlx_cache(config, "stats")
    assert code == 0 and stats["tiers"]["ssd"]["blocks"] > 0
    archive = tmp_path / "team.tar"
    code, out = omlx_cache(config, "export", str(archive))
    assert code == 0 and out["exported_blocks"] > 0 and archive.exists()
    code, _ = omlx_cache(config, "clear")
    assert code == 0
    code, out = omlx_cache(config, "import", str(archive))
    assert code == 0 and out["imported_blocks"] > 0
    again = chat(cached_server, "Quote rule 3.")
    assert again["cached"] == again["prompt"] - 1 and again["text"] == first["text"]


def test_cli_rejects_a_bad_archive(cached_server: Server, tmp_path):
    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"not a tar file at all")
    code, err = omlx_cache(cached_server.config, "import", str(bogus))
    assert code == 1 and "archive" in err


def test_cli_works_on_the_files_when_no_server_runs(tmp_path):
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port)
    server = start_server(config, port, tmp_path / "server.log")
    try:
        chat(server, "Name one rule.")
    finally:
        server.stop()
    code, stats = omlx_cache(config, "stats")
    assert code == 0 and stats["server"] == "not running" and stats["ssd"]["blocks"] > 0
    code, out = omlx_cache(config, "export", str(tmp_path / "offline.tar"))
    assert code == 0 and out["exported_blocks"] == stats["ssd"]["blocks"]
    code, out = omlx_cache(config, "clear")
    assert code == 0 and out["removed_blocks"] == stats["ssd"]["blocks"]
