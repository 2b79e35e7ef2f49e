"""The cache with the real model in process: restores are exact, from every tier, across restarts."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_lm.models.cache
import pytest

from appliance.cache.kv import probe_layout
from appliance.cache.model_cache import ModelCache, request_tenant
from appliance.cache.store import KVStore
from appliance.engine.engine import Engine
from appliance.engine.request import Delta, GenerationRequest, SamplingParams
from appliance.spec import BatchingSpec

pytestmark = pytest.mark.slow

BLOCK = 64
MIB = 1 << 20
# Source text from the pinned mlx-lm, not from omlx: an edit here must not move where
# two prompts' shared prefix ends relative to a block boundary.
CONTEXT = Path(mlx_lm.models.cache.__file__).read_text()[:1500]


class Rig:
    """An engine over a KV store rooted in `root`, with the given tier budgets."""

    def __init__(self, loaded, root: Path, *, memory: int = 256 * MIB, host: int = 256 * MIB,
                 ssd: int = 1 << 30):
        self.loaded = loaded
        self.store = KVStore(root=root, memory_bytes=memory, host_bytes=host, ssd_bytes=ssd)
        self.store.probe_ssd()  # as the runtime does once a model has loaded
        self.cache = ModelCache(self.store, weights="ab" * 32, compute_dtype="float32",
                                layout=probe_layout(loaded.model), block_tokens=BLOCK)
        self.pool = ThreadPoolExecutor(2)
        self.engine = Engine(loaded, BatchingSpec(max_running=4, max_queued=4, prefill_chunk_tokens=64),
                             cache=self.cache, prefetcher=self.pool).start_warm()

    def prompt(self, question: str, context: str = CONTEXT) -> tuple[int, ...]:
        return tuple(self.loaded.encode_chat([
            {"role": "system", "content": f"You review this code:\n{context}"},
            {"role": "user", "content": question}]))

    def run(self, *prompts: tuple[int, ...], tenant: str = "default") -> list[dict]:
        async def one(p):
            handle = self.engine.submit(GenerationRequest(
                prompt_tokens=p, max_tokens=8, sampling=SamplingParams(temperature=0), tenant=tenant))
            tokens = []
            async for event in handle:
                if isinstance(event, Delta):
                    tokens += event.token_ids
            return {"tokens": tokens, "cached": handle.stats.cached_tokens,
                    "tiers": handle.stats.cached_by_tier, "prompt": len(p)}

        async def all_of():
            return await asyncio.gather(*(one(p) for p in prompts))

        return asyncio.run(all_of())

    def close(self) -> None:
        self.engine.stop(drain_s=0)
        self.store.flush()
        self.store.close()
        self.pool.shutdown()


@pytest.fixture
def rigs(loaded_model):
    made: list[Rig] = []

    def make(root: Path, **budgets) -> Rig:
        rig = Rig(loaded_model, root, **budgets)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


@pytest.mark.parametrize("tier, budgets", [
    ("memory", {}),
    ("host", {"memory": 0}),
    ("ssd", {"memory": 0, "host": 0}),
])
def test_restored_prefix_gives_the_cold_tokens_from_each_tier(rigs, tmp_path, tier, budgets):
    rig = rigs(tmp_path / "kv", **budgets)
    prompt = rig.prompt("What does this code do?")
    (cold,) = rig.run(prompt)
    rig.store.flush()
    (warm,) = rig.run(prompt)
    assert cold["cached"] == 0
    assert warm["cached"] == len(prompt) - 1
    assert warm["tiers"] == {tier: len(prompt) - 1}
    assert warm["tokens"] == cold["tokens"]


def test_restart_restores_from_the_ssd(rigs, tmp_path):
    first = rigs(tmp_path / "kv")
    prompt = first.prompt("List the classes defined here.")
    (cold,) = first.run(prompt)
    first.close()
    second = rigs(tmp_path / "kv")
    (warm,) = second.run(prompt)
    assert warm["tiers"] == {"ssd": len(prompt) - 1}
    assert warm["tokens"] == cold["tokens"]


def restarted_on_a_slow_disk(rigs, root: Path, monkeypatch) -> tuple[Rig, tuple[int, ...], dict, list, list]:
    """Returns a rig restarted on `root` after it answered a prompt, whose SSD reads take
    0.5 s more each (room for the engine to start a restore meanwhile, even on a slow
    machine); the prompt, its cold answer, when each read ended and when each restore
    began."""
    first = rigs(root)
    prompt = first.prompt("List the classes defined here.")
    (cold,) = first.run(prompt)
    first.close()
    second = rigs(root)
    read, done_at = second.store.ssd.get, []

    def slow_get(key, **kwargs):
        time.sleep(0.5)
        block = read(key, **kwargs)
        done_at.append(time.perf_counter())
        return block

    fetch_all, fetching_at = second.store.fetch_all, []

    def timed_fetch_all(*args, **kwargs):
        fetching_at.append(time.perf_counter())
        return fetch_all(*args, **kwargs)

    monkeypatch.setattr(second.store.ssd, "get", slow_get)
    monkeypatch.setattr(second.store, "fetch_all", timed_fetch_all)
    return second, prompt, cold, done_at, fetching_at


def test_a_lone_request_restores_while_its_blocks_are_read(rigs, tmp_path, monkeypatch):
    """After a restart on a slow disk, the request starts before its prefetch is done: its
    restore moves the blocks read first while the rest are read."""
    rig, prompt, cold, done_at, fetching_at = restarted_on_a_slow_disk(rigs, tmp_path / "kv", monkeypatch)
    (warm,) = rig.run(prompt)
    assert warm["tiers"] == {"ssd": len(prompt) - 1}
    assert warm["tokens"] == cold["tokens"]
    assert len(done_at) == -(-(len(prompt) - 1) // BLOCK)  # every block read once
    assert fetching_at[0] < max(done_at)


def test_beside_a_running_request_a_restore_waits_for_its_reads(rigs, tmp_path, monkeypatch):
    """Its reads must not stall the running request's decode: it starts once they are done."""
    rig, prompt, cold, done_at, fetching_at = restarted_on_a_slow_disk(rigs, tmp_path / "kv", monkeypatch)
    other = rig.prompt("Write a long poem about the sea.", context="Nothing to review.")

    async def both():
        running = rig.engine.submit(GenerationRequest(prompt_tokens=other, max_tokens=200,
                                                      sampling=SamplingParams(temperature=0)))
        events = running.__aiter__()
        await events.__anext__()  # it runs: its first token is out
        restoring = rig.engine.submit(GenerationRequest(prompt_tokens=prompt, max_tokens=8,
                                                        sampling=SamplingParams(temperature=0)))
        tokens = [t async for event in restoring if isinstance(event, Delta) for t in event.token_ids]
        async for _ in events:
            pass
        return tokens, restoring.stats

    tokens, stats = asyncio.run(both())
    # (its first block may come from memory: the other request restored the chat template's start from it)
    assert sum(stats.cached_by_tier.values()) == len(prompt) - 1
    assert stats.cached_by_tier["ssd"] >= len(prompt) - 1 - BLOCK
    assert tokens == cold["tokens"]
    assert fetching_at[-1] >= max(done_at)


