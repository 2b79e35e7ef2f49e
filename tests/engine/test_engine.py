"""The engine in process with the real model: batching, admission, cancellation, seeds."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from appliance.engine import scheduler
from appliance.engine.engine import Engine, EngineClosed, QueueFull
from appliance.engine.request import Delta, GenerationRequest, SamplingParams
from appliance.spec import BatchingSpec
from tests.conftest import run_to_end

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0)
QUESTIONS = ["What is the capital of France?", "Tell me a joke.", "What is 2+2?", "Name a color."]


@pytest.fixture
def engine(loaded_model):
    eng = Engine(loaded_model, BatchingSpec(max_running=3, max_queued=2, prefill_chunk_tokens=64)).start()
    yield eng
    eng.stop(drain_s=0)


def request(loaded_model, question: str, **kw) -> GenerationRequest:
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": question}]))
    kw.setdefault("max_tokens", 12)
    kw.setdefault("sampling", GREEDY)
    return GenerationRequest(prompt_tokens=prompt, **kw)


async def run(engine: Engine, req: GenerationRequest) -> tuple[list[int], str, str]:
    handle = engine.submit(req)
    tokens, text = [], ""
    async for event in handle:
        if isinstance(event, Delta):
            tokens += event.token_ids
            text += event.text
    return tokens, text, handle.finished.reason


def test_greedy_in_a_batch_equals_alone(engine, loaded_model):
    async def main():
        alone = [await run(engine, request(loaded_model, q)) for q in QUESTIONS]
        together = await asyncio.gather(*(run(engine, request(loaded_model, q)) for q in QUESTIONS))
        return alone, together

    alone, together = asyncio.run(main())
    assert [a[0] for a in alone] == [t[0] for t in together]
    assert "Paris" in alone[0][1]


def test_queue_full_is_refused_at_submit(engine, loaded_model):
    async def main():
        handles = [engine.submit(request(loaded_model, "Count to fifty.", max_tokens=40)) for _ in range(5)]
        with pytest.raises(QueueFull):
            engine.submit(request(loaded_model, "one more"))
        for h in handles:
            h.cancel()
        reasons = []
        for h in handles:
            async for _ in h:
                pass
            reasons.append(h.finished.reason)
        return reasons

    assert asyncio.run(main()) == ["cancelled"] * 5
    assert engine.num_live == 0


def test_cancel_frees_the_slot_for_the_next_request(engine, loaded_model):
    async def main():
        long = [engine.submit(request(loaded_model, "Count to fifty.", max_tokens=500)) for _ in range(3)]
        async for event in long[0]:  # wait until decoding is under way
            if isinstance(event, Delta):
                break
        for h in long:
            h.cancel()
        return await run(engine, request(loaded_model, QUESTIONS[0]))

    tokens, text, reason = asyncio.run(main())
    assert "Paris" in text and reason == "stop"
    assert engine.num_live == 0


def test_queued_requests_start_when_the_whole_batch_finishes_at_once(loaded_model):
    # Identical requests prefilled in one step end in the same step, leaving nothing
    # running: the queued ones must start then, not wait for a later request to wake the engine.
    engine = Engine(loaded_model, BatchingSpec(max_running=3, max_queued=2, prefill_chunk_tokens=512)).start()

    async def main():
        with engine._cond:  # all five arrive in one step, so the first three run in lockstep
            handles = [engine.submit(request(loaded_model, QUESTIONS[2], max_tokens=6)) for _ in range(5)]

        async def drain(handle):
            return [e.token_ids async for e in handle if isinstance(e, Delta)]

        return await asyncio.wait_for(asyncio.gather(*map(drain, handles)), timeout=120)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop(drain_s=0)
    assert len({str(r) for r in results}) == 1


def test_a_seeded_request_repeats_its_tokens_when_its_work_is_the_same(engine, loaded_model):
    """The guarantee (sampling.make_sampler): same seed, same prompt, computed the same way
    (here alone, without a cache) -> the same tokens, every time."""
    def seeded(seed: int) -> GenerationRequest:
        return request(loaded_model, "Write a poem.", max_tokens=24,
                       sampling=SamplingParams(temperature=1.0, seed=seed))

    async def main():
        return [(await run(engine, seeded(1234)))[0] for _ in range(3)], (await run(engine, seeded(4321)))[0]

    same, other_seed = asyncio.run(main())
    assert same[0] == same[1] == same[2]
    assert len(same[0]) == 24 and other_seed != same[0]


class OneSecondCalls:
    """The scheduler's clock: it moves a second a reading, so every prefill call takes one."""
    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        cls.now += 1.0
        return cls.now


