"""The native CUDA kernels against the generic paths, on the GPU they are written for.

Run on an NVIDIA GPU with MLX CUDA (`bench/gpu_run.sh` runs this file there); elsewhere
every test is skipped with the reason printed (`pytest -rs`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from appliance.kernels.registry import backend

pytestmark = pytest.mark.skipif(backend() != "cuda", reason=f"native KV kernels are CUDA only; "
                                                             f"this backend is {backend()}")

SHAPE = (4, 8, 37, 128)  # layers, kv heads, tokens (a partial block), head dim


@pytest.fixture(scope="module")
def pool():
    from appliance.kernels.pinned import PinnedPool

    return PinnedPool()


def block(seed: int, dtype=mx.bfloat16, shape=SHAPE):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype), (mx.random.normal(shape) * 3).astype(dtype)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_a_block_goes_to_pinned_memory_and_back_as_the_generic_path_has_it(pool, bits, dtype):
    from appliance.kernels import kv_move
    from appliance.kernels.kv_quant import pack, unpack
    from appliance.kernels.pinned import PinnedPool

    keys, values = block(bits, dtype)
    ((view, meta),) = kv_move.pack_to_host([(keys, values)], bits, pool.take)
    payload, generic_meta = pack(keys, values, bits)
    assert meta == generic_meta
    assert np.array_equal(np.frombuffer(view, dtype=np.uint8), np.array(payload))  # the bytes the SSD gets
    k, v = kv_move.to_block(PinnedPool.address_of(view), meta)
    gk, gv = unpack(payload, meta)
    for got, want in ((k, gk), (v, gv)):
        assert got.dtype == want.dtype and got.shape == want.shape
        if bits == 16:
            assert mx.array_equal(got, want).item()
        else:  # the same affine map; the kernel rounds once, in float32
            tol = mx.max(mx.abs(want.astype(mx.float32))).item() / 128
            assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() <= tol


def test_a_view_into_a_slot_is_read_from_where_it_starts(pool):
    """A block read from an SSD file lies in its slot after the file's header."""
    from appliance.kernels import kv_move
    from appliance.kernels.kv_quant import pack
    from appliance.kernels.pinned import PinnedPool

    keys, values = block(7)
    payload, meta = pack(keys, values, 16)
    slot, _ = pool.take(4096 + payload.size)
    slot[4096:] = np.array(payload).tobytes()
    k, v = kv_move.to_block(PinnedPool.address_of(slot[4096:]), meta)
    assert mx.array_equal(k, keys).item() and mx.array_equal(v, values).item()


def test_the_self_test_passes_and_auto_selects_native():
    from appliance.kernels import registry

    registry.SELF_TEST.start()
    assert registry.SELF_TEST.done.wait(120)
    assert set(registry.SELF_TEST.failures.values()) == {None}
    assert registry.select("kv_dequantize", "auto").chosen == "native"
    assert registry.select("kv_quantize", "generic").chosen == "generic"
    assert registry.select("small_matmul", "auto").chosen == "native"


def test_the_store_demotes_and_restores_through_pinned_memory(tmp_path):
    """Memory evicts to host (into a pinned slot made ahead), a fetch reads it back through
    the kernel, and the SSD tier reads into pinned memory too."""
    from appliance.cache.kv import KVBlock
    from appliance.cache.store import HOST, SSD, KVStore
    from appliance.kernels.pinned import PinnedPool

    keys, values = block(3)
    nbytes = keys.nbytes + values.nbytes
    store = KVStore(root=tmp_path, memory_bytes=nbytes, host_bytes=8 << 20, ssd_bytes=16 * nbytes)
    store.use_native(quantize=True, dequantize=True)
    store.expect_blocks(nbytes)
    while store.wants_pinned():  # what an idle engine does: slots pinned ahead of need
        store.pin_one()
    try:
        first = KVBlock(b"a" * 32, b"r" * 32, "m", tuple(range(37)), keys, values)
        second = KVBlock(b"b" * 32, b"a" * 32, "m", tuple(range(37)), values, keys)
        store.save([first])
        store.save([second])  # evicts `first` to host
        assert store.tier_of(first.key, "m") == HOST
        assert PinnedPool.owns(store.host.get(first.key).payload)
        (fetched,) = store.fetch_all([(first.key, first.tokens)], dir="m")
        assert fetched.tier == HOST
        assert mx.array_equal(fetched.block.keys, keys).item()
        assert store.flush(30)
        ssd_block = store._read_ssd(second.key, "m", second.tokens)  # written through, read back pinned
        assert PinnedPool.owns(ssd_block.payload)
        assert store.ssd.contains(second.key, dir="m") and store.tier_of(second.key, "m") != SSD
    finally:
        store.close()


