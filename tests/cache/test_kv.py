from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from appliance.cache.keys import KVLayout, key_space
from appliance.cache.kv import build_batch_cache, cut_blocks, from_bytes, probe_layout, to_bytes
from appliance.engine.mlxlm_seam import BatchCache

LAYERS, HEADS, DK, DV, B = 3, 2, 8, 4, 4
LAYOUT = KVLayout(num_layers=LAYERS, kv_heads=HEADS, k_head_dim=DK, v_head_dim=DV, dtype="float32",
                  itemsize=4)
SPACE = key_space(weights="ab" * 32, compute_dtype="float32", layout=LAYOUT, block_tokens=B)
TOKENS = list(range(100, 110))  # two full blocks and a 2-token tail


def never(_: bytes) -> bool:
    return False


def fake_cache(num_tokens: int, *, seed: int = 0, dtype: mx.Dtype = mx.float32,
               layers: int = LAYERS) -> list[KVCache]:
    """Returns per-layer KVCaches whose keys/values are exactly `num_tokens` long."""
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.array(rng.standard_normal((1, HEADS, num_tokens, DK), dtype=np.float32)).astype(dtype)
        c.values = mx.array(rng.standard_normal((1, HEADS, num_tokens, DV), dtype=np.float32)).astype(dtype)
        c.offset = num_tokens
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def grown_cache(num_tokens: int, *, seed: int = 0) -> list[KVCache]:
    """Returns per-layer KVCaches filled the way a model fills them (buffer longer than offset)."""
    rng = np.random.default_rng(seed)
    caches = [KVCache() for _ in range(LAYERS)]
    for c in caches:
        c.update_and_fetch(mx.array(rng.standard_normal((1, HEADS, num_tokens, DK), dtype=np.float32)),
                           mx.array(rng.standard_normal((1, HEADS, num_tokens, DV), dtype=np.float32)))
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def snapshot(caches: list[KVCache], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns [layers, heads, end-start, dim] numpy copies of the caches' keys and values."""
    return (np.stack([np.array(c.keys[0, :, start:end, :]) for c in caches]),
            np.stack([np.array(c.values[0, :, start:end, :]) for c in caches]))


def raw(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint8))


# --- cut_blocks --------------------------------------------------------------------


@pytest.mark.parametrize("make", [fake_cache, grown_cache])
def test_cut_blocks_cuts_full_blocks_and_the_tail(make):
    cache = make(len(TOKENS))
    blocks = cut_blocks(cache, TOKENS, SPACE, skip_tokens=0, is_known=never)
    assert [b.tokens for b in blocks] == [tuple(TOKENS[0:4]), tuple(TOKENS[4:8]), tuple(TOKENS[8:10])]
    assert [b.num_tokens for b in blocks] == [4, 4, 2]
    for blk, start in zip(blocks, (0, 4, 8)):
        end = start + blk.num_tokens
        assert blk.keys.shape == (LAYERS, HEADS, blk.num_tokens, DK)
        assert blk.values.shape == (LAYERS, HEADS, blk.num_tokens, DV)
        want_k, want_v = snapshot(cache, start, end)
        np.testing.assert_array_equal(np.array(blk.keys), want_k)
        np.testing.assert_array_equal(np.array(blk.values), want_v)
        assert blk.nbytes == LAYOUT.bytes_per_token * blk.num_tokens


def test_cut_blocks_keys_follow_the_chain():
    blocks = cut_blocks(fake_cache(len(TOKENS)), TOKENS, SPACE, skip_tokens=0, is_known=never)
    full = SPACE.chain(TOKENS)
    assert [b.key for b in blocks[:2]] == full
    assert [b.parent for b in blocks] == [SPACE.root, full[0], full[1]]
    assert blocks[2].key == SPACE.block_key(full[1], TOKENS[8:10])
    assert blocks[2].key not in full


def test_cut_blocks_of_an_exact_multiple_has_no_tail():
    blocks = cut_blocks(fake_cache(8), TOKENS[:8], SPACE, skip_tokens=0, is_known=never)
    assert [b.num_tokens for b in blocks] == [4, 4]
    assert cut_blocks(fake_cache(0), [], SPACE, skip_tokens=0, is_known=never) == []


