"""The generic KV quantization against NumPy references: the packing a native kernel must
match, the error bound of group-wise affine quantization, and block payloads round-trip."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from appliance.kernels.kv_quant import (
    block_meta,
    dequantize,
    group_size_for,
    pack,
    payload_nbytes,
    quantize,
    unpack,
    values_offset,
)

SHAPE = (2, 3, 8, 64)  # layers, kv heads, tokens, head dim


def reference_dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                         group_size: int) -> np.ndarray:
    """Unpacks little-endian `bits`-bit integers from uint32 words, low bits first, and
    applies each group's scale and bias."""
    per_word = 32 // bits
    shifts = (np.arange(per_word) * bits).astype(np.uint32)
    q = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*packed.shape[:-1], -1, group_size).astype(np.float64)
    return (q * scales[..., None] + biases[..., None]).reshape(*packed.shape[:-1], -1)


def random(shape=SHAPE, dtype=mx.float32, seed=0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_matches_the_numpy_reference(bits):
    q = quantize(random(), bits)
    ref = reference_dequantize(np.array(q.packed), np.array(q.scales, dtype=np.float64),
                               np.array(q.biases, dtype=np.float64), bits, q.group_size)
    assert np.allclose(np.array(dequantize(q)), ref, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_error_is_within_one_step_of_each_group(bits):
    x = random()
    q = quantize(x, bits)
    error = np.abs(np.array(dequantize(q)) - np.array(x)).reshape(*SHAPE[:-1], -1, q.group_size)
    step = np.abs(np.array(q.scales))[..., None]  # MLX keeps each group's largest value exact
    assert np.all(error <= step + 1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_a_payload_round_trips_in_its_dtype(bits, dtype):
    keys, values = random(dtype=dtype), random(SHAPE[:-1] + (32,), dtype=dtype, seed=1)
    payload, meta = pack(keys, values, bits)
    assert payload.dtype == mx.uint8 and payload.size == payload_nbytes(meta)
    k, v = unpack(mx.array(np.array(payload)), meta)
    assert (k.dtype, k.shape, v.shape) == (dtype, keys.shape, values.shape)
    if bits == 16:
        assert mx.array_equal(k, keys) and mx.array_equal(v, values)
    else:
        tolerance = {8: 0.05, 4: 0.6}[bits] * (2 if dtype != mx.float32 else 1)
        assert mx.abs(k - keys).max().item() < tolerance and mx.abs(v - values).max().item() < tolerance


def test_quantized_payloads_are_smaller():
    keys, values = random(), random(seed=1)
    sizes = {bits: pack(keys, values, bits)[0].size for bits in (16, 8, 4)}
    assert sizes[16] == keys.nbytes + values.nbytes
    assert sizes[8] < sizes[16] / 3 and sizes[4] < sizes[8] * 0.6  # float32 KV: ~1/3.6 and ~1/6.4


def test_a_payload_that_does_not_fit_its_meta_is_refused():
    payload, meta = pack(random(), random(seed=1), 8)
    with pytest.raises(ValueError, match="payload holds"):
        unpack(payload[:-4], meta)


def test_group_size_follows_the_head_dim():
    assert (group_size_for(64), group_size_for(128), group_size_for(96)) == (64, 64, 32)
    with pytest.raises(ValueError, match="head dimension of 40"):
        group_size_for(40)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_a_block_s_meta_and_payload_size_are_known_before_packing(bits):
    """What the store pins slots ahead for: the payload size of a full block at each tier's bits."""
    keys = mx.zeros((2, 4, 32, 64), dtype=mx.bfloat16)
    values = mx.zeros((2, 4, 32, 96), dtype=mx.bfloat16)
    payload, meta = pack(keys, values, bits)
    assert block_meta("bfloat16", [2, 4, 32, 64], [2, 4, 32, 96], bits) == meta
    assert payload_nbytes(meta) == payload.size


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_values_start_where_the_keys_end(bits):
    """What the native kernels read the values from: the payload's second half, by the meta."""
    keys, values = random(), random(SHAPE[:-1] + (32,), seed=1)
    payload, meta = pack(keys, values, bits)
    keys_only, _ = pack(keys, keys, bits)
    offset = values_offset(meta)
    assert offset == keys_only.size // 2
    assert mx.array_equal(payload[:offset], keys_only[:offset])
