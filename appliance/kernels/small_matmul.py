"""Matmuls of a few rows (a decode pass's) natively on CUDA, to spare the host.

A decode pass of a few sequences on MLX CUDA is bound by the host, not the GPU
(BENCHMARKS.md, "A decode pass is host-bound"), and most of the host's work is MLX's
submission of the pass's ~200 matmuls: MLX runs each through cuBLASLt, making its
descriptors and asking cuBLASLt's heuristic anew every call. `matmul` runs `x @ w.T` for up
to 64 rows of x instead through one kernel of ours (kernels/cuda/small_matmul.cu, on tensor
cores), which MLX launches as it launches its own kernels. Compiled by NVRTC once per
machine (kernels/cubins.py), like the KV kernels.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from appliance.kernels.cubins import DTYPES, compiled, source

MAX_ROWS = 64  # the most rows the kernel takes
ROWS = 16  # the most rows models run through it (models/native_linear.py): beyond, cuBLASLt's GPU time is less
TILE_ROWS = 8  # rows of x per mma tile
BLOCK_COLUMNS = 16  # columns of y per block
CHUNK = 32  # values of K per warp step
WARPS = 8  # warps a block, splitting K: on an H100 as fast as 4 or faster for each of an 8B model's weights

ENABLED = False  # whether models run their few-row matmuls here (kernels/registry.py sets it)
# Whether engines choose per count of rows, from measured passes, between this kernel and
# MLX's matmuls while ENABLED (`auto`; engine/matmul_choice.py); else they run this one.
MEASURED = False

_thread = threading.local()  # `on`: this thread's choice while ENABLED (set by `use_here`)

_kernels: dict[tuple, tuple[str, bytes]] = {}


def use_here(on: bool) -> None:
    """Makes this thread's models run their few-row matmuls here (`on`, the default) or
    by MLX's matmuls, while ENABLED: an engine's own choice (engine/matmul_choice.py)."""
    _thread.on = on


def in_use() -> bool:
    """Returns whether a model called on this thread runs its few-row matmuls here."""
    return ENABLED and getattr(_thread, "on", True)


def unsupported_weight(w: mx.array) -> str | None:
    """Returns why `matmul` cannot take `w` as its weight, or None when it can."""
    if w.dtype not in (mx.bfloat16, mx.float16):
        return f"no native kernel for {w.dtype} weights"
    if w.ndim != 2 or w.shape[0] % BLOCK_COLUMNS or w.shape[1] % CHUNK:
        return f"a {w.shape} weight is not in {BLOCK_COLUMNS} x {CHUNK} tiles"
    return None


def unsupported(x: mx.array, w: mx.array) -> str | None:
    """Returns why `matmul` cannot compute x @ w.T, or None when it can."""
    if (why := unsupported_weight(w)) is not None:
        return why
    if x.dtype != w.dtype:
        return f"{x.dtype} rows for {w.dtype} weights"
    if x.shape[-1] != w.shape[1]:
        return f"shapes {x.shape} and {w.shape} do not multiply as x @ w.T"
    if x.size > MAX_ROWS * w.shape[1]:
        return f"more than {MAX_ROWS} rows"
    return None


def tiles(rows: int) -> int:
    """Returns the 8-row tiles of x the kernel takes for `rows` rows: the fewest (1, 2, 4, 8)."""
    count = 1
    while count * TILE_ROWS < rows:
        count *= 2
    return count


def kernel(dtype: mx.Dtype, count: int, warps: int) -> tuple[str, bytes]:
    """Returns (name, cubin) of the kernel for `count` tiles and `warps` warps (compiled
    once per machine, loaded once per process)."""
    key = (dtype, count, warps)
    if key not in _kernels:
        t = DTYPES[str(dtype).removeprefix("mlx.core.")]
        name = f"omlx_small_matmul_{t}_{count}_{warps}"
        instance = (f'extern "C" __global__ void __launch_bounds__({warps * 32}) {name}('
                    f"const {t}* x, const {t}* w, {t}* y, int m, int n, int k) "
                    f"{{ small_matmul<{t}, {count}, {warps}>(x, w, y, m, n, k); }}\n")
        _kernels[key] = name, compiled(source("small_matmul", instance), name)
    return _kernels[key]


def matmul(x: mx.array, w: mx.array, *, warps: int = WARPS) -> mx.array:
    """Returns x @ w.T (x [..., K] of at most MAX_ROWS rows, w [N, K]; see `unsupported`)."""
    n, k = w.shape
    rows = x.size // k
    name, cubin = kernel(x.dtype, tiles(rows), warps)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[x, w], scalars=[rows, n, k],
        grid=(n // BLOCK_COLUMNS * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype], ensure_row_contiguous=True)[0]


def self_test() -> str | None:
    """Compares `matmul` with MLX's for the rows and dtypes models run through it (so the
    kernels a decode pass takes are compiled and loaded before it needs them); returns
    None when they agree (to bfloat16's rounding), else what went wrong."""
    try:
        mx.random.seed(0)
        for dtype in (mx.bfloat16, mx.float16):
            w = (mx.random.normal((48, 96)) / 10).astype(dtype)
            for rows in (2, ROWS, MAX_ROWS):  # 1, 2 and 8 tiles
                x = mx.random.normal((rows, 96)).astype(dtype)
                want = (x @ w.T).astype(mx.float32)
                err = mx.max(mx.abs(matmul(x, w).astype(mx.float32) - want)).item()
                if err > mx.max(mx.abs(want)).item() / 64:
                    return f"small_matmul of {rows} {dtype} rows differs from MLX's by {err}"
    except Exception as e:  # a compile or launch failure: MLX's matmul serves
        return f"{type(e).__name__}: {e}"
    return None
