"""Faults against the real server: each ends in a clear error or state, and nothing is lost.

Disk faults are injected into the server subprocess by a sitecustomize.py on its
PYTHONPATH that wraps os.write/os.open/os.fsync for paths under the KV directory only:
a fake for the fault, the rest of the server is real.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sqlite3
from pathlib import Path

import httpx
import pytest

from appliance.cache.block import decode, read_file
from tests.conftest import MODEL_NAME, NO_EOS, Server, free_port, start_server, wait_for, write_config
from tests.server.test_cache_api import chat

pytestmark = pytest.mark.slow

EXIT_WAIT_S = 120
SMALL_BLOCKS = "block_tokens = 64"  # many blocks per prompt: more writes to interrupt
SITECUSTOMIZE = '''
import errno, os, stat, time
_DIR, _MODE = os.environ.get("FAULT_DIR"), os.environ.get("FAULT_MODE")


def _under(fd_or_path):
    try:
        path = os.readlink(f"/proc/self/fd/{fd_or_path}") if isinstance(fd_or_path, int) else fd_or_path
    except OSError:
        return False
    return os.path.abspath(os.fsdecode(path)).startswith(_DIR)


if _DIR and _MODE == "enospc":
    _write = os.write

    def write(fd, data):
        if _under(fd):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return _write(fd, data)
    os.write = write
elif _DIR and _MODE == "eacces":
    _open = os.open

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _under(path):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", path)
        return _open(path, flags, mode, dir_fd=dir_fd)
    os.open = open_
elif _DIR and _MODE == "stall_fsync":
    _fsync, _num_synced = os.fsync, [0]

    def fsync(fd):  # two block files are written, then the writer hangs in the third one's
        if stat.S_ISREG(os.fstat(fd).st_mode) and _under(fd):
            if _num_synced[0] >= 2:
                time.sleep(3600)
            _num_synced[0] += 1
        return _fsync(fd)
    os.fsync = fsync
elif _DIR and _MODE == "device_lost":  # CUDA's context lost: every engine step fails once _DIR exists
    from appliance.engine import scheduler as _scheduler
    _step = _scheduler.Scheduler.step

    def step(self):
        if os.path.exists(_DIR):
            raise RuntimeError("cudaMemcpy(data, buf.data, buf.size, kind) failed: "
                               "an illegal memory access was encountered (injected)")
        return _step(self)
    _scheduler.Scheduler.step = step
elif _MODE == "small_sndbuf":
    import socket
    _listen = socket.socket.listen

    def listen(self, *args):  # accepted connections inherit it: a slow reader pushes back at once
        self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return _listen(self, *args)
    socket.socket.listen = listen
'''


def inject(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str, kv_dir: Path) -> None:
    """Makes the next started server fail `mode` (for files under `kv_dir`)."""
    site = tmp_path / "fault-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAULT_DIR", str(kv_dir))
    monkeypatch.setenv("FAULT_MODE", mode)


def get(server: Server, path: str) -> dict:
    return httpx.get(f"{server.url}{path}", timeout=10).json()


def live_requests(server: Server) -> int:
    return sum(m["live_requests"] for m in get(server, "/admin/api/status")["models"])


def wait_idle(server: Server, timeout_s: float = 60) -> None:
    wait_for(lambda: live_requests(server) == 0, timeout_s)


def indexed(kv_dir: Path) -> dict[str, tuple[str, bytes]]:
    """Returns path -> (dir, key) of every committed index row, read beside the server."""
    db = sqlite3.connect(f"file:{kv_dir / 'index.sqlite'}?mode=ro", uri=True)
    try:
        return {path: (dir, key) for path, dir, key in db.execute("SELECT path, dir, key FROM blocks")}
    finally:
        db.close()


# --- the SSD tier --------------------------------------------------------------------


def test_sigkill_during_ssd_writes_then_restart_keeps_every_acknowledged_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, cache_extra=SMALL_BLOCKS)
    kv_dir = tmp_path / "cache" / "kv"
    inject(monkeypatch, tmp_path, "stall_fsync", kv_dir)
    server = start_server(config, port, tmp_path / "first.log")
    try:
        first = chat(server, "Summarize the rules.")  # ~8 blocks of 64 tokens to write
        wait_for(lambda: list(kv_dir.rglob("*.tmp")))  # the third is being written
        acknowledged = indexed(kv_dir)  # committed rows: put() has returned True for them
        assert len(acknowledged) == 2
        assert get(server, "/admin/api/cache")["tiers"]["ssd"]["writer"]["pending_blocks"] > 1
    finally:
        server.stop(signal.SIGKILL)
    assert server.process.returncode == -signal.SIGKILL

    monkeypatch.delenv("FAULT_MODE")
    server = start_server(config, port, tmp_path / "second.log")
    try:
        again = chat(server, "Summarize the rules.")
        misses = get(server, "/admin/api/cache")["tiers"]["ssd"]["misses"]
    finally:
        assert server.stop() == 0
    assert again["text"] == first["text"] and again["cached"] > 0
    assert set(misses) <= {"absent"}, misses  # no indexed block was found damaged

    rows = indexed(kv_dir)
    assert set(acknowledged) <= set(rows), "a block acknowledged before the kill is gone"
    files = {str(p.relative_to(kv_dir)) for p in kv_dir.rglob("*.kv")}
    assert files == set(rows) and not list(kv_dir.rglob("*.tmp"))
    for path, (dir, key) in rows.items():
        decode(read_file(kv_dir / path), key=key, dir=dir, tokens=None)  # raises if damaged


@pytest.mark.parametrize("mode, reason", [("enospc", "ENOSPC"), ("eacces", "Permission denied")])
def test_full_or_unwritable_cache_dir_disables_the_ssd_tier_and_serving_continues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, reason: str):
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, cache_extra=SMALL_BLOCKS)
    kv_dir = tmp_path / "cache" / "kv"
    inject(monkeypatch, tmp_path, mode, kv_dir)
    server = start_server(config, port, tmp_path / "server.log")
    try:
        cold = chat(server, "Summarize the rules.")  # enospc: its blocks fail to write
        ssd = wait_for(lambda: get(server, "/admin/api/status")["cache"]["ssd"] if
                       get(server, "/admin/api/status")["cache"]["ssd"]["disabled"] else None)
        warm = chat(server, "Summarize the rules.")
        other = chat(server, "Name the first rule.")
        health = httpx.get(f"{server.url}/health", timeout=10)
    finally:
        assert server.stop() == 0, server.output()
    assert reason in ssd["disabled_reason"]
    assert "SSD cache tier disabled" in server.output() or "SSD tier disabled" in server.output()
    assert warm["text"] == cold["text"] and warm["cached"] > 0  # served from memory
    assert other["prompt"] > 0 and health.status_code == 200
    assert not list(kv_dir.rglob("*.kv")) and not list(kv_dir.rglob("*.tmp"))
    assert "Traceback" not in server.output()


# --- the GPU ---------------------------------------------------------------------------


def test_a_lost_gpu_fails_its_request_and_exits_for_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """After a CUDA sticky error nothing on the device works again: the request fails with
    the reason, and the process stops with a status its service manager restarts it for."""
    from appliance.server.runner import EXIT_DEVICE_LOST

    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port)
    trigger = tmp_path / "lose-the-gpu"
    inject(monkeypatch, tmp_path, "device_lost", trigger)
    server = start_server(config, port, tmp_path / "server.log")
    try:
        trigger.mkdir()
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        code = server.process.wait(EXIT_WAIT_S)
    finally:
        server.stop(signal.SIGKILL)
    assert r.status_code >= 500 and "illegal memory access" in r.text
    assert code == EXIT_DEVICE_LOST, server.output()
    assert "the GPU context is lost" in server.output()


# --- models, port and config ---------------------------------------------------------


def test_a_missing_and_a_corrupt_model_fail_alone_while_another_serves(tmp_path: Path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, model_extra="default = true", extra=f"""
[[models]]
name = "missing"
source = "{tmp_path / 'nowhere.gguf'}"

