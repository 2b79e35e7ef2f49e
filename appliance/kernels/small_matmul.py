"""Matmuls of a few rows (a decode pass's) natively on CUDA, to spare the host.

A decode pass of a few sequences on MLX CUDA is bound by the host, not the GPU
(BENCHMARKS.md, "A decode pass is host-bound"), and most of the host's work is MLX's
submission of the pass's ~200 matmuls: MLX runs each through cuBLASLt, making its
descriptors and asking cuBLASLt's heuristic anew every call. `matmul` runs `x @ w.T` for up
to 64 rows of x instead through one kernel of ours (kernels/cuda/small_matmul.cu, on tensor
cores), which MLX launches as it launches its own kernels. Compiled by NVRTC once per
machine, like the KV kernels (kernels/kv_move.py), one instance per choice of tiles of x,
warps, chunks of K a load and column tiles of y: bench/matmul_host.py and
bench/decode_host.py compare choices (`native:W:C:B`) on a GPU.
"""

from __future__ import annotations

import mlx.core as mx

from appliance.kernels.kv_move import DTYPES, compiled, source

MAX_ROWS = 64  # the most rows the kernel takes
ROWS = 16  # the most rows models run through it (models/native_linear.py): beyond, cuBLASLt's GPU time is less
TILE_ROWS = 8  # rows of x per mma tile
TILE_COLUMNS = 16  # columns of y (rows of w) per mma tile
CHUNK = 32  # values of K per warp step
MAX_WARPS = 32  # a block's 1,024 threads
SHARED_BYTES = 48 * 1024  # the static shared memory a block may have, which holds its warps' partial sums

# The kernel's choices where a call names none, read at each call (bench/decode_host.py sets
# them for a pass). The defaults are the choices measured best so far.
WARPS = 8  # warps a block, splitting K: on an H100 as fast as 4 or faster for each of an 8B model's weights
CHUNKS: int | None = None  # chunks of K a warp loads before its mmas; None: `default_chunks`' rule
COLS = 1  # 16-column tiles of y a block computes, sharing each load of x; where it does not divide N's, 1

ENABLED = False  # whether models run their few-row matmuls here (kernels/registry.py sets it)

_kernels: dict[tuple, tuple[str, bytes]] = {}


def unsupported_weight(w: mx.array, *, cols: int = 1) -> str | None:
    """Returns why `matmul` cannot take `w` as its weight in blocks of `cols` column tiles,
    or None when it can."""
    if w.dtype not in (mx.bfloat16, mx.float16):
        return f"no native kernel for {w.dtype} weights"
    if w.ndim != 2 or w.shape[0] % (TILE_COLUMNS * cols) or w.shape[1] % CHUNK:
        return f"a {w.shape} weight is not in {TILE_COLUMNS * cols} x {CHUNK} tiles"
    return None


def unsupported(x: mx.array, w: mx.array, *, cols: int = 1) -> str | None:
    """Returns why `matmul` cannot compute x @ w.T in blocks of `cols` column tiles, or None
    when it can."""
    if (why := unsupported_weight(w, cols=cols)) is not None:
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


def default_chunks(count: int) -> int:
    """Returns the chunks of K a warp loads before its mmas for `count` tiles where a call
    names none: CHUNKS, or where that is None, enough for 4 tiles' mmas a load (1 from 4 tiles on)."""
    if CHUNKS is not None:
        return CHUNKS
    return 1 if count >= 4 else 4 // count


def default_cols(n: int) -> int:
    """Returns the column tiles a block computes for a weight of `n` rows where a call names
    none: COLS where it divides n's tiles, else 1 (a model's every Linear runs, whatever COLS)."""
    return COLS if n % (TILE_COLUMNS * COLS) == 0 else 1


def unsupported_kernel(count: int, warps: int, chunks: int, cols: int) -> str | None:
    """Returns why no kernel of `count` tiles, `warps` warps, `chunks` chunks a load and
    `cols` column tiles is built, or None when one is."""
    if not (1 <= warps <= MAX_WARPS and chunks >= 1 and cols >= 1):
        return f"no kernel of {warps} warps (1 to {MAX_WARPS}), {chunks} chunks and {cols} column tiles (1 on)"
    partial_bytes = warps * count * TILE_ROWS * cols * TILE_COLUMNS * 4
    if partial_bytes > SHARED_BYTES:
        return (f"{warps} warps' partial sums of {count} tiles by {cols} column tiles take {partial_bytes} bytes "
                f"of shared memory, more than {SHARED_BYTES}")
    return None


def kernel(dtype: mx.Dtype, count: int, warps: int, chunks: int, cols: int) -> tuple[str, bytes]:
    """Returns (name, cubin) of the kernel for `count` tiles, `warps` warps, `chunks` chunks
    a load and `cols` column tiles (compiled once per machine, loaded once per process);
    ValueError where `unsupported_kernel` says why not."""
    key = (dtype, count, warps, chunks, cols)
    if key not in _kernels:
        if (why := unsupported_kernel(count, warps, chunks, cols)) is not None:
            raise ValueError(why)
        t = DTYPES[str(dtype).removeprefix("mlx.core.")]
        name = f"omlx_small_matmul_{t}_{count}_{warps}_{chunks}_{cols}"
        instance = (f'extern "C" __global__ void __launch_bounds__({warps * 32}) {name}('
                    f"const {t}* x, const {t}* w, {t}* y, int m, int n, int k) "
                    f"{{ small_matmul<{t}, {count}, {warps}, {chunks}, {cols}>(x, w, y, m, n, k); }}\n")
        _kernels[key] = name, compiled(source("small_matmul", instance), name)
    return _kernels[key]


def matmul(x: mx.array, w: mx.array, *, warps: int | None = None, chunks: int | None = None,
           cols: int | None = None) -> mx.array:
    """Returns x @ w.T (x [..., K] of at most MAX_ROWS rows, w [N, K]; see `unsupported`),
    by the kernel of `warps`, `chunks` and `cols` (None: WARPS, `default_chunks`,
    `default_cols`); ValueError where N is not in blocks of `cols` column tiles."""
    n, k = w.shape
    rows = x.size // k
    count = tiles(rows)
    warps = WARPS if warps is None else warps
    cols = default_cols(n) if cols is None else cols
    if n % (TILE_COLUMNS * cols):  # the kernel would write past y's rows
        raise ValueError(f"{n} columns are not in blocks of {cols} column tiles")
    name, cubin = kernel(x.dtype, count, warps, default_chunks(count) if chunks is None else chunks, cols)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[x, w], scalars=[rows, n, k],
        grid=(n // (TILE_COLUMNS * cols) * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
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
