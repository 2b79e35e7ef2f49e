import logging
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from appliance.cache.keys import KeySpace, KVLayout, key_space
from appliance.cache.kv import KVBlock, from_payload
from appliance.cache.store import HOST, MEMORY, SSD, HostBlock, KVStore, Rate

LAYERS, HEADS, DIM, B = 2, 2, 8, 4
LAYOUT = KVLayout(num_layers=LAYERS, kv_heads=HEADS, k_head_dim=DIM, v_head_dim=DIM, dtype="float32",
                  itemsize=4)
SPACE = key_space(weights="ab" * 32, compute_dtype="float32", layout=LAYOUT, block_tokens=B)
GROUP = SPACE.group
BLOCK_BYTES = LAYOUT.bytes_per_token * B  # 1 KiB: keys and values of 4 tokens
MIB = 2**20


def make_blocks(n: int, *, first_token: int = 0, seed: int = 0, space: KeySpace = SPACE) -> list[KVBlock]:
    """Returns a chain of `n` full blocks of random float32 KV."""
    rng = np.random.default_rng(seed)
    tokens = list(range(first_token, first_token + n * B))
    blocks, parent = [], space.root
    for i, key in enumerate(space.chain(tokens)):
        keys = mx.array(rng.standard_normal((LAYERS, HEADS, B, DIM), dtype=np.float32))
        values = mx.array(rng.standard_normal((LAYERS, HEADS, B, DIM), dtype=np.float32))
        blocks.append(KVBlock(key, parent, tuple(tokens[i * B:(i + 1) * B]), keys, values))
        parent = key
    mx.eval([(b.keys, b.values) for b in blocks])
    return blocks


def same_kv(a: KVBlock, b: KVBlock) -> bool:
    return (a.key == b.key and a.tokens == b.tokens
            and np.array_equal(np.array(a.keys.view(mx.uint8)), np.array(b.keys.view(mx.uint8)))
            and np.array_equal(np.array(a.values.view(mx.uint8)), np.array(b.values.view(mx.uint8))))


def fetch(store: KVStore, block: KVBlock, group: str = GROUP) -> tuple[KVBlock, str] | None:
    return store.fetch(block.key, group=group, parent=block.parent, tokens=block.tokens)


def open_store(root: Path, *, memory: int = 2, host: int = 2, ssd: int = 64) -> KVStore:
    """Returns a store whose budgets are counted in blocks."""
    return KVStore(root=root, memory_bytes=memory * BLOCK_BYTES, host_bytes=host * BLOCK_BYTES,
                   ssd_bytes=ssd * MIB)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "kv")
    yield s
    s.close()


def only_on_ssd(store: KVStore) -> None:
    """Flushes, then empties memory and host (their blocks are on the SSD already)."""
    assert store.flush(timeout_s=10)
    memory, host = store.memory.budget_bytes, store.host.budget_bytes
    ssd = store.stats()[SSD]["budget_bytes"]
    store.resize(memory_bytes=0, host_bytes=0, ssd_bytes=ssd)
    store.resize(memory_bytes=memory, host_bytes=host, ssd_bytes=ssd)
    assert len(store.memory) == 0 and len(store.host) == 0


# --- save and demotion -------------------------------------------------------------


def test_save_puts_blocks_in_memory_and_writes_them_through(store):
    blocks = make_blocks(2)
    store.save(blocks, group=GROUP)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [MEMORY, MEMORY]
    assert store.flush(timeout_s=10)
    assert all(store.ssd.contains(b.key, group=GROUP) for b in blocks)
    assert store.stats()[SSD]["blocks"] == 2 and store.stats()[SSD]["writer"]["written"] == 2
    assert store.memory.get(blocks[0].key).group == GROUP


def test_memory_pressure_demotes_the_oldest_block_to_host(store):
    blocks = make_blocks(3)
    store.save(blocks, group=GROUP)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, MEMORY, MEMORY]
    assert blocks[0].key not in store.memory  # a block lives in memory or host, not both
    host = store.host.get(blocks[0].key)
    assert isinstance(host, HostBlock) and host.origin == HOST
    assert (host.group, host.parent, host.tokens) == (GROUP, SPACE.root, blocks[0].tokens)
    assert host.nbytes == BLOCK_BYTES and host.payload.dtype == np.uint8
    back = from_payload(host.key, host.parent, host.tokens, host.meta, host.payload)
    assert same_kv(back, blocks[0])


