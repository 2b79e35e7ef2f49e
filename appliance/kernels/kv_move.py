"""Moving KV blocks between the device and pinned host memory, natively on CUDA.

Two kernels, sources in kernels/cuda/, compiled by NVRTC once per machine (kernels/cubins.py)
and run through `mx.fast.precompiled_cuda_kernel`:

- `to_host` (kv_to_host.cu), gather to host: copies blocks' payloads, made on the
  device by kernels/kv_quant.py's `pack` (quantized there at 8 or 4 bits), into pinned
  host memory over the host link: ~50 GB/s on an H200, where the generic path (MLX moves
  the buffer to managed memory, numpy copies it) ran at 2.3 GB/s.
- `to_block` (kv_to_block.cu), dequantize from host: reads a block's payload (16, 8 or 4
  bits) straight from pinned host memory and writes its keys and values as device arrays,
  dequantizing on the way. The generic path (`mx.array` of the bytes, then `unpack`)
  crossed the host link through managed memory at 2.5 GB/s.

Both take device addresses of pinned memory (kernels/pinned.py) as uint64 inputs, since
MLX cannot wrap foreign memory in an array. Each call waits for its kernels (`mx.eval`)
before it returns (`to_block` unless told not to), so the host memory may be reused or
freed afterwards.
"""

from __future__ import annotations

import threading
from functools import cache

import mlx.core as mx

from appliance.kernels.cubins import DTYPES, compiled, source
from appliance.kernels.kv_quant import pack, payload_nbytes, values_offset

THREADS = 256
MAX_THREADS = 132 * 2048  # an H200's resident threads; the kernels loop over the rest
MAX_SCALAR = 2**31 - 1  # the kernels' sizes are int scalars


@cache
def _cubin(file: str, kernel: str, instance: str = "") -> bytes:
    """Returns the cubin of `kernel` in kernels/cuda/FILE.cu (its sources read and its
    cubin looked up once per process)."""
    return compiled(source(file, instance), kernel)


def to_block_kernel(dtype: str, dim: int, bits: int, group: int) -> tuple[str, str]:
    """Returns (kernel name, the extern "C" kernel that instantiates kv_to_block.cu's
    template) for one layout."""
    t = DTYPES[dtype]
    name = f"omlx_kv_to_block_{t}_{dim}_{bits}_{group}"
    return name, (f'extern "C" __global__ void {name}(const u64* addr, {t}* out, int rows) '
                  f"{{ kv_to_block<{t}, {dim}, {bits}, {group}>(addr, out, rows); }}\n")


def _scalar(n: int, what: str) -> int:
    if n > MAX_SCALAR:
        raise ValueError(f"{what} of {n} is beyond the native kernels' int range")
    return n


def grid(work_items: int) -> tuple[int, int, int]:
    return (max(1, min(work_items, MAX_THREADS)), 1, 1)


