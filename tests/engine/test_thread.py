"""The engine's thread: jobs in order, work queued before the engine runs on the thread
that then runs the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from appliance.engine.engine import Engine
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.engine.thread import EngineThread
from appliance.spec import BatchingSpec


def test_jobs_run_in_order_on_one_thread_until_closed():
    thread = EngineThread("engine-test")
    seen: list[tuple[str, int]] = []
    for name in ("a", "b", "c"):
        thread.submit(lambda name=name: seen.append((name, threading.get_ident())))
    thread.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [name for name, _ in seen] == ["a", "b", "c"]
    assert {ident for _, ident in seen} == {thread.ident} != {threading.get_ident()}


def test_a_thread_never_started_joins_at_once():
    EngineThread("engine-test").join(timeout=0)  # an engine stopped before it started


@pytest.mark.slow
def test_work_queued_before_the_engine_runs_on_the_engine_s_thread(loaded_model):
    thread = EngineThread("engine-test")
    seen: list[int] = []
    thread.submit(lambda: seen.append(threading.get_ident()))
    engine = Engine(loaded_model, BatchingSpec(prefill_chunk_tokens=64), thread=thread)
    engine.on_finished = lambda _stats: seen.append(threading.get_ident())  # called on the engine's thread
    engine.start_warm()
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Hi"}]))

    async def main() -> str:
        handle = engine.submit(GenerationRequest(prompt, 4, SamplingParams(temperature=0)))
        async for _ in handle:
            pass
        return handle.finished.reason

    try:
        assert asyncio.run(main()) == "length"
    finally:
        engine.stop(drain_s=0)
    assert seen == [thread.ident, thread.ident]
    assert not thread.is_alive()