@pytest.mark.parametrize("skip_tokens, starts", [
    (0, [0, 4, 8]), (3, [0, 4, 8]), (4, [4, 8]), (5, [4, 8]), (8, [8]), (9, [8]), (10, []),
])
def test_cut_blocks_skips_blocks_that_end_within_skip_tokens(skip_tokens, starts):
    cache = fake_cache(len(TOKENS))
    blocks = cut_blocks(cache, TOKENS, SPACE, skip_tokens=skip_tokens, is_known=never)
    assert [TOKENS.index(b.tokens[0]) for b in blocks] == starts
    everything = cut_blocks(cache, TOKENS, SPACE, skip_tokens=0, is_known=never)
    by_key = {b.key: b for b in everything}
    for blk in blocks:  # skipping changes neither keys nor parents nor contents
        assert blk.parent == by_key[blk.key].parent
        np.testing.assert_array_equal(np.array(blk.keys), np.array(by_key[blk.key].keys))


def test_cut_blocks_over_runs_longer_than_one_stack_and_around_known_blocks(monkeypatch):
    """Blocks are cut in runs of adjacent ones (CUT_RUN_BLOCKS at most); each comes out the
    same as a copy of its own slice."""
    monkeypatch.setattr("appliance.cache.kv.CUT_RUN_BLOCKS", 2)
    tokens = list(range(200, 227))  # 6 full blocks and a 3-token tail
    cache = grown_cache(len(tokens))
    known = set(SPACE.chain(tokens)[2:3])
    blocks = cut_blocks(cache, tokens, SPACE, skip_tokens=0, is_known=known.__contains__)
    assert [tokens.index(b.tokens[0]) for b in blocks] == [0, 4, 12, 16, 20, 24]
    for blk in blocks:
        start = tokens.index(blk.tokens[0])
        want_k, want_v = snapshot(cache, start, start + blk.num_tokens)
        np.testing.assert_array_equal(np.array(blk.keys), want_k)
        np.testing.assert_array_equal(np.array(blk.values), want_v)
        assert blk.keys.shape[2] == blk.values.shape[2] == blk.num_tokens


def test_cut_blocks_does_not_copy_known_blocks_but_keeps_chaining():
    cache = fake_cache(len(TOKENS))
    full = SPACE.chain(TOKENS)
    asked = []

    def is_known(key: bytes) -> bool:
        asked.append(key)
        return key == full[0]

    blocks = cut_blocks(cache, TOKENS, SPACE, skip_tokens=0, is_known=is_known)
    assert [b.key for b in blocks[:1]] == [full[1]] and len(blocks) == 2
    assert blocks[0].parent == full[0]
    np.testing.assert_array_equal(np.array(blocks[0].keys), snapshot(cache, 4, 8)[0])
    assert asked[:2] == full


def test_skipped_blocks_are_not_asked_about():
    asked = []
    cut_blocks(fake_cache(len(TOKENS)), TOKENS, SPACE, skip_tokens=8,
               is_known=lambda key: asked.append(key) or False)
    assert len(asked) == 1


@pytest.mark.parametrize("layers", [1, LAYERS])
def test_blocks_are_copies_that_survive_writes_to_the_source_cache(layers):
    cache = fake_cache(len(TOKENS), layers=layers)
    blocks = cut_blocks(cache, TOKENS, SPACE, skip_tokens=0, is_known=never)
    before = [(raw(b.keys), raw(b.values)) for b in blocks]
    for c in cache:  # the engine reuses the cache: rewind and overwrite in place
        c.offset = 0
        c.update_and_fetch(mx.zeros((1, HEADS, len(TOKENS), DK)), mx.zeros((1, HEADS, len(TOKENS), DV)))
    mx.eval([(c.keys, c.values) for c in cache])
    assert float(mx.abs(cache[0].keys).sum()) == 0.0  # the source really was overwritten
    for c in cache:  # and then dropped altogether
        c.keys, c.values = mx.ones_like(c.keys), mx.ones_like(c.values)
    del cache
    for blk, (k, v) in zip(blocks, before):
        np.testing.assert_array_equal(raw(blk.keys), k)
        np.testing.assert_array_equal(raw(blk.values), v)