def test_a_longer_prompt_restores_the_shared_prefix(rigs, tmp_path):
    rig = rigs(tmp_path / "kv")
    short = rig.prompt("Summarize.")
    (first,) = rig.run(short)
    turn2 = rig.prompt("Summarize.") + tuple(first["tokens"]) + rig.prompt("And now in French.")[-12:]
    (second,) = rig.run(turn2)
    assert second["cached"] >= len(short) - 1
    alone = rigs(tmp_path / "cold")
    (cold,) = alone.run(turn2)
    assert second["tokens"] == cold["tokens"]


def test_budgets_are_never_exceeded_and_demotion_keeps_blocks(rigs, tmp_path):
    rig = rigs(tmp_path / "kv", memory=8 * MIB, host=8 * MIB, ssd=40 * MIB)
    prompts = [rig.prompt(q, context=CONTEXT[i * 100:]) for i, q in enumerate(["A?", "B?", "C?"])]
    for p in prompts:
        rig.run(p)
    rig.store.flush()
    stats = rig.store.stats()
    for tier in ("memory", "host", "ssd"):
        assert stats[tier]["bytes"] <= stats[tier]["budget_bytes"], tier
    assert stats["memory"]["evictions"] > 0 and stats["host"]["blocks"] > 0
    rig.store.resize(memory_bytes=3 * MIB, host_bytes=0, ssd_bytes=12 * MIB)
    stats = rig.store.stats()
    assert stats["memory"]["bytes"] <= 3 * MIB and stats["host"]["bytes"] == 0
    assert stats["ssd"]["bytes"] <= 12 * MIB and stats["ssd"]["evictions"] > 0


def test_a_flipped_byte_is_a_miss_not_wrong_output(rigs, tmp_path):
    first = rigs(tmp_path / "kv")
    prompt = first.prompt("Find a bug.")
    (cold,) = first.run(prompt)
    first.close()
    files = sorted((tmp_path / "kv").rglob("*.kv"), key=lambda f: f.stat().st_mtime_ns)
    victim = files[1]  # the second block of the chain
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    second = rigs(tmp_path / "kv")
    (warm,) = second.run(prompt)
    assert warm["tokens"] == cold["tokens"]
    assert warm["cached"] < len(prompt) - 1
    assert second.store.stats()["ssd"]["misses"].get("corrupt") == 1
    second.close()  # the recompute wrote the block again, correct this time
    (healed,) = rigs(tmp_path / "kv").run(prompt)
    assert healed["cached"] == len(prompt) - 1 and healed["tokens"] == cold["tokens"]