def test_a_start_pins_slots_before_any_engine_is_idle(tmp_path, monkeypatch):
    """Native kernels on and a block size known: slots are pinned at once, on a thread."""
    from appliance.cache import store as store_module
    from appliance.cache.store import HOST, KVStore

    monkeypatch.setattr(store_module, "START_PINNED_BYTES", 8 << 20)
    store = KVStore(root=tmp_path, memory_bytes=1 << 20, host_bytes=64 << 20, ssd_bytes=64 << 20)
    try:
        store.use_native(quantize=True, dequantize=True)
        store.expect_blocks(2 << 20)
        store._start_pinning.join(30)
        assert store.stats()[HOST]["pinned_free_bytes"] == 8 << 20
    finally:
        store.close()


def test_a_restore_frees_its_pinned_slot_for_the_block_it_pushes_down(tmp_path):
    """With one pinned slot, restoring a host block evicts another from memory, and that
    one goes down into the slot the restore has just freed, not by the generic path."""
    from appliance.cache.kv import KVBlock
    from appliance.cache.store import HOST, MEMORY, KVStore
    from appliance.kernels.pinned import SLOT_ALIGN, PinnedPool

    keys, values = block(5)
    nbytes = keys.nbytes + values.nbytes
    store = KVStore(root=tmp_path, memory_bytes=nbytes, host_bytes=SLOT_ALIGN, ssd_bytes=16 * nbytes)
    store.use_native(quantize=True, dequantize=True)
    store.expect_blocks(nbytes)
    while store.wants_pinned():
        store.pin_one()
    assert store.stats()[HOST]["pinned_bytes"] == SLOT_ALIGN  # one slot
    try:
        first = KVBlock(b"a" * 32, b"r" * 32, "m", tuple(range(37)), keys, values)
        second = KVBlock(b"c" * 32, b"r" * 32, "m", tuple(range(37)), values, keys)
        store.save([first])
        store.save([second])
        (fetched,) = store.fetch_all([(first.key, first.tokens)], dir="m")
        assert fetched.tier == HOST and mx.array_equal(fetched.block.keys, keys).item()
        assert store.tier_of(first.key, "m") == MEMORY and store.tier_of(second.key, "m") == HOST
        assert PinnedPool.owns(store.host.get(second.key).payload)
    finally:
        store.close()


def test_warm_compiles_a_layout_once_and_checks_it():
    from appliance.kernels import kv_move

    assert kv_move.warm(dtype="float16", k_dim=128, v_dim=96, bits=(16, 8)) is None
    assert {("float16", 128, 96, 16), ("float16", 128, 96, 8)} <= kv_move._warmed
    assert kv_move.warm(dtype="float16", k_dim=128, v_dim=96, bits=(8,)) is None  # nothing left to do


def test_an_8_bit_host_tier_demotes_into_slots_pinned_for_its_size(tmp_path):
    from appliance.cache.kv import KVBlock
    from appliance.cache.store import HOST, KVStore
    from appliance.kernels.kv_quant import block_meta, payload_nbytes
    from appliance.kernels.pinned import PinnedPool

    keys, values = block(6)
    nbytes = keys.nbytes + values.nbytes
    store = KVStore(root=tmp_path, memory_bytes=nbytes, host_bytes=8 << 20, ssd_bytes=16 * nbytes, host_kv_bits=8)
    store.use_native(quantize=True, dequantize=True)
    store.expect_blocks(payload_nbytes(block_meta("bfloat16", list(keys.shape), list(values.shape), 8)))
    while store.wants_pinned():
        store.pin_one()
    try:
        first = KVBlock(b"a" * 32, b"r" * 32, "m", tuple(range(37)), keys, values)
        store.save([first])
        store.save([KVBlock(b"c" * 32, b"r" * 32, "m", tuple(range(37)), values, keys)])
        host = store.host.get(first.key)
        assert host.meta["bits"] == 8 and PinnedPool.owns(host.payload)
        (fetched,) = store.fetch_all([(first.key, first.tokens)], dir="m")
        assert fetched.tier == HOST
        err = mx.max(mx.abs(fetched.block.keys.astype(mx.float32) - keys.astype(mx.float32))).item()
        assert err < mx.max(mx.abs(keys.astype(mx.float32))).item() / 64
    finally:
        store.close()


def test_compiled_kernels_are_kept_beside_mlx_s_for_the_next_process():
    from appliance.kernels import kv_move

    assert kv_move.self_test() is None
    from appliance.kernels import cubins

    kept = {path.name.rsplit("-", 1)[0] for path in cubins.cubin_dir().glob("*.cubin")}
    assert {"omlx_kv_to_host", "omlx_kv_to_block_bf16_64_16_1", "omlx_kv_to_block_bf16_64_4_64"} <= kept