def test_host_pressure_drops_blocks_the_ssd_holds_without_writing_them_again(store):
    blocks = make_blocks(6)
    store.save(blocks, group=GROUP)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [SSD, SSD, HOST, HOST, MEMORY, MEMORY]
    assert store.stats()[SSD]["writer"]["submitted"] == 6  # one write per block, none on spill


def test_host_pressure_spills_blocks_absent_from_the_ssd(store):
    blocks = make_blocks(6)
    for b in blocks:  # as fetch does: into memory without writing through
        store.put_memory(b, GROUP)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [SSD, SSD, HOST, HOST, MEMORY, MEMORY]
    assert store.stats()[SSD]["writer"]["submitted"] == 2
    assert not store.ssd.contains(blocks[2].key, group=GROUP)
    only_on_ssd(store)
    got = fetch(store, blocks[0])
    assert got is not None and got[1] == SSD and same_kv(got[0], blocks[0])


def test_a_block_larger_than_memory_goes_straight_to_host(tmp_path):
    store = open_store(tmp_path / "kv", memory=0, host=2)
    try:
        (block,) = make_blocks(1)
        store.save([block], group=GROUP)
        assert store.tier_of(block.key, GROUP) == HOST
        got = fetch(store, block)
        assert got is not None and got[1] == HOST and same_kv(got[0], block)
        assert store.tier_of(block.key, GROUP) == HOST  # still too large for memory
    finally:
        store.close()


# --- fetch and prefetch ------------------------------------------------------------


def test_fetch_from_memory(store):
    (block,) = make_blocks(1)
    store.save([block], group=GROUP)
    got = fetch(store, block)
    assert got is not None and got == (block, MEMORY)


def test_fetch_from_host_promotes_to_memory(store):
    blocks = make_blocks(3)
    store.save(blocks, group=GROUP)
    got = fetch(store, blocks[0])
    assert got is not None and got[1] == HOST and same_kv(got[0], blocks[0])
    assert got[0].parent == SPACE.root
    assert store.tier_of(blocks[0].key, GROUP) == MEMORY and blocks[0].key not in store.host
    assert store.tier_of(blocks[1].key, GROUP) == HOST  # made room for the promoted block


def test_fetch_from_ssd_promotes_to_memory(store):
    blocks = make_blocks(2)
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [SSD, SSD]
    got = fetch(store, blocks[1])
    assert got is not None and got[1] == SSD and same_kv(got[0], blocks[1])
    assert got[0].parent == blocks[0].key
    assert store.tier_of(blocks[1].key, GROUP) == MEMORY
    assert fetch(store, blocks[1])[1] == MEMORY


def test_fetch_misses(store):
    blocks = make_blocks(2)
    assert fetch(store, blocks[0]) is None
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert store.fetch(blocks[0].key, group=GROUP, parent=SPACE.root, tokens=blocks[1].tokens) is None
    assert fetch(store, blocks[1], group="other/default") is None


def test_prefetched_block_reports_ssd_as_its_origin(store):
    blocks = make_blocks(2)
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert store.prefetch([(b.key, b.tokens) for b in blocks], group=GROUP) == 2
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, HOST]
    assert store.host.get(blocks[0].key).origin == SSD
    got = fetch(store, blocks[0])
    assert got is not None and got[1] == SSD and same_kv(got[0], blocks[0])
    assert store.tier_of(blocks[0].key, GROUP) == MEMORY


def test_prefetch_stops_at_the_first_missing_block(store):
    blocks = make_blocks(3)
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert store.ssd.clear(GROUP) == 3
    store.save([blocks[0], blocks[2]], group=GROUP)
    only_on_ssd(store)
    assert store.prefetch([(b.key, b.tokens) for b in blocks], group=GROUP) == 1
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, None, SSD]


def test_prefetch_skips_blocks_already_in_ram(store):
    blocks = make_blocks(3)
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert fetch(store, blocks[0])[1] == SSD
    assert store.prefetch([(b.key, b.tokens) for b in blocks], group=GROUP) == 2
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [MEMORY, HOST, HOST]