def to_host(pairs: list[tuple[mx.array, int]]) -> None:
    """Copies each payload (uint8) to pinned host memory at its device address (16-byte
    aligned), and waits for all the copies (one wait)."""
    cubin = _cubin("kv_to_host", "omlx_kv_to_host")
    done = [mx.fast.precompiled_cuda_kernel(
        name="omlx_kv_to_host", compiled_source=cubin, inputs=[payload, mx.array([address], dtype=mx.uint64)],
        scalars=[_scalar(payload.size, "a payload's bytes")], grid=grid(payload.size // 16),
        threadgroup=(THREADS, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint8], ensure_row_contiguous=True)[0]
            for payload, address in pairs]
    mx.eval(done)


def pack_to_host(blocks: list[tuple[mx.array, mx.array]], bits: int, place) -> list[tuple[memoryview, dict]]:
    """Returns (payload, meta) per block (keys, values) at `bits` bits, packed on the device
    and copied into host memory that `place(nbytes)` returns as (memoryview, device
    address); one wait for all the copies."""
    packed = [pack(keys, values, bits) for keys, values in blocks]
    places = [place(payload.size) for payload, _ in packed]
    to_host([(payload, address) for (payload, _), (_, address) in zip(packed, places)])
    return [(view, meta) for (view, _), (_, meta) in zip(places, packed)]


def to_block(address: int, meta: dict, *, wait: bool = True) -> tuple[mx.array, mx.array]:
    """Returns (keys, values) of the payload at device `address` (pinned host memory, 16-byte
    aligned) described by `meta`, in the dtype they were computed in. With `wait` false they
    are not evaluated yet: the caller evaluates them (several blocks in one wait) and keeps
    the host memory until then."""
    dtype = getattr(mx, meta["dtype"])
    bits = meta.get("bits", 16)
    offsets = (0, values_offset(meta))
    out = []
    for i, (shape, offset) in enumerate(zip((meta["k_shape"], meta["v_shape"]), offsets)):
        *lead, dim = shape
        rows = 1
        for n in lead:
            rows *= n
        group = meta["group_sizes"][i] if bits != 16 else 1
        name, instance = to_block_kernel(meta["dtype"], dim, bits, group)
        out.append(mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=_cubin("kv_to_block", name, instance),
            inputs=[mx.array([address + offset], dtype=mx.uint64)], scalars=[_scalar(rows, "a region's rows")],
            grid=grid(rows * dim * dtype.size // 16), threadgroup=(THREADS, 1, 1),
            output_shapes=[tuple(shape)], output_dtypes=[dtype])[0])
    if wait:
        mx.eval(out)
    return out[0], out[1]


def unsupported(meta: dict) -> str | None:
    """Returns why the native kernels cannot move blocks of this meta, or None when they can."""
    if meta["dtype"] not in DTYPES:
        return f"no native kernel for {meta['dtype']} blocks"
    dtype = getattr(mx, meta["dtype"])
    vec = 16 // dtype.size
    for i, shape in enumerate((meta["k_shape"], meta["v_shape"])):
        dim = shape[-1]
        if (dim * dtype.size) % 16:
            return f"a head row of {dim * dtype.size} bytes is not a multiple of 16"
        if meta.get("bits", 16) != 16 and meta["group_sizes"][i] % vec:
            return f"groups of {meta['group_sizes'][i]} values do not split into {vec}-value loads"
    return None


def self_test(*, dtype: str = "bfloat16", k_dim: int = 64, v_dim: int = 64,
              bits: tuple[int, ...] = (16, 8, 4)) -> str | None:
    """Runs both kernels on a small random block of keys and values with these head
    dimensions, at each of `bits`, and compares them with the generic path; returns None
    when they agree, else what went wrong. (Compiling them is most of its time: see `warm`.)"""
    import numpy as np

    from appliance.kernels.kv_quant import unpack
    from appliance.kernels.pinned import PinnedBuffer

    try:
        mx.random.seed(0)
        keys = mx.random.normal((2, 2, 37, k_dim)).astype(getattr(mx, dtype))
        values = mx.random.normal((2, 2, 37, v_dim)).astype(getattr(mx, dtype))
        for b in bits:
            payload, meta = pack(keys, values, b)
            buf = PinnedBuffer(-(-payload_nbytes(meta) // 4096) * 4096)
            try:
                to_host([(payload, buf.device_address)])
                host = np.frombuffer(buf.view, dtype=np.uint8)[:payload.size]
                if not np.array_equal(host, np.array(payload)):
                    return f"to_host at {b} bits copied other bytes"
                k, v = to_block(buf.device_address, meta)
                gk, gv = unpack(payload, meta)
                for got, want in ((k, gk), (v, gv)):
                    err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
                    scale = mx.max(mx.abs(want.astype(mx.float32))).item()
                    if err > (0 if b == 16 else scale / 64):
                        return f"to_block at {b} bits differs from the generic path by {err}"
            finally:
                buf.free()
    except Exception as e:  # a compile or launch failure: the generic path serves
        return f"{type(e).__name__}: {e}"
    return None


_warmed: set[tuple] = set()
_warming = threading.Lock()  # one compile at a time: a second caller finds the work done


def warm(*, dtype: str, k_dim: int, v_dim: int, bits: tuple[int, ...]) -> str | None:
    """Compiles (and checks, as `self_test` does) the kernels for blocks of this dtype and
    these head dimensions at each of `bits`, once per process; returns what went wrong, or
    None. `to_block` has a kernel instance per dtype, head dimension and bits, compiled by
    NVRTC on a machine's first use (kept on disk for the next process) and loaded once per
    process: left to a model's first restore, compiling added ~2.2 s to it on an H200. Run it
    off the engine thread, on a stream of its own."""
    with _warming:
        todo = tuple(b for b in bits if (dtype, k_dim, v_dim, b) not in _warmed)
        if not todo:
            return None
        failure = self_test(dtype=dtype, k_dim=k_dim, v_dim=v_dim, bits=todo)
        if failure is None:
            _warmed.update((dtype, k_dim, v_dim, b) for b in todo)
        return failure
