"""Live reconcile with the real model: each action type, rollback, bad files, bursts, no failed request."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import MODEL_GGUF, MODEL_NAME, REPO, Server, free_port, start_server, write_config
from tests.conftest import wait_for as wait_until

pytestmark = pytest.mark.slow

APPLY_WAIT_S = 120


def status(server: Server, port: int | None = None) -> dict:
    return httpx.get(f"http://127.0.0.1:{port or server.port}/admin/api/status", timeout=10).json()


def save(path: Path, text: str) -> None:
    """Saves like an editor: write a temp file, then rename it over the config."""
    tmp = path.with_name(path.name + ".swp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for(predicate, timeout_s: float = APPLY_WAIT_S):
    return wait_until(predicate, timeout_s)


def ask(port: int, model: str = MODEL_NAME, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0,
        "max_tokens": max_tokens})


@pytest.fixture
def live(tmp_path):
    """A server on a config file this test edits; yields (server, config path, base text)."""
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port)
    server = start_server(config, port, tmp_path / "server.log")
    yield server, config, config.read_text()
    server.stop()


def model_entry(server: Server, name: str = MODEL_NAME, port: int | None = None) -> dict | None:
    return next((m for m in status(server, port)["models"] if m["name"] == name), None)


def test_cache_budget_change_applies_without_reloading_the_model(live):
    server, config, text = live
    before = status(server)
    loaded_at = model_entry(server)["loaded_at"]
    save(config, text.replace('dir = "', 'memory_gb = 0.25\nhost_gb = 0.5\ndir = "'))
    after = wait_for(lambda: (s := status(server))["config"]["hash"] != before["config"]["hash"] and s)
    assert after["config"]["last_error"] is None
    assert model_entry(server)["loaded_at"] == loaded_at
    tiers = httpx.get(f"{server.url}/admin/api/cache").json()["tiers"]
    assert tiers["memory"]["budget_bytes"] == int(0.25 * 2**30)
    assert tiers["host"]["budget_bytes"] == int(0.5 * 2**30)


def test_add_then_remove_a_model(live):
    server, config, text = live
    second = f'\n[[models]]\nname = "second"\nsource = "{MODEL_GGUF}"\nmax_context_tokens = 1024\n'
    with_second = text.replace("[cache]", second + "\n[cache]").replace(
        "max_context_tokens = 2048", "max_context_tokens = 2048\ndefault = true")
    save(config, with_second)
    wait_for(lambda: (m := model_entry(server, "second")) and m["state"] == "ready")
    assert ask(server.port, "second").status_code == 200
    assert {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]} == {MODEL_NAME, "second"}
    save(config, text)
    wait_for(lambda: model_entry(server, "second") is None)
    assert ask(server.port, "second").status_code == 404
    assert ask(server.port).status_code == 200


def test_changed_model_section_swaps_with_in_flight_requests_finishing(live):
    server, config, text = live
    loaded_at = model_entry(server)["loaded_at"]

    async def stream_one(client: openai.AsyncOpenAI) -> str:
        chunks = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Count to twenty."}],
            temperature=0, max_tokens=48, stream=True)
        reasons = [c.choices[0].finish_reason async for c in chunks if c.choices]
        return reasons[-1]

    async def clients_during_reload() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        tasks = [asyncio.create_task(stream_one(client)) for _ in range(8)]
        await asyncio.sleep(1.0)
        save(config, text.replace("max_context_tokens = 2048", "max_context_tokens = 1536"))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # Keep streaming across the swap too.
        results += await asyncio.gather(*(stream_one(client) for _ in range(8)), return_exceptions=True)
        return results

    results = asyncio.run(clients_during_reload())
    assert all(r in ("stop", "length") for r in results), results
    entry = wait_for(lambda: (m := model_entry(server)) and m["loaded_at"] != loaded_at and m)
    assert entry["context_tokens"] == 1536 and entry["state"] == "ready"


def test_batching_and_kernels_change_live(live):
    server, config, text = live
    save(config, text.replace("max_queued = 8", "max_queued = 3").replace(
        "prefill_chunk_tokens = 256", "prefill_chunk_tokens = 128") + '\n[kernels]\nkv_quantize = "generic"\n')
    entry = wait_for(lambda: (m := model_entry(server))["limits"]["max_queued"] == 3 and m)
    assert entry["limits"]["prefill_chunk_tokens"] == 128
    assert status(server)["kernels"]["kv_quantize"] == {"asked": "generic", "chosen": "generic", "why": "asked for"}


def test_rebind_opens_the_new_port_and_closes_the_old(live):
    server, config, text = live
    new_port = free_port()
    save(config, text.replace(f"port = {server.port}", f"port = {new_port}"))
    wait_for(lambda: _answers(new_port))
    assert status(server, new_port)["server"]["port"] == new_port
    wait_for(lambda: not _answers(server.port))
    assert ask(new_port).status_code == 200


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_failed_step_rolls_back_everything_in_that_apply(live):
    server, config, text = live
    before = status(server)
    broken = text.replace("[cache]", '[[models]]\nname = "ghost"\nsource = "./missing.gguf"\n\n[cache]').replace(
        'dir = "', 'memory_gb = 0.125\ndir = "').replace(
        "max_context_tokens = 2048", "max_context_tokens = 2048\ndefault = true")
    save(config, broken)
    err = wait_for(lambda: status(server)["config"]["last_error"])
    assert "missing.gguf" in err["message"] and err["path"] == "models[1].source" and err["time"]
    now = status(server)
    assert now["config"]["hash"] == before["config"]["hash"]
    assert [m["name"] for m in now["models"]] == [MODEL_NAME]
    tiers = httpx.get(f"{server.url}/admin/api/cache").json()["tiers"]
    assert tiers["memory"]["budget_bytes"] != int(0.125 * 2**30)  # the resize was rolled back
    assert ask(server.port).status_code == 200
    save(config, text.replace('dir = "', 'memory_gb = 0.125\ndir = "'))
    wait_for(lambda: status(server)["config"]["last_error"] is None)


def test_port_in_use_rolls_back(live):
    server, config, text = live
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        save(config, text.replace(f"port = {server.port}", f"port = {taken}"))
        err = wait_for(lambda: status(server)["config"]["last_error"])
    assert err["path"] == "server.port"
    assert status(server)["server"]["port"] == server.port


@pytest.mark.parametrize("content", ["[server\nport = 1", "[server]\nport = 99999\n", None])
def test_invalid_or_half_written_file_changes_nothing(live, content):
    server, config, text = live
    before = status(server)["config"]["hash"]
    config.write_text(content if content is not None else text[: len(text) // 2])
    err = wait_for(lambda: status(server)["config"]["last_error"])
    assert err["message"] and err["time"]
    assert status(server)["config"]["hash"] == before
    assert ask(server.port).status_code == 200
    save(config, text.replace("max_queued = 8", "max_queued = 7"))
    wait_for(lambda: status(server)["config"]["last_error"] is None
             and model_entry(server)["limits"]["max_queued"] == 7)


def test_a_burst_of_saves_ends_in_the_last_one(live):
    server, config, text = live
    for n in range(1, 11):
        save(config, text.replace("max_queued = 8", f"max_queued = {n}"))
        time.sleep(0.01)
    wait_for(lambda: model_entry(server)["limits"]["max_queued"] == 10)
    time.sleep(1)
    assert model_entry(server)["limits"]["max_queued"] == 10
    assert status(server)["config"]["last_error"] is None


def test_put_config_writes_the_file_and_applies_it(live):
    server, config, text = live
    current = httpx.get(f"{server.url}/admin/api/config").json()
    assert current["hash"] == status(server)["config"]["hash"]
    spec = current["spec"]
    spec["batching"]["max_queued"] = 5
    r = httpx.put(f"{server.url}/admin/api/config", json=spec, timeout=APPLY_WAIT_S)
    assert r.status_code == 200 and r.json()["applied"] is True
    assert "max_queued = 5" in config.read_text()
    assert model_entry(server)["limits"]["max_queued"] == 5
    bad = dict(spec, server={"prot": 1})
    r = httpx.put(f"{server.url}/admin/api/config", json=bad)
    assert r.status_code == 400 and "server.prot" in r.text
    assert "max_queued = 5" in config.read_text()  # the file is untouched


def test_omlx_diff_prints_the_plan_without_applying(live):
    server, config, text = live
    before = status(server)["config"]["hash"]
    other = config.with_name("proposed.toml")
    other.write_text(text.replace("max_queued = 8", "max_queued = 2"))
    p = subprocess.run([sys.executable, "-m", "appliance", "diff", "--config", str(other)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "set batching limits" in p.stdout and "max_queued 2" in p.stdout
    assert status(server)["config"]["hash"] == before
