"""Shared fixtures: the real tiny model, converted once into the checkout's ignored .cache/,
and a real `omlx serve` subprocess on a free port (bench/common.py's harness, the one the
benchmarks use)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.common import ServerProcess as Server
from bench.common import free_port, omlx_process

__all__ = ["Server", "free_port"]  # the tests import both from here

REPO = Path(__file__).resolve().parents[1]
MODEL_GGUF = REPO / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEST_CACHE = REPO / ".cache" / "test"  # ignored by git; reused across runs (no re-conversion)
MODEL_NAME = "smollm2-135m"
# A chat request's logit_bias that bans SmolLM2's <|im_end|> (EOS): its answer then runs to
# max_tokens, so a test can see a stream still going.
NO_EOS = {"2": -100}
SERVER_START_S = 600  # a first run converts the GGUF before serving


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No OMLX_* variable or ~/.omlx of the machine running the tests leaks in."""
    for key in list(os.environ):
        if key.upper().startswith("OMLX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


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
                 model_extra: str = "", cache_extra: str = "", server_extra: str = "",
                 context_tokens: int = 2048, max_running: int = 4, max_queued: int = 8,
                 drain_timeout_s: float = 5) -> Path:
    """Writes an omlx.toml serving the real model; returns its path."""
    cache_dir = cache_dir or own_cache_dir(path.parent)
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
drain_timeout_s = {drain_timeout_s}
{server_extra}

[[models]]
name = "{MODEL_NAME}"
source = "{MODEL_GGUF}"
max_context_tokens = {context_tokens}
{model_extra}

[cache]
dir = "{cache_dir}"
{cache_extra}

[batching]
max_running = {max_running}
max_queued = {max_queued}
prefill_chunk_tokens = 256
{extra}
""")
    return path


def start_server(config: Path, port: int, log: Path, *, wait_ready: bool = True) -> Server:
    """Returns `omlx serve` on `config` as a real subprocess, once /health says ok (at once
    when not `wait_ready`)."""
    server = omlx_process(config, port, log, stop_grace_s=60)
    return server.start(ready_timeout_s=SERVER_START_S, wait_ready=wait_ready)


def wait_for(predicate, timeout_s: float = 60, interval_s: float = 0.1):
    """Returns `predicate()`'s first truthy value, polled every `interval_s`; fails the test
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not reached in time")


def wait_healthy(server: Server, timeout_s: float = SERVER_START_S) -> None:
    """Returns once `server` answers /health with 200; raises RuntimeError otherwise."""
    server.wait_healthy(timeout_s)


@contextlib.contextmanager
def served(factory: pytest.TempPathFactory, name: str, **config: Any) -> Iterator[Server]:
    """Yields a real server on a fresh config (`write_config`'s options) in a temp dir named
    `name`, and stops it after: the body of a module-scoped server fixture."""
    root = factory.mktemp(name)
    port = free_port()
    server = start_server(write_config(root / "omlx.toml", port=port, **config), port, root / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server with the real model for the whole session (read-only tests)."""
    assert MODEL_GGUF.exists(), "run `make test` (it fetches the model) or `make model`"
    with served(tmp_path_factory, "server") as srv:
        yield srv


@pytest.fixture(scope="session")
def loaded_model():
    """The real model loaded in this process (float32 on CPU), for engine tests."""
    from appliance.models.loaded import load_model
    from appliance.spec import ModelSpec

    spec = ModelSpec(name=MODEL_NAME, source=str(MODEL_GGUF), max_context_tokens=2048)
    return load_model(spec, base_dir=REPO, cache_dir=TEST_CACHE)


def run_to_end(engine, requests: list, *, together: bool = False) -> None:
    """Submits `requests` (GenerationRequests) to a started engine (`together`: all in
    one step, so that one call starts them), reads every stream to its end, then stops
    the engine."""

    async def run() -> None:
        with engine._cond if together else contextlib.nullcontext():
            handles = [engine.submit(request) for request in requests]
        for handle in handles:
            async for _ in handle:
                pass

    try:
        asyncio.run(run())
    finally:
        engine.stop(drain_s=0)