def test_blocks_own_contiguous_arrays():
    blocks = cut_blocks(grown_cache(len(TOKENS)), TOKENS, SPACE, skip_tokens=0, is_known=never)
    for blk in blocks:  # a view into the 256-token buffer would be as big as that buffer
        assert np.array(blk.keys).flags.c_contiguous
        assert blk.keys.nbytes == LAYERS * HEADS * blk.num_tokens * DK * 4


# --- build_batch_cache -------------------------------------------------------------


def contents(c: BatchKVCache) -> tuple[np.ndarray, np.ndarray]:
    k, v = c.keys_and_values()
    return np.array(k), np.array(v)


def test_build_batch_cache_concatenates_blocks_per_layer_with_room_to_grow():
    source = fake_cache(len(TOKENS))
    blocks = cut_blocks(source, TOKENS, SPACE, skip_tokens=0, is_known=never)
    caches = build_batch_cache(blocks, len(TOKENS))
    assert len(caches) == LAYERS and all(type(c) is BatchCache and not c.padded for c in caches)
    for built, orig in zip(caches, source):
        assert built.offset.tolist() == [len(TOKENS)] and built.size() == len(TOKENS)
        assert built.keys.shape[2] % BatchKVCache.step == 0 and built.keys.shape[2] > len(TOKENS)
        k, v = contents(built)
        np.testing.assert_array_equal(k, np.array(orig.keys))
        np.testing.assert_array_equal(v, np.array(orig.values))


@pytest.mark.parametrize("num_tokens", [1, 4, 6, 9])
def test_build_batch_cache_truncates_to_num_tokens(num_tokens):
    source = fake_cache(len(TOKENS))
    blocks = cut_blocks(source, TOKENS, SPACE, skip_tokens=0, is_known=never)
    for built, orig in zip(build_batch_cache(blocks, num_tokens), source):
        assert built.size() == num_tokens
        k, v = contents(built)
        np.testing.assert_array_equal(k, np.array(orig.keys[:, :, :num_tokens]))
        np.testing.assert_array_equal(v, np.array(orig.values[:, :, :num_tokens]))


@pytest.mark.parametrize("run_layers", [1, 2, LAYERS])
@pytest.mark.parametrize("num_tokens", [5, len(TOKENS)])
def test_gathering_runs_of_layers_first_builds_the_same_cache(run_layers, num_tokens):
    # the CUDA path: runs of layers gathered from every block at once, then copied out
    source = fake_cache(len(TOKENS))
    blocks = cut_blocks(source, TOKENS, SPACE, skip_tokens=0, is_known=never)
    layer_bytes = sum(b.keys[:, :, :num_tokens].nbytes for b in blocks) // LAYERS
    plain = build_batch_cache(blocks, num_tokens)
    gathered = build_batch_cache(blocks, num_tokens, gather_bytes=run_layers * layer_bytes)
    for g, p in zip(gathered, plain, strict=True):
        assert g.keys.shape == p.keys.shape and g.offset.tolist() == p.offset.tolist() and g.size() == p.size()
        for a, b in zip(contents(g), contents(p)):
            np.testing.assert_array_equal(a, b)
    k, _ = gathered[0].update_and_fetch(mx.ones((1, HEADS, 1, DK)), mx.ones((1, HEADS, 1, DV)))
    np.testing.assert_array_equal(np.array(k[:, :, -1]), np.ones((1, HEADS, DK)))
    np.testing.assert_array_equal(np.array(gathered[1].keys), np.array(plain[1].keys))  # its own buffer