def test_prefill_speed_is_the_calls_tokens_per_second_however_many_rows_share_one(loaded_model, monkeypatch):
    """Four prompts started in one call count their four prompts' tokens over that call's
    second: the speed that prices a recompute. Each request's own wait for its first token
    would count a quarter of that, and make restores look worth more than they are."""
    monkeypatch.setattr(scheduler, "time", OneSecondCalls)
    # Chunks sized by tokens only: timed, a call of a second would cut every prompt small.
    limits = BatchingSpec(max_running=4, prefill_chunk_tokens=512, prefill_step_ms=0)
    engine = Engine(loaded_model, limits).start()
    req = request(loaded_model, "Name a color. " * 20, max_tokens=2)  # over RATE_TOKENS
    run_to_end(engine, [req] * 4, together=True)  # all four in one step: one call starts them
    assert engine.prefill_tok_s == 4 * (len(req.prompt_tokens) - 1)  # the last token is decoded


def test_a_prefill_weighs_in_the_speed_by_its_seconds(loaded_model):
    """A memory hit's short tail, computed slowly, barely moves a long prompt's speed: the
    one a recompute of a long prefix is priced at."""
    engine = Engine(loaded_model, BatchingSpec())  # not started: the calls' timings are given
    engine._scheduler, slot = SimpleNamespace(last_prefilled={}), SimpleNamespace(uid=1)

    def prefilled(tokens: int, seconds: float) -> float:
        engine._scheduler.last_prefilled[slot.uid] = (tokens, seconds)
        engine._prefilled(slot)
        return engine.prefill_tok_s

    assert prefilled(25_000, 2.0) == pytest.approx(12_500)
    for _ in range(3):
        speed = prefilled(158, 0.1)  # 1,580 tok/s
    assert 11_000 < speed < 12_500
    engine.prefill_tok_s, engine._prefill_s = 10_000.0, None  # kept from an earlier run
    assert prefilled(5_000, 1.0) == pytest.approx(8_500)  # that speed weighs as a second's prefill


def test_an_idle_engine_gathers_requests_sent_together_into_one_start(loaded_model):
    """With `gather_ms`, a request that wakes an idle engine waits for the ones sent just
    after it, and they start in one prefill call; without, the first starts alone."""
    limits = BatchingSpec(max_running=4, prefill_chunk_tokens=512, gather_ms=400)
    engine = Engine(loaded_model, limits).start_warm()  # idle, not in its warm-up, when the first arrives
    req = request(loaded_model, QUESTIONS[2], max_tokens=4)

    async def main():
        first = asyncio.ensure_future(run(engine, req))
        await asyncio.sleep(0.1)  # well inside the quiet time the first one waits for
        return await asyncio.gather(first, run(engine, req))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop(drain_s=0)
    assert results[0] == results[1] and results[0][2] == "length"
    assert engine.num_prefill_calls == 1


def test_stopped_engine_refuses_new_requests(loaded_model):
    engine = Engine(loaded_model, BatchingSpec()).start()
    engine.stop(drain_s=0)

    async def main():
        engine.submit(request(loaded_model, "hi"))

    with pytest.raises(EngineClosed):
        asyncio.run(main())


def memory_cache(loaded_model, root, *, memory_bytes: int, block_tokens: int):
    """Returns a KVStore with a memory tier only, under `root`, and a ModelCache of the
    test model on it."""
    from appliance.cache.kv import probe_layout
    from appliance.cache.model_cache import ModelCache
    from appliance.cache.store import KVStore

    store = KVStore(root=root / "kv", memory_bytes=memory_bytes, host_bytes=0, ssd_bytes=0)
    return store, ModelCache(store, weights="cd" * 32, compute_dtype="float32",
                             layout=probe_layout(loaded_model.model), block_tokens=block_tokens)


