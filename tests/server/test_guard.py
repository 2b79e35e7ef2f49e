"""Keys, tenants and limits against a real server: who gets in, whose KV they see, what is refused."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME, NO_EOS, REPO, Server, served

pytestmark = pytest.mark.slow

KEY_A = "team-a-key-0123456789"
KEY_B = "team-b-key-9876543210"
ADMIN = "admin-key-abcdefghijklmnop"
KEY_B_ENV = "TEST_GUARD_KEY_B"
SECRETS = (KEY_A, KEY_B, ADMIN)
CONTEXT = "You review code. " + " ".join(f"Rule {i}: name things for what they are." for i in range(60))
SERVER_KEYS = f'''admin_key = "{ADMIN}"
[[server.api_keys]]
key = "{KEY_A}"
tenant = "team-a"
[[server.api_keys]]
key_env = "{KEY_B_ENV}"
tenant = "team-b"
'''
LIMITS = """
[limits]
max_body_bytes = 65536
max_prompt_tokens = 1500
max_tokens = 200
max_concurrent_per_key = 1
max_queued_per_key = 1
"""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):
    os.environ[KEY_B_ENV] = KEY_B
    try:
        with served(tmp_path_factory, "guarded", server_extra=SERVER_KEYS, extra=LIMITS) as srv:
            yield srv
    finally:
        os.environ.pop(KEY_B_ENV, None)


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def ask(server: Server, key: str, question: str = "Which rule matters most?", **extra) -> int:
    """Returns how many prompt tokens came from the cache."""
    reply = client(server, key).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0, **extra,
        messages=[{"role": "system", "content": CONTEXT}, {"role": "user", "content": question}])
    return reply.usage.prompt_tokens_details.cached_tokens


def test_no_key_or_a_wrong_key_is_401_in_each_apis_shape(guarded: Server):
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"x-api-key": "nope"}):
        r = httpx.post(f"{guarded.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(f"{guarded.url}/v1/messages", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": r.json()["error"]["message"]}}
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "wrong-key-0123456789").models.list()


def test_keys_work_in_both_headers_and_sdks(guarded: Server):
    assert [m.id for m in client(guarded, KEY_A).models.list().data] == [MODEL_NAME]
    message = anthropic.Anthropic(base_url=guarded.url, api_key=KEY_B, max_retries=0).messages.create(
        model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    assert message.usage.output_tokens >= 1


def test_admin_endpoints_need_the_admin_key_and_health_needs_none(guarded: Server):
    url = f"{guarded.url}/admin/api/status"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200


def test_keys_are_never_shown_or_logged(guarded: Server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    shown = httpx.get(f"{guarded.url}/admin/api/config", headers=admin).text
    shown += httpx.get(f"{guarded.url}/admin/api/status", headers=admin).text
    assert "**********" in shown
    for secret in SECRETS:
        assert secret not in shown and secret not in guarded.output()


def test_a_keys_tenant_decides_whose_kv_it_reads(guarded: Server):
    ask(guarded, KEY_A, "First visit?")
    assert ask(guarded, KEY_A) > 500  # same tenant: a hit
    # Another tenant: the context is a miss, though the prompt is the same (only the chat
    # template's first tokens, which its own earlier requests share, can hit).
    assert ask(guarded, KEY_B) < 50
    assert ask(guarded, KEY_B) > 500
    # A salt narrows a tenant's space; it never reaches another tenant's blocks.
    assert ask(guarded, KEY_A, "Salted?", extra_body={"cache_salt": "x"}) == 0
    assert ask(guarded, KEY_A, "Salted again?", extra_body={"cache_salt": "x"}) > 500


def test_cache_files_are_the_service_users_alone(guarded: Server):
    kv = Path(guarded.config).parent / "cache" / "kv"
    assert stat.S_IMODE(kv.stat().st_mode) == 0o700
    files = [p for p in kv.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files)


def test_export_takes_one_tenants_blocks(guarded: Server, tmp_path: Path):
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def export(tenant: str) -> int:
        r = httpx.post(f"{guarded.url}/admin/api/cache/export", headers=admin, timeout=120,
                       json={"path": str(tmp_path / f"{tenant}.tar"), "tenant": tenant})
        assert r.status_code == 200, r.text
        return r.json()["exported_blocks"]

    assert export("team-a") > 0
    assert export("default") == 0  # every request came with a key of another tenant
    r = httpx.post(f"{guarded.url}/admin/api/cache/export", headers=admin,
                   json={"path": str(tmp_path / "x.tar"), "tenant": "../team-a"})
    assert r.status_code == 400


def test_the_cli_sends_the_admin_key_from_the_config(guarded: Server):
    done = subprocess.run([sys.executable, "-m", "appliance", "cache", "stats", "--config", str(guarded.config)],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, KEY_B_ENV: KEY_B})
    assert done.returncode == 0, done.stderr
    assert "tiers" in json.loads(done.stdout)


def test_limits_give_4xx_in_each_apis_shape(guarded: Server):
    headers = {"Authorization": f"Bearer {KEY_A}"}
    huge = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=huge, headers=headers)
    assert r.status_code == 413 and "limits.max_body_bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{guarded.url}/v1/messages", json={**huge, "max_tokens": 4}, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    long = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 1800}]}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=long, headers=headers)
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]
    r = httpx.post(f"{guarded.url}/v1/messages", json=long, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in r.json()["error"]["message"]
    over = {"model": MODEL_NAME, "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=over, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_key_gets_one_running_one_queued_and_429_beyond(guarded: Server):
    body = {"model": MODEL_NAME, "max_tokens": 200, "stream": True, "temperature": 0,
            "logit_bias": NO_EOS,  # the stream outlasts the test
            "messages": [{"role": "user", "content": "Count to a thousand."}]}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    first_chunk = threading.Event()
    statuses: list[int] = []

    def stream(signal_first: bool) -> None:
        with httpx.stream("POST", f"{guarded.url}/v1/chat/completions", json=body, headers=headers,
                          timeout=300) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if signal_first:
                    first_chunk.set()

    running = threading.Thread(target=stream, args=(True,))
    running.start()
    assert first_chunk.wait(120)
    queued = threading.Thread(target=stream, args=(False,))
    queued.start()
    time.sleep(3.0)  # let it reach the queue; the running stream (200 tokens, no EOS) lasts ~11 s on 2 cores
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json={**body, "stream": False}, headers=headers)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "max_concurrent_per_key 1" in r.json()["error"]["message"]
    # Another key is not held back by this one's queue.
    assert ask(guarded, KEY_B, "Another key?") >= 0
    running.join(300)
    queued.join(300)
    assert statuses == [200, 200]


def test_a_key_removed_from_the_config_stops_working_live(guarded: Server):
    config = Path(guarded.config)
    rotated = SERVER_KEYS.replace(f'key = "{KEY_A}"', 'key = "team-a-rotated-key-42"')
    config.write_text(config.read_text().replace(SERVER_KEYS, rotated))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 401:
            break
        time.sleep(0.2)
    assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 401
    assert httpx.get(f"{guarded.url}/v1/models",
                     headers={"Authorization": "Bearer team-a-rotated-key-42"}).status_code == 200