def test_concurrent_requests_sharing_a_prefix(rigs, tmp_path):
    rig = rigs(tmp_path / "kv")
    a, b = rig.prompt("What does this code do?"), rig.prompt("Who wrote this code?")
    together = rig.run(a, b)
    cold = rigs(tmp_path / "cold")
    assert [r["tokens"] for r in together] == [cold.run(a)[0]["tokens"], cold.run(b)[0]["tokens"]]
    (later,) = rig.run(rig.prompt("Is this code tested?"))
    assert later["cached"] >= (len(a) - 20) // BLOCK * BLOCK  # the shared system prompt's blocks


def test_requests_finishing_together_are_saved_with_one_wait(rigs, tmp_path, monkeypatch):
    import mlx.core as mx

    from appliance.cache import model_cache

    rig = rigs(tmp_path / "kv", host=0, ssd=0)
    model = rig.loaded.model
    a, b = rig.prompt("What does this code do?"), rig.prompt("Who maintains this code?")
    caches = []
    for p in (a, b):
        caches.append(mlx_lm.models.cache.make_prompt_cache(model))
        model(mx.array(p)[None], cache=caches[-1])
    waits = []
    real_eval = mx.eval
    monkeypatch.setattr(model_cache.mx, "eval", lambda *args: waits.append(1) or real_eval(*args))
    saved = rig.cache.save_all([model_cache.Saving(caches[0], a), model_cache.Saving(caches[1], b)])
    assert len(waits) == 2  # the blocks' copies, then their bytes: not two per request
    shared = model_cache.common_prefix(a, b) // BLOCK  # the full blocks both hold: cut once
    assert saved == rig.cache.counters["saved_blocks"] == -(-len(a) // BLOCK) + -(-len(b) // BLOCK) - shared
    for p in (a, b):
        assert rig.cache.lookup(p).num_tokens == len(p) - 1


def test_tenants_never_share_blocks(rigs, tmp_path):
    rig = rigs(tmp_path / "kv")
    prompt = rig.prompt("Explain the eviction policy.")
    alice, bob = request_tenant("alice"), request_tenant("bob")
    assert rig.run(prompt, tenant=alice)[0]["cached"] == 0
    assert rig.run(prompt, tenant=bob)[0]["cached"] == 0
    assert rig.run(prompt, tenant=alice)[0]["cached"] == len(prompt) - 1


def test_with_every_tier_at_zero_no_block_is_cut(rigs, tmp_path):
    rig = rigs(tmp_path / "kv", memory=0, host=0, ssd=0)
    prompt = rig.prompt("What is tested?")
    (cold,) = rig.run(prompt)
    (again,) = rig.run(prompt)
    assert again["cached"] == 0 and again["tokens"] == cold["tokens"]
    assert rig.cache.counters["saved_blocks"] == 0


def test_restore_is_skipped_when_recomputing_is_faster(rigs, tmp_path):
    rig = rigs(tmp_path / "kv", memory=0, host=0)
    prompt = rig.prompt("What is tested?")
    rig.run(prompt)
    rig.store.flush()
    rig.store.rates["ssd"].value = 1.0  # an absurdly slow disk: 1 byte/s
    rig.engine.prefill_tok_s = 100.0
    (warm,) = rig.run(prompt)
    assert warm["cached"] == 0
    assert rig.cache.counters["recompute_chosen"] == 1


@pytest.mark.parametrize("faster, restored", [(1.2, False), (2.0, True)])
def test_an_ssd_hit_must_beat_recomputing_by_a_margin(rigs, tmp_path, faster, restored):
    """An SSD restore estimated `faster` times faster than recomputing is chosen only
    beyond SSD_RISK: its real speed varies with the machine's load."""
    from appliance.cache.model_cache import SSD_RISK

    assert 1.2 < SSD_RISK < 2.0
    rig = rigs(tmp_path / "kv", memory=0, host=0)
    prompt = rig.prompt("What is tested?")
    rig.run(prompt)
    rig.store.flush()
    per_token_s = rig.store.restore_s("ssd", rig.engine.cache.layout.bytes_per_token)
    rig.engine.prefill_tok_s = 1 / (per_token_s * faster)
    (warm,) = rig.run(prompt)
    assert (warm["cached"] > 0) == restored
    assert rig.cache.last_decision["ssd_risk"] == SSD_RISK


@pytest.mark.parametrize("call_s, restored", [(0.5, False), (0.001, True)])
def test_a_hit_must_pay_for_the_restore_call_itself(rigs, tmp_path, call_s, restored):
    """A restore costs a measured fixed time beyond its bytes (looking up, assembling the
    cache, a device wait): a memory hit whose recompute is cheaper than that is recomputed."""
    rig = rigs(tmp_path / "kv")
    prompt = rig.prompt("What is tested?")
    rig.run(prompt)
    rig.engine.prefill_tok_s = len(prompt) / 0.2  # recomputing the prompt takes 0.2 s
    rig.cache.restore_call_s = call_s
    (warm,) = rig.run(prompt)
    assert (warm["cached"] > 0) == restored
    assert rig.cache.last_decision["restore_call_s"] == call_s
    if restored:  # measured again on that restore, from memory
        assert rig.cache.restore_call_s != call_s


@pytest.mark.parametrize("restart", [False, True])
def test_a_new_question_restores_the_whole_shared_context(rigs, tmp_path, restart):
    from appliance.cache.model_cache import common_prefix

    rig = rigs(tmp_path / "kv")
    first, second = rig.prompt("What does this code do?"), rig.prompt("Who maintains this code?")
    rig.run(first)
    if restart:
        rig.close()
        rig = rigs(tmp_path / "kv")
    (warm,) = rig.run(second)
    shared = common_prefix(first, second)
    assert shared % BLOCK != 0  # the shared part ends inside a block
    assert warm["cached"] == shared
    (cold,) = rigs(tmp_path / "cold").run(second)
    assert warm["tokens"] == cold["tokens"]


def test_an_aligned_lookup_keeps_whole_multiples_and_shortens_its_last_hit():
    from appliance.cache.model_cache import Hit, Lookup

    hits = tuple(Hit(bytes([i]), b"", tuple(range(64)), "memory", use) for i, use in enumerate((64, 64, 40)))
    lookup = Lookup(hits, "alice")
    assert [h.use_tokens for h in lookup.aligned(32).hits] == [64, 64, 32]
    assert [h.use_tokens for h in lookup.aligned(128).hits] == [64, 64]
    assert [h.use_tokens for h in lookup.aligned(96).hits] == [64, 32]
    assert lookup.aligned(256).hits == ()
    assert lookup.aligned(1) is lookup
    assert lookup.aligned(8) is lookup  # 168 tokens: whole eights already
    assert lookup.aligned(32).tenant == "alice"


def test_where_calls_come_in_shapes_a_restore_covers_whole_shapes(rigs, tmp_path):
    """On MLX CUDA (Engine.whole_tokens > 1) the restored prefix is a multiple of the shape
    and the rest is recomputed: its length joins the keys of the call starting the prompt,
    and MLX CUDA builds an attention graph per shape."""
    from appliance.cache.model_cache import common_prefix

    rig = rigs(tmp_path / "kv")
    rig.engine.whole_tokens = 32
    first, second = rig.prompt("What does this code do?"), rig.prompt("Who maintains this code?")
    rig.run(first)
    (warm,) = rig.run(second)
    shared = common_prefix(first, second)
    assert shared % 32 != 0
    assert warm["cached"] == shared // 32 * 32
    (cold,) = rigs(tmp_path / "cold").run(second)
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.parametrize("shape, saved", [(1, True), (BLOCK, False)])
def test_where_calls_come_in_shapes_only_whole_shapes_are_saved(rigs, tmp_path, shape, saved):
    """A chat shorter than one shape leaves nothing a later restore could use: nothing is cut."""
    rig = rigs(tmp_path / "kv")
    rig.engine.whole_tokens = shape
    prompt = rig.prompt("Hi.", context="x = 1")
    assert len(prompt) + 8 < BLOCK
    rig.run(prompt)
    assert (rig.cache.counters["saved_blocks"] > 0) == saved


def test_a_cache_attached_to_a_running_engine_serves_from_then_on(rigs, tmp_path):
    """First sight of a large model attaches its cache after readiness (the weights'
    fingerprint still hashing): requests before run without it, later ones use it, and the
    engine takes the prefill speed the store kept."""
    rig = rigs(tmp_path / "kv")
    cache, rig.engine.cache = rig.engine.cache, None
    prompt = rig.prompt("What is tested?")
    assert rig.run(prompt)[0]["cached"] == 0
    assert rig.run(prompt)[0]["cached"] == 0  # no cache: nothing was saved
    rig.store.prefill_tok_s[cache.dir] = 1234.0
    rig.engine.prefill_tok_s = None
    rig.engine.attach(cache)
    assert rig.engine.prefill_tok_s == 1234.0
    rig.run(prompt)
    assert rig.run(prompt)[0]["cached"] > 0