def test_built_cache_extends_in_place_without_touching_the_blocks():
    source = fake_cache(len(TOKENS))
    blocks = cut_blocks(source, TOKENS, SPACE, skip_tokens=0, is_known=never)
    caches = build_batch_cache(blocks, 6)
    rng = np.random.default_rng(7)
    new_k = mx.array(rng.standard_normal((1, HEADS, 3, DK), dtype=np.float32))
    new_v = mx.array(rng.standard_normal((1, HEADS, 3, DV), dtype=np.float32))
    for built, orig in zip(caches, source):
        capacity = built.keys.shape[2]
        k, v = built.update_and_fetch(new_k, new_v)
        assert built.keys.shape[2] == capacity  # the room was used, nothing reallocated
        assert built.offset.tolist() == [9] and k.shape == (1, HEADS, 9, DK) and v.shape == (1, HEADS, 9, DV)
        np.testing.assert_array_equal(np.array(k[:, :, :6]), np.array(orig.keys[:, :, :6]))
        np.testing.assert_array_equal(np.array(k[:, :, 6:]), np.array(new_k))
        np.testing.assert_array_equal(np.array(v[:, :, 6:]), np.array(new_v))
    np.testing.assert_array_equal(np.array(blocks[1].keys), snapshot(source, 4, 8)[0])


def test_built_cache_can_be_trimmed_and_overwritten_without_touching_blocks():
    source = fake_cache(B)
    blocks = cut_blocks(source, TOKENS[:B], SPACE, skip_tokens=0, is_known=never)
    before = raw(blocks[0].keys)
    for c in build_batch_cache(blocks, B):
        c.trim(2)
        c.update_and_fetch(mx.zeros((1, HEADS, 2, DK)), mx.zeros((1, HEADS, 2, DV)))
        mx.eval(c.keys)
    np.testing.assert_array_equal(raw(blocks[0].keys), before)


def test_cut_of_a_built_cache_gives_the_same_blocks():
    blocks = cut_blocks(fake_cache(len(TOKENS)), TOKENS, SPACE, skip_tokens=0, is_known=never)
    again = cut_blocks(build_batch_cache(blocks, len(TOKENS)), TOKENS, SPACE, skip_tokens=0, is_known=never)
    assert [b.key for b in again] == [b.key for b in blocks]
    for a, b in zip(again, blocks):
        np.testing.assert_array_equal(raw(a.keys), raw(b.keys))
        np.testing.assert_array_equal(raw(a.values), raw(b.values))


# --- payloads ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_payload_round_trip_is_byte_exact(dtype):
    blocks = cut_blocks(fake_cache(len(TOKENS), dtype=dtype), TOKENS, SPACE, skip_tokens=0,
                        is_known=never)
    for blk, stored in zip(blocks, to_bytes(blocks)):
        meta = stored.meta
        assert meta["dtype"] == str(dtype).removeprefix("mlx.core.")
        assert meta["k_shape"] == list(blk.keys.shape) and meta["v_shape"] == list(blk.values.shape)
        assert meta["k_nbytes"] == blk.keys.nbytes and stored.payload_nbytes == blk.nbytes
        assert (stored.key, stored.parent, stored.dir, stored.tokens) == (blk.key, blk.parent, blk.dir, blk.tokens)
        back = from_bytes(replace(stored, payload=bytes(stored.payload)))
        assert (back.key, back.parent, back.dir, back.tokens) == (blk.key, blk.parent, blk.dir, blk.tokens)
        assert back.keys.dtype == dtype and back.values.dtype == dtype
        assert back.keys.shape == blk.keys.shape and back.values.shape == blk.values.shape
        np.testing.assert_array_equal(raw(back.keys), raw(blk.keys))
        np.testing.assert_array_equal(raw(back.values), raw(blk.values))


def test_payload_round_trip_from_a_memoryview_and_numpy_buffer():
    (blk, *_) = cut_blocks(fake_cache(B), TOKENS[:B], SPACE, skip_tokens=0, is_known=never)
    stored = to_bytes([blk])[0]
    for buf in (stored.payload, np.frombuffer(stored.payload, dtype=np.uint8)):
        back = from_bytes(replace(stored, payload=buf))
        np.testing.assert_array_equal(raw(back.keys), raw(blk.keys))


def test_a_payload_stays_mlx_s_array_until_the_ssd_writer_reads_it(tmp_path):
    # On MLX CUDA a memoryview of a device array moves it to the host: the engine thread
    # that made the payload must not take one (the writer's thread reads it).
    from appliance.cache.ssd import SsdTier

    (blk, *_) = cut_blocks(fake_cache(B), TOKENS[:B], SPACE, skip_tokens=0, is_known=never)
    stored = to_bytes([blk])[0]
    assert isinstance(stored.payload, mx.array) and stored.payload_nbytes == blk.nbytes
    with SsdTier(tmp_path / "ssd", budget_bytes=1 << 30) as tier:
        assert tier.put(stored)
        back = tier.get(stored.key, dir=stored.dir, tokens=stored.tokens)
    assert bytes(back.payload) == bytes(memoryview(stored.payload))
    np.testing.assert_array_equal(raw(from_bytes(back).keys), raw(blk.keys))