def test_a_long_prompt_is_saved_chunk_by_chunk_as_it_prefills(loaded_model, tmp_path, monkeypatch):
    """The prompt's KV blocks are copied out after each prefill chunk, at most a chunk's
    worth a step, never all in one step after it (one step copying a 25K-token prompt
    stalled decoding on a GPU); each block once, and a repeat restores them exactly."""
    block, chunk = 16, 64
    store, cache = memory_cache(loaded_model, tmp_path, memory_bytes=256 << 20, block_tokens=block)
    saves, seen = [], {}
    real = cache.save_all

    def spy(savings):
        first = seen.get("stats") is not None and seen["stats"].first_token_at is not None
        saves.extend((s.skip_tokens, len(s.tokens), first) for s in savings)
        return real(savings)

    monkeypatch.setattr(cache, "save_all", spy)
    # Chunks sized by tokens (a lone prompt's time slice would span several of them).
    limits = BatchingSpec(max_running=2, max_queued=2, prefill_chunk_tokens=chunk, prefill_step_ms=0)
    eng = Engine(loaded_model, limits, cache=cache).start()
    prompt = tuple(range(1000, 1600))  # 600 tokens: chunks of 64, then the rest at once
    full = len(prompt) // block * block
    try:
        async def go():
            handle = eng.submit(GenerationRequest(prompt_tokens=prompt, max_tokens=3, sampling=GREEDY))
            seen["stats"] = handle.stats
            tokens = [t async for e in handle if isinstance(e, Delta) for t in e.token_ids]
            return tokens, handle.stats

        first, _ = asyncio.run(go())
        before_first = [s for s in saves if not s[2]]
        assert len(before_first) >= 3  # one per chunk, not one at the end
        assert max(n - skip for skip, n, _ in saves[:-1]) <= chunk  # the last one: the finish
        # Each block was copied once: the prompt's full ones, then the tail at the finish.
        assert cache.counters["saved_blocks"] == full // block + 1
        again, stats = asyncio.run(go())
        assert stats.cached_tokens == len(prompt) - 1  # the tail block too; one token is left to run
        assert again == first
    finally:
        eng.stop(drain_s=0)
        store.close()


@pytest.mark.parametrize("quiet_s, pins_after", [(30.0, False), (0.3, True)])
def test_an_idle_engine_pins_host_memory_only_after_a_quiet_spell(loaded_model, tmp_path, monkeypatch, quiet_s,
                                                                    pins_after):
    """Pinning (the native KV path's host slots, made ahead of need) holds the engine up
    for tens of ms a slot: it waits for `IDLE_QUIET_S` without steps or arrivals, so the
    gaps between one request and the next of a busy server stay free of it."""
    from appliance.engine import engine as engine_module

    store, cache = memory_cache(loaded_model, tmp_path, memory_bytes=64 << 20, block_tokens=16)
    pinned: list[float] = []  # when each slot was pinned (no CUDA here: the pool is injected)
    monkeypatch.setattr(store, "wants_pinned", lambda: len(pinned) < 3)
    monkeypatch.setattr(store, "pin_one", lambda: pinned.append(time.monotonic()))
    monkeypatch.setattr(engine_module, "IDLE_QUIET_S", quiet_s)
    eng = Engine(loaded_model, BatchingSpec(max_running=2), cache=cache).start_warm()
    try:
        for question in QUESTIONS[:2]:  # two requests in a row: no pinning before, between or during them
            _, _, reason = asyncio.run(run(eng, request(loaded_model, question, max_tokens=4)))
            assert reason == "length" and pinned == []
        finished = time.monotonic()
        deadline = finished + (10 if pins_after else 1.5)
        while len(pinned) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        if pins_after:
            assert len(pinned) == 3 and pinned[0] >= finished
        else:
            assert pinned == []
    finally:
        eng.stop(drain_s=0)
        store.close()