def test_prefetch_with_wrong_tokens_stops(store):
    blocks = make_blocks(2)
    store.save(blocks, group=GROUP)
    only_on_ssd(store)
    assert store.prefetch([(blocks[0].key, blocks[1].tokens), (blocks[1].key, blocks[1].tokens)],
                          group=GROUP) == 0
    assert store.tier_of(blocks[1].key, GROUP) == SSD


def test_tier_of_does_not_touch_recency(store):
    blocks = make_blocks(3)
    store.save(blocks[:2], group=GROUP)
    assert store.tier_of(blocks[0].key, GROUP) == MEMORY
    store.save(blocks[2:], group=GROUP)
    assert store.tier_of(blocks[0].key, GROUP) == HOST
    assert store.tier_of(b"\0" * 32, GROUP) is None


# --- management --------------------------------------------------------------------


def test_resize_demotes_spills_and_shrinks_the_ssd(store):
    blocks = make_blocks(4)
    store.save(blocks, group=GROUP)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, HOST, MEMORY, MEMORY]
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=2 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [SSD, HOST, HOST, MEMORY]
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [SSD, SSD, HOST, MEMORY]
    assert store.memory.stats()["budget_bytes"] == store.host.stats()["budget_bytes"] == BLOCK_BYTES
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=BLOCK_BYTES, ssd_bytes=0)
    assert store.stats()[SSD]["blocks"] == 0 and store.stats()[SSD]["budget_bytes"] == 0
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [None, None, HOST, MEMORY]


def test_raising_budgets_keeps_blocks_and_takes_new_ones(store):
    blocks = make_blocks(6)
    store.save(blocks[:4], group=GROUP)
    store.resize(memory_bytes=4 * BLOCK_BYTES, host_bytes=4 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    store.save(blocks[4:], group=GROUP)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, HOST, MEMORY, MEMORY, MEMORY, MEMORY]


def test_moving_budget_from_memory_to_host_keeps_every_block_in_ram(store):
    blocks = make_blocks(4)
    store.save(blocks, group=GROUP)
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=3 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, GROUP) for b in blocks] == [HOST, HOST, HOST, MEMORY]


def test_clear_of_a_prefix_removes_its_groups_in_every_tier(tmp_path):
    store = open_store(tmp_path / "kv", memory=4, host=4)
    try:
        spaces = [key_space(weights=w, compute_dtype="float32", layout=LAYOUT, block_tokens=B, tenant=t)
                  for w, t in [("m1", "default"), ("m1", "alice"), ("m2", "default"), ("m10", "default")]]
        blocks = {s.group: make_blocks(2, seed=i, space=s) for i, s in enumerate(spaces)}
        assert list(blocks) == ["m1/default", "m1/alice", "m2/default", "m10/default"]
        for g, bs in blocks.items():
            store.save(bs, group=g)
        assert store.flush(timeout_s=10)
        # 8 blocks: 4 in memory, 4 in host, all 8 on the SSD.
        assert store.clear("m1") == 4 + 4
        for g, bs in blocks.items():
            want_gone = g.startswith("m1/")
            assert all((store.tier_of(b.key, g) is None) == want_gone for b in bs), g
        assert store.clear("m2/default") == 2 + 2
        assert all(store.tier_of(b.key, "m10/default") is not None for b in blocks["m10/default"])
        assert store.clear() == 2 + 2
        assert len(store.memory) == len(store.host) == store.stats()[SSD]["blocks"] == 0
        assert store.clear() == 0
    finally:
        store.close()


def test_clear_waits_for_pending_writes(store):
    blocks = make_blocks(4)
    store.save(blocks, group=GROUP)
    store.clear(GROUP)  # a write landing after the clear would resurrect the block
    assert store.flush(timeout_s=10)
    assert store.stats()[SSD]["blocks"] == 0
    assert all(store.tier_of(b.key, GROUP) is None for b in blocks)


def test_reopened_store_serves_blocks_from_the_ssd(tmp_path):
    blocks = make_blocks(2)
    first = open_store(tmp_path / "kv")
    first.save(blocks, group=GROUP)
    first.flush(timeout_s=10)
    first.close()
    second = open_store(tmp_path / "kv")
    try:
        assert [second.tier_of(b.key, GROUP) for b in blocks] == [SSD, SSD]
        got = fetch(second, blocks[1])
        assert got is not None and got[1] == SSD and same_kv(got[0], blocks[1])
    finally:
        second.close()