[[models]]
name = "corrupt"
source = "{corrupt}"
""")
    server = start_server(config, port, tmp_path / "server.log", wait_ready=False)
    try:
        def settled() -> dict | None:
            try:
                models = {m["name"]: m for m in get(server, "/admin/api/status")["models"]}
            except httpx.HTTPError:
                return None
            return models if all(m["state"] in ("ready", "failed") for m in models.values()) else None

        models = wait_for(settled, timeout_s=300, interval_s=0.5)
        health = httpx.get(f"{server.url}/health", timeout=10)
        good = chat(server, "Name the first rule.")
        refused = {name: httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            for name in ("missing", "corrupt")}
        anthropic = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "corrupt", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    finally:
        assert server.stop() == 0, server.output()
    assert models[MODEL_NAME]["state"] == "ready" and good["prompt"] > 0
    assert models["missing"]["state"] == models["corrupt"]["state"] == "failed"
    assert "nowhere.gguf" in models["missing"]["error"]
    assert models["corrupt"]["error"]
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    for name, r in refused.items():
        assert r.status_code == 503, r.text
        assert name in r.json()["error"]["message"] and "not available" in r.json()["error"]["message"]
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    assert "Traceback" not in server.output()


def test_port_taken_at_start_exits_non_zero_with_the_reason(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path / "omlx.toml", port=port)
        server = start_server(config, port, tmp_path / "server.log", wait_ready=False)
        try:
            code = server.process.wait(EXIT_WAIT_S)
        finally:
            server.stop(signal.SIGKILL)
    assert code not in (0, None) and code > 0
    assert "address already in use" in server.output()
    assert "warmed up" not in server.output()  # it exits at once, not after loading the model
    assert "Traceback" not in server.output()


def test_sigterm_while_the_model_loads_exits_cleanly_without_waiting_for_it(tmp_path: Path):
    port = free_port()
    server = start_server(write_config(tmp_path / "omlx.toml", port=port), port, tmp_path / "server.log",
                          wait_ready=False)
    try:
        def starting() -> bool:
            try:
                r = httpx.get(f"{server.url}/health", timeout=2)
            except httpx.HTTPError:
                return False
            assert r.status_code == 503, "the model loaded before the test could stop it"
            return r.json()["status"] == "starting"

        wait_for(starting, timeout_s=EXIT_WAIT_S, interval_s=0.05)
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(EXIT_WAIT_S)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 0, server.output()
    assert "warmed up" not in server.output()
    assert "Traceback" not in server.output()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):
    """A server running one request at a time (so one held slot would stall everyone), with
    4 KB socket send buffers (so a client that stops reading pushes back on the server)."""
    root = tmp_path_factory.mktemp("faults")
    port = free_port()
    config = write_config(root / "omlx.toml", port=port)
    config.write_text(config.read_text().replace("max_running = 4", "max_running = 1"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        inject(monkeypatch, root, "small_sndbuf", root / "no-kv-fault")
        srv = start_server(config, port, root / "server.log")
    yield srv
    srv.stop()


def test_garbage_config_mid_run_keeps_the_last_good_one(small: Server):
    good = small.config.read_text()
    before = get(small, "/admin/api/status")["config"]["hash"]
    try:
        small.config.write_bytes(b"\x00\xff[[models]\nname = \x7f" + bytes(range(256)))
        err = wait_for(lambda: get(small, "/admin/api/status")["config"]["last_error"])
        assert get(small, "/admin/api/status")["config"]["hash"] == before
        assert err["message"]
        assert chat(small, "Name the first rule.")["prompt"] > 0
    finally:
        small.config.write_text(good)
    wait_for(lambda: get(small, "/admin/api/status")["config"]["last_error"] is None)
    assert get(small, "/admin/api/status")["config"]["hash"] == before


# --- clients ---------------------------------------------------------------------------

# At temperature 0 the model writes past 400 tokens for this prompt; the Anthropic and
# Responses APIs have no logit_bias to ban EOS with, so the prompt keeps the stream going.
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
STREAMS = {
    "chat": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": STORY, "max_tokens": 400,
                                      "temperature": 0, "stream": True, "logit_bias": NO_EOS}),
    "messages": ("/v1/messages", {"model": MODEL_NAME, "messages": STORY, "max_tokens": 400,
                                  "temperature": 0, "stream": True}),
    "responses": ("/v1/responses", {"model": MODEL_NAME, "input": STORY[0]["content"],
                                    "max_output_tokens": 400, "temperature": 0, "stream": True}),
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_client_leaving_mid_stream_frees_the_slot_for_the_next(small: Server, api: str):
    path, body = STREAMS[api]
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{small.url}{path}", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert live_requests(small) == 1
    wait_idle(small)
    assert chat(small, "Name the first rule.")["prompt"] > 0


def read_all(sock: socket.socket) -> bytes:
    """Returns what arrives until the server has sent nothing for a second."""
    sock.settimeout(1.0)
    chunks = []
    with contextlib.suppress(TimeoutError):
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def test_slow_reader_does_not_hold_the_batch_slot(small: Server):
    """A client that stops reading its stream: its request finishes generating into the
    server's buffers, and the next request gets the only slot while it still dawdles."""
    # 20 logprobs per token make each event ~2 KB: the stream outgrows the socket buffers.
    body = (b'{"model": "%s", "stream": true, "max_tokens": 120, "logit_bias": {"2": -100},'
            b' "logprobs": true, "top_logprobs": 20,'
            b' "messages": [{"role": "user", "content": "Count from one to one thousand."}]}' % MODEL_NAME.encode())
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # backpressure after a few KB
    try:
        slow.connect(("127.0.0.1", small.port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert slow.recv(64).startswith(b"HTTP/1.1 200")
        wait_for(lambda: live_requests(small) == 1, timeout_s=10)
        nxt = chat(small, "Name the first rule.")  # waits for the slot, then gets it
        assert nxt["prompt"] > 0
        wait_idle(small)
        unread = read_all(slow)  # the whole answer: far more than the two 4 KB socket buffers,
        assert len(unread) > 128 * 1024  # so the server held it while the engine went on
        assert b"data: [DONE]" in unread
    finally:
        slow.close()
    wait_idle(small)
    assert chat(small, "Name the last rule.")["prompt"] > 0
