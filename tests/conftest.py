"""Shared fixtures: the real tiny model, converted once into the checkout's ignored .cache/,
and a real `omlx serve` subprocess on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL_GGUF = REPO / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEST_CACHE = REPO / ".cache" / "test"  # ignored by git; reused across runs (no re-conversion)
MODEL_NAME = "smollm2-135m"
SERVER_START_S = 600  # a first run converts the GGUF before serving


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No OMLX_* variable or ~/.omlx of the machine running the tests leaks in."""
    for key in list(os.environ):
        if key.upper().startswith("OMLX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_cache_dir(root: Path) -> Path:
    """Returns a fresh cache dir under `root` that shares the converted model of every test.

    Each server needs its own KV store (a process locks its SSD tier), but converting
    the GGUF once per test would be slow.
    """
    cache_dir = root / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    (TEST_CACHE / "models").mkdir(parents=True, exist_ok=True)
    if not (cache_dir / "models").exists():
        (cache_dir / "models").symlink_to(TEST_CACHE / "models")
    return cache_dir


def write_config(path: Path, *, port: int, cache_dir: Path | None = None, extra: str = "",
                 model_extra: str = "", cache_extra: str = "", server_extra: str = "") -> Path:
    """Writes an omlx.toml serving the real model; returns its path."""
    cache_dir = cache_dir or own_cache_dir(path.parent)
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
drain_timeout_s = 5
{server_extra}

[[models]]
name = "{MODEL_NAME}"
source = "{MODEL_GGUF}"
max_context_tokens = 2048
{model_extra}

[cache]
dir = "{cache_dir}"
{cache_extra}

[batching]
max_running = 4
max_queued = 8
prefill_chunk_tokens = 256
{extra}
""")
    return path


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(config: Path, port: int, log: Path, *, wait_ready: bool = True) -> Server:
    """Starts `omlx serve` as a real subprocess and waits until /health says ok."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_")}
    env["PYTHONUNBUFFERED"] = "1"
    out = open(log, "wb")
    process = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(config)],
                               stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = Server(process, port, config, log)
    if wait_ready:
        wait_healthy(server)
    return server


def wait_healthy(server: Server, timeout_s: float = SERVER_START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"omlx serve exited with {server.process.returncode}:\n{server.output()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"omlx serve not healthy after {timeout_s} s:\n{server.output()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server with the real model for the whole session (read-only tests)."""
    assert MODEL_GGUF.exists(), "run `make test` (it fetches the model) or `make model`"
    root = tmp_path_factory.mktemp("server")
    port = free_port()
    srv = start_server(write_config(root / "omlx.toml", port=port), port, root / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def loaded_model():
    """The real model loaded in this process (float32 on CPU), for engine tests."""
    from appliance.models.loaded import load_model
    from appliance.spec import ModelSpec

    spec = ModelSpec(name=MODEL_NAME, source=str(MODEL_GGUF), max_context_tokens=2048)
    return load_model(spec, base_dir=REPO, cache_dir=TEST_CACHE)