def test_second_store_on_the_same_root_keeps_memory_and_host(tmp_path, caplog):
    first = open_store(tmp_path / "kv")
    try:
        with caplog.at_level(logging.WARNING, logger="omlx.cache"):
            second = open_store(tmp_path / "kv")
        try:
            blocks = make_blocks(3)
            second.save(blocks, group=GROUP)
            assert [second.tier_of(b.key, GROUP) for b in blocks] == [HOST, MEMORY, MEMORY]
            got = fetch(second, blocks[0])
            assert got is not None and got[1] == HOST and same_kv(got[0], blocks[0])
            s = second.stats()[SSD]
            assert s["disabled"] and "in use" in s["disabled_reason"]
            assert "disabled" in caplog.text
            second.flush(timeout_s=10)
            assert first.stats()[SSD]["blocks"] == 0  # nothing written under the first one's feet
        finally:
            second.close()
        first.save(make_blocks(1, seed=9, first_token=500), group=GROUP)
        assert first.flush(timeout_s=10) and first.stats()[SSD]["blocks"] == 1
    finally:
        first.close()


def test_second_store_on_the_same_root_reports_ssd_error(tmp_path):
    first = open_store(tmp_path / "kv")
    second = open_store(tmp_path / "kv")
    try:
        assert second.ssd_error is not None and "in use" in second.ssd_error
        assert second.ssd is None
    finally:
        second.close()
        first.close()


def test_stats_shape(store):
    s = store.stats()
    assert set(s) == {MEMORY, HOST, SSD}
    for tier in (MEMORY, HOST):
        assert set(s[tier]) == {"bytes", "budget_bytes", "blocks", "hits", "evictions", "restore_gbps"}
    assert s[MEMORY]["budget_bytes"] == 2 * BLOCK_BYTES and s[HOST]["budget_bytes"] == 2 * BLOCK_BYTES
    assert s[SSD]["budget_bytes"] == 64 * MIB and not s[SSD]["disabled"]
    assert {"blocks", "bytes", "hits", "misses", "writer", "restore_gbps"} <= set(s[SSD])
    assert {"submitted", "written", "pending_blocks"} <= set(s[SSD]["writer"])
    assert all(s[t]["restore_gbps"] is None for t in (MEMORY, HOST, SSD))


def test_stats_count_blocks_and_measure_large_restores(store):
    store.resize(memory_bytes=8 * MIB, host_bytes=8 * MIB, ssd_bytes=64 * MIB)
    rng = np.random.default_rng(0)
    tokens = tuple(range(B))
    (key,) = SPACE.chain(list(tokens))
    big = KVBlock(key, SPACE.root, tokens, mx.array(rng.standard_normal((1, 1, B, 2**16), dtype=np.float32)),
                  mx.array(rng.standard_normal((1, 1, B, 2**16), dtype=np.float32)))
    assert big.nbytes == 2 * MIB
    store.save([big], group=GROUP)
    s = store.stats()
    assert (s[MEMORY]["blocks"], s[MEMORY]["bytes"]) == (1, 2 * MIB)
    only_on_ssd(store)
    got = fetch(store, big)
    assert got is not None and got[1] == SSD and same_kv(got[0], big)
    s = store.stats()
    assert s[SSD]["restore_gbps"] is not None and s[SSD]["restore_gbps"] > 0
    assert s[SSD]["hits"] == 1 and s[MEMORY]["blocks"] == 1


def test_rate_ignores_tiny_reads_and_averages():
    rate = Rate(5e9)
    assert rate.bytes_per_s == 5e9 and rate.value is None
    rate.add(1000, 1e-6)
    rate.add(MIB, 0)
    assert rate.value is None
    rate.add(10 * MIB, 1.0)
    assert rate.value == 10 * MIB
    rate.add(20 * MIB, 1.0)
    assert rate.value == pytest.approx(0.7 * 10 * MIB + 0.3 * 20 * MIB)
    assert rate.bytes_per_s == rate.value
