"""Group-wise affine quantization of KV, as `mx.quantize` does it: each run of
`group_size` values along the head dimension is stored as `bits`-bit integers with its own
scale and bias. The generic path, built from MLX ops.

A tier that keeps KV at 8 or 4 bits holds ~1/2 or ~1/4 of the bytes of 16-bit KV (plus a
scale and a bias per group), so it restores that much faster from a slow disk. The error it
adds is measured with the real model in bench/kv_quality.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

BITS = (16, 8, 4)  # 16: kept as computed
GROUP_SIZE = 64


@dataclass(frozen=True)
class QuantizedKV:
    """One array of KV at `bits` bits: packed integers, a scale and a bias per group."""

    packed: mx.array  # uint32, last dim head_dim * bits / 32
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    dtype: mx.Dtype  # what it dequantizes to

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes


def group_size_for(head_dim: int) -> int:
    """Returns the largest group size MLX supports that divides `head_dim` (64, 32)."""
    for size in (GROUP_SIZE, 32):
        if head_dim % size == 0:
            return size
    raise ValueError(f"a head dimension of {head_dim} cannot be quantized in groups of 64 or 32")


def quantize(x: mx.array, bits: int) -> QuantizedKV:
    """Returns `x` (..., head_dim) quantized to `bits` (8 or 4) bits per value."""
    if bits not in (8, 4):
        raise ValueError(f"KV quantizes to 8 or 4 bits, not {bits}")
    size = group_size_for(x.shape[-1])
    packed, scales, biases = mx.quantize(x, group_size=size, bits=bits)
    return QuantizedKV(packed, scales, biases, bits, size, x.dtype)


def dequantize(q: QuantizedKV) -> mx.array:
    """Returns the values `q` stands for, in the dtype it was quantized from."""
    out = mx.dequantize(q.packed, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
    return out.astype(q.dtype)


def stored_fraction(bits: int, *, itemsize: int = 2, group_size: int = GROUP_SIZE) -> float:
    """Returns the bytes a tier at `bits` stores per byte of KV as computed (16-bit KV in
    groups of 64 by default): 1 at 16 bits, ~0.53 at 8, ~0.28 at 4."""
    if bits == 16:
        return 1.0
    return (bits / 8 + 2 * itemsize / group_size) / itemsize


def round_trip(x: mx.array, bits: int) -> mx.array:
    """Returns `x` as a tier at `bits` bits gives it back (itself at 16)."""
    return x if bits == 16 else dequantize(quantize(x, bits))


# --- a block's payload ---------------------------------------------------------------
# A block's keys and values ([layers, kv_heads, tokens, head_dim] each) as one uint8
# payload: at 16 bits, their bytes as computed; at 8 or 4, for keys then values, the packed
# integers, the scales and the biases. `meta` says which, so any tier's block decodes.


def pack(keys: mx.array, values: mx.array, bits: int) -> tuple[mx.array, dict]:
    """Returns (payload, meta): `keys` and `values` at `bits` bits as one uint8 array
    (not evaluated: the caller evaluates many in one wait)."""
    meta = block_meta(str(keys.dtype).removeprefix("mlx.core."), list(keys.shape), list(values.shape), bits)
    if bits == 16:
        parts = [keys, values]
    else:
        qk, qv = quantize(keys, bits), quantize(values, bits)
        parts = [qk.packed, qk.scales, qk.biases, qv.packed, qv.scales, qv.biases]
    return mx.concatenate([p.view(mx.uint8).reshape(-1) for p in parts]), meta


def block_meta(dtype: str, k_shape: list[int], v_shape: list[int], bits: int) -> dict:
    """Returns the meta `pack` writes for keys and values of these shapes and dtype at
    `bits` bits (with `payload_nbytes`: a block's payload size before it is packed)."""
    meta = {"dtype": dtype, "k_shape": list(k_shape), "v_shape": list(v_shape), "bits": bits}
    if bits == 16:
        meta["k_nbytes"] = _nbytes(k_shape, getattr(mx, dtype))
    else:
        meta["group_sizes"] = [group_size_for(k_shape[-1]), group_size_for(v_shape[-1])]
    return meta


def computed_nbytes(meta: dict) -> int:
    """Returns the bytes of the keys and values `meta` describes, as computed."""
    dtype = getattr(mx, meta["dtype"])
    return _nbytes(meta["k_shape"], dtype) + _nbytes(meta["v_shape"], dtype)


def payload_nbytes(meta: dict) -> int:
    """Returns the payload size `meta` describes."""
    return sum(_nbytes(shape, dtype) for shape, dtype in _parts(meta))


def values_offset(meta: dict) -> int:
    """Returns where the values' arrays start in the payload `meta` describes: the bytes
    its keys' arrays take."""
    parts = _parts(meta)
    return sum(_nbytes(shape, dtype) for shape, dtype in parts[:len(parts) // 2])


def unpack(raw: mx.array, meta: dict) -> tuple[mx.array, mx.array]:
    """Returns (keys, values) from a payload `pack` made (raw: uint8, evaluated or not), in
    the dtype they were computed in; raises ValueError when its size does not fit `meta`
    (KeyError when `meta` is not one `pack` wrote)."""
    parts = _parts(meta)
    expected = sum(_nbytes(shape, dtype) for shape, dtype in parts)
    if raw.size != expected:
        raise ValueError(f"payload holds {raw.size} bytes, its meta says {expected}")
    if "k_nbytes" in meta and meta["k_nbytes"] != _nbytes(*parts[0]):
        raise ValueError(f"the meta's k_nbytes {meta['k_nbytes']} does not fit its k_shape")
    arrays, start = [], 0
    for shape, dtype in parts:
        n = _nbytes(shape, dtype)
        arrays.append(raw[start:start + n].view(dtype).reshape(shape))
        start += n
    if meta.get("bits", 16) == 16:
        return arrays[0], arrays[1]
    dtype, (k_size, v_size), bits = getattr(mx, meta["dtype"]), meta["group_sizes"], meta["bits"]
    keys = dequantize(QuantizedKV(*arrays[:3], bits, k_size, dtype))
    values = dequantize(QuantizedKV(*arrays[3:], bits, v_size, dtype))
    return keys, values


def _parts(meta: dict) -> list[tuple[list[int], mx.Dtype]]:
    """Returns the (shape, dtype) of each array in a payload, in order."""
    dtype, bits = getattr(mx, meta["dtype"]), meta.get("bits", 16)
    if bits == 16:
        return [(meta["k_shape"], dtype), (meta["v_shape"], dtype)]
    if bits not in (8, 4):
        raise ValueError(f"a payload at {bits} bits")
    out = []
    for shape, size in zip((meta["k_shape"], meta["v_shape"]), meta["group_sizes"]):
        *lead, dim = shape
        if dim % size:
            raise ValueError(f"head dim {dim} is not a multiple of the group size {size}")
        out += [([*lead, dim * bits // 32], mx.uint32), ([*lead, dim // size], dtype), ([*lead, dim // size], dtype)]
    return out


def _nbytes(shape: list[int], dtype: mx.Dtype) -> int:
    n = dtype.size
    for d in shape:
        n *= d
    return n
