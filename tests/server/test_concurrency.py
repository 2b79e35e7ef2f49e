"""Real concurrent HTTP clients: batching correctness, admission (429), disconnects, shutdown."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME, NO_EOS, Server, free_port, served, start_server, wait_for, write_config

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Tell me a joke.", "What is 2+2?", "Name a color.",
             "Say hello in Spanish.", "What is the largest ocean?"]
# EOS banned: the model answers this prompt in ~15 tokens, over before a test could see it
# running; banned, it runs to max_tokens.
LONG = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "temperature": 0, "max_tokens": 400, "stream": True, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    """A server admitting 1 running + 1 queued request, to make the limits easy to hit."""
    with served(tmp_path_factory, "small", max_running=1, max_queued=1) as srv:
        yield srv


def live_requests(server: Server) -> int:
    status = httpx.get(f"{server.url}/admin/api/status").json()
    return sum(m["live_requests"] for m in status["models"])


def wait_idle(server: Server, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while live_requests(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_requests(server) == 0


def refuses(port: int) -> bool:
    """True once nothing listens on `port` any more."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_concurrent_clients_get_the_same_tokens_as_alone(server: Server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def ask(q: str) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": q}],
                                              temperature=0, max_tokens=16).choices[0].message.content

    alone = [ask(q) for q in QUESTIONS]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=16,
        ) for q in QUESTIONS))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone


def test_full_queue_gets_429_with_retry_after(small_server: Server):
    url = f"{small_server.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
        with c1.stream("POST", url, json=LONG) as running, c2.stream("POST", url, json=LONG) as queued:
            assert running.status_code == 200 and queued.status_code == 200
            next(running.iter_lines())
            r = httpx.post(url, json={**LONG, "stream": False})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
    wait_idle(small_server)
    r = httpx.post(url, json={**LONG, "stream": False, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_streaming_client_that_disconnects_frees_its_slot(small_server: Server):
    url = f"{small_server.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url, json=LONG) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
            assert live_requests(small_server) == 1
    wait_idle(small_server, timeout_s=10)


def test_non_streaming_client_that_disconnects_frees_its_slot(small_server: Server):
    url = f"{small_server.url}/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        # The answer runs to max_tokens, far beyond the client's patience.
        httpx.post(url, json={**LONG, "stream": False, "max_tokens": 1000},
                   timeout=httpx.Timeout(60, read=1.5))
    wait_idle(small_server, timeout_s=10)


def test_queue_time_and_figures_are_recorded(small_server: Server):
    r = httpx.post(f"{small_server.url}/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200
    status = httpx.get(f"{small_server.url}/admin/api/status").json()
    recent = status["models"][0]["recent_requests"]
    last = recent[-1]
    assert last["completion_tokens"] == 4 and last["finish_reason"] == "length"
    assert last["queue_s"] >= 0 and last["ttft_s"] > 0 and last["prefill_tok_s"] > 0
    assert last["decode_tok_s"] > 0


def test_shutdown_drains_running_requests_and_refuses_new_ones(tmp_path):
    port = free_port()
    # Room for the 30-token answer to finish on a slow machine before the drain cuts it.
    config = write_config(tmp_path / "omlx.toml", port=port, drain_timeout_s=30)
    server = start_server(config, port, tmp_path / "server.log")
    url = f"{server.url}/v1/chat/completions"
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", url, json={**LONG, "max_tokens": 30}) as r:
                lines = r.iter_lines()
                next(lines)
                server.process.send_signal(signal.SIGTERM)
                wait_for(lambda: refuses(port), timeout_s=10, interval_s=0.02)
                with pytest.raises(httpx.ConnectError):
                    httpx.post(url, json={**LONG, "stream": False}, timeout=5)
                rest = list(lines)
        assert "data: [DONE]" in rest
        assert any('"finish_reason":"length"' in line or '"finish_reason":"stop"' in line for line in rest)
        # uvicorn re-raises the captured SIGTERM once shut down: the usual Unix clean exit.
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in server.output()
    finally:
        server.stop()