@pytest.mark.parametrize("message, lost", [
    ("cudaMemcpy(data, buf.data, buf.size, kind) failed: an illegal memory access was encountered", True),
    ("cuGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: unspecified launch failure", True),
    ("cudaMallocAsync(&data, size, stream) failed: out of memory", False),  # fails one batch only
    ("[reshape] Cannot reshape array of size 6 into shape (4,).", False),
])
def test_only_cuda_sticky_errors_count_as_a_lost_gpu(message, lost):
    from appliance.engine.engine import device_lost

    assert device_lost(RuntimeError(message)) is lost


@pytest.fixture
def as_on_gpus(monkeypatch):
    """Engines run their idle work soon after their last work (`idle_shapes = "on"` runs
    the call shapes here as on CUDA)."""
    from appliance.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_QUIET_S", 0.3)
    return engine_module


def wait_for_shapes(eng: Engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while eng.shapes_to_warm and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.shapes_to_warm == 0


def test_an_idle_engine_runs_the_call_shapes(loaded_model, as_on_gpus, caplog):
    """Each shape runs as a wave of short prompts would start, while nothing else does; a
    request before them and after them gets the same answer, and none is counted."""
    limits = BatchingSpec(max_running=4, prefill_chunk_tokens=64, idle_shapes="on")
    eng = Engine(loaded_model, limits).start_warm()
    try:
        with caplog.at_level("INFO", logger="omlx.engine"):
            first = asyncio.run(run(eng, request(loaded_model, QUESTIONS[0])))
            wait_for_shapes(eng)
            assert "ran its idle call shapes" in caplog.text
        assert len(eng.recent) == 1  # the shapes are no request
        assert asyncio.run(run(eng, request(loaded_model, QUESTIONS[0]))) == first
    finally:
        eng.stop(drain_s=0)


def test_a_failed_start_shape_leaves_the_rest_to_requests(loaded_model, as_on_gpus, monkeypatch):
    def fail(*args):
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(as_on_gpus, "run_shape", fail)
    eng = Engine(loaded_model, BatchingSpec(max_running=4, prefill_chunk_tokens=64, idle_shapes="on")).start_warm()
    try:
        wait_for_shapes(eng)
        _, text, reason = asyncio.run(run(eng, request(loaded_model, QUESTIONS[0])))
        assert reason == "stop" and "Paris" in text
    finally:
        eng.stop(drain_s=0)


def test_an_engine_of_compiled_blocks_decodes_as_the_plain_one(loaded_model):
    """`compile_blocks = "on"`: the engine's decode passes (batch caches) run the compiled
    calls, and a batch's greedy tokens are the plain model's."""
    from appliance.models.loaded import load_model
    from tests.conftest import REPO, TEST_CACHE

    compiled = load_model(loaded_model.spec.model_copy(update={"compile_blocks": "on"}), base_dir=REPO,
                          cache_dir=TEST_CACHE)

    def answers(model) -> list[list[int]]:
        eng = Engine(model, BatchingSpec(max_running=4)).start()
        try:
            async def main():
                return await asyncio.gather(*(run(eng, request(model, q)) for q in QUESTIONS))
            return [tokens for tokens, _, _ in asyncio.run(main())]
        finally:
            eng.stop(drain_s=0)

    assert answers(compiled) == answers(loaded_model)
    assert "_compiled_parts" in compiled.model.model.layers[0].__dict__


def test_idle_shapes_turned_off_live_leave_the_rest(loaded_model, monkeypatch):
    from appliance.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_QUIET_S", 30.0)  # none starts within the test
    limits = BatchingSpec(max_running=4, prefill_chunk_tokens=64, idle_shapes="on")
    eng = Engine(loaded_model, limits).start_warm()
    try:
        assert eng.shapes_to_warm > 0
        eng.set_limits(limits.model_copy(update={"idle_shapes": "off"}))
        assert eng.shapes_to_warm == 0 and eng._idle_work() is None
    finally:
        eng.stop(drain_s=0)
