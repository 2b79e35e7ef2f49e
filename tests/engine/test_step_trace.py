"""The step trace: one JSON line per engine step, written only when OMLX_STEP_TRACE is set."""

from __future__ import annotations

import threading

import orjson
import pytest

from appliance.engine import step_trace
from appliance.engine.engine import Engine
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.engine.step_trace import ENV, StepTrace
from appliance.spec import BatchingSpec
from tests.conftest import run_to_end


def lines(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_unset_means_no_trace(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert StepTrace.from_env() is None


def test_threads_append_whole_lines_to_one_shared_file(tmp_path, monkeypatch):
    monkeypatch.setattr(step_trace, "_shared", {})
    monkeypatch.setenv(ENV, str(tmp_path / "steps.jsonl"))
    trace = StepTrace.from_env()
    assert StepTrace.from_env() is trace  # every engine of the process writes to one file

    def write(model: str) -> None:
        for i in range(200):
            trace.write(model, {"i": i, "pad": "x" * 300})

    threads = [threading.Thread(target=write, args=(name,)) for name in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = lines(tmp_path / "steps.jsonl")
    assert len(records) == 600
    for name in ("a", "b", "c"):
        assert [r["i"] for r in records if r["model"] == name] == list(range(200))


@pytest.mark.slow
def test_an_engine_writes_a_line_a_step(loaded_model, tmp_path, monkeypatch):
    monkeypatch.setattr(step_trace, "_shared", {})
    monkeypatch.setenv(ENV, str(tmp_path / "steps.jsonl"))
    engine = Engine(loaded_model, BatchingSpec(max_running=4, prefill_chunk_tokens=64)).start()
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Name a color."}]))

    run_to_end(engine, [GenerationRequest(prompt, 5, SamplingParams(temperature=0))])
    records = [r for r in lines(tmp_path / "steps.jsonl") if r["model"] == loaded_model.name]
    assert len(records) == engine.num_steps
    assert records[0]["started"] == 1 and records[0]["prefill_calls"] >= 1
    assert sum(r["tokens_out"] for r in records) == 5
    assert set(records[0]["phases_ms"]) == {"admit", "start", "decode", "deliver", "advance", "save"}
    assert all(r["cpu_ms"] > 0 for r in records)
    assert all(r["small_matmul"] is None for r in records)  # chosen only where our kernel runs (CUDA, auto)