def test_from_bytes_does_not_alias_the_buffer():
    (blk, *_) = cut_blocks(fake_cache(B), TOKENS[:B], SPACE, skip_tokens=0, is_known=never)
    stored = to_bytes([blk])[0]
    buf = bytearray(stored.payload)
    back = from_bytes(replace(stored, payload=memoryview(buf)))
    buf[:] = bytes(len(buf))  # e.g. a reused read buffer
    np.testing.assert_array_equal(raw(back.keys), raw(blk.keys))


def _payload_case(name: str, meta: dict, payload: bytes, tokens: tuple[int, ...]):
    if name == "truncated":
        return meta, payload[:-1], tokens
    if name == "extra_bytes":
        return meta, payload + b"\0" * 4, tokens
    if name == "empty":
        return meta, b"", tokens
    if name == "k_nbytes_off":
        return {**meta, "k_nbytes": meta["k_nbytes"] - 4}, payload, tokens
    if name == "k_shape_off":
        return {**meta, "k_shape": [LAYERS, HEADS, B, DK * 2]}, payload, tokens
    if name == "too_many_tokens":
        return meta, payload, tokens + (1,)
    if name == "too_few_tokens":
        return meta, payload, tokens[:-1]
    if name == "dtype_off":  # same total size in float16 reads as twice the elements
        return {**meta, "dtype": "float16"}, payload, tokens
    raise AssertionError(name)


@pytest.mark.parametrize("case", ["truncated", "extra_bytes", "empty", "k_nbytes_off", "k_shape_off",
                                  "too_many_tokens", "too_few_tokens", "dtype_off"])
def test_from_bytes_rejects_a_payload_that_does_not_fit(case):
    (blk, *_) = cut_blocks(fake_cache(B), TOKENS[:B], SPACE, skip_tokens=0, is_known=never)
    stored = to_bytes([blk])[0]
    meta, payload, tokens = _payload_case(case, stored.meta, bytes(stored.payload), blk.tokens)
    with pytest.raises(ValueError):
        from_bytes(replace(stored, meta=meta, payload=payload, tokens=tokens))


# --- probe_layout ------------------------------------------------------------------


def tiny_llama_args() -> llama.ModelArgs:
    return llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128)


class RotatingLlama(llama.Model):
    def make_cache(self):
        return [RotatingKVCache(max_size=16) for _ in self.layers]


class MixedLlama(llama.Model):
    def make_cache(self):
        return [KVCache(), RotatingKVCache(max_size=16)]


def test_probe_layout_of_a_tiny_llama():
    mx.random.seed(0)
    model = llama.Model(tiny_llama_args())
    layout = probe_layout(model)
    assert layout == KVLayout(num_layers=2, kv_heads=2, k_head_dim=16, v_head_dim=16, dtype="float32",
                              itemsize=4)
    assert layout.bytes_per_token == 2 * 2 * 32 * 4


@pytest.mark.parametrize("model_class", [RotatingLlama, MixedLlama])
def test_probe_layout_refuses_models_with_other_caches(model_class):
    assert probe_layout(model_class(tiny_llama_args())) is None


def test_probed_layout_matches_the_blocks_a_model_fills():
    model = llama.Model(tiny_llama_args())
    layout = probe_layout(model)
    space = key_space(weights="cd" * 32, compute_dtype="float32", layout=layout, block_tokens=B)
    cache = [KVCache() for _ in model.layers]
    tokens = list(range(1, 7))
    model(mx.array([tokens]), cache=cache)
    blocks = cut_blocks(cache, tokens, space, skip_tokens=0, is_known=never)
    assert [b.nbytes for b in blocks] == [layout.bytes_per_token * n for n in (4, 2)]
    assert [b.keys.dtype for b in blocks] == [mx.float32, mx.float32]
