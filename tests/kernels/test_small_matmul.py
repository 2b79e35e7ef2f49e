"""The small-matmul kernel: its instances compile wherever NVRTC is installed, and on an
NVIDIA GPU it computes what MLX's matmul does (`bench/gpu_run.sh kernels` runs it there)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from appliance.kernels import cubins, small_matmul
from appliance.kernels.registry import backend

on_cuda = pytest.mark.skipif(backend() != "cuda", reason=f"small_matmul runs on CUDA; this backend is {backend()}")

DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16}
# (tiles, warps, chunks, cols) the benchmarks may ask for, less those whose partial sums pass 48 KiB
INSTANCES = [(tiles, warps, chunks, cols) for tiles in (1, 2, 4, 8) for warps in (4, 8, 16) for chunks in (1, 2, 4, 8)
          for cols in (1, 2) if small_matmul.unsupported_kernel(tiles, warps, chunks, cols) is None]
# choices beside the defaults to compare with MLX on a GPU: (warps, chunks, cols)
CHOICES = [(8, 8, 1), (16, 2, 1), (4, 8, 1), (8, 4, 2), (8, 2, 2), (4, 4, 2), (8, 1, 2)]


@pytest.fixture
def for_hopper(monkeypatch):
    """Compiles kernels for an H100 or H200 here, whatever GPU (if any) this machine has."""
    monkeypatch.setattr(small_matmul, "compiled", lambda src, name: cubins.cubin(
        src, name=name, arch="sm_90", directory=None))
    monkeypatch.setattr(small_matmul, "_kernels", {})


@pytest.mark.usefixtures("needs_nvrtc", "for_hopper")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tiles", "warps", "chunks", "cols"), INSTANCES)
def test_every_instance_compiles_for_hopper(dtype, tiles, warps, chunks, cols):
    name, cubin = small_matmul.kernel(DTYPES[dtype], tiles, warps, chunks, cols)
    assert name == f"omlx_small_matmul_{dtype}_{tiles}_{warps}_{chunks}_{cols}"
    assert cubin.startswith(b"\x7fELF")


def test_the_choices_beyond_shared_memory_are_refused():
    # 1 and 2 tiles: all 24 choices; 4: all but 16 warps by 2 column tiles; 8: 4 warps by 1-2, 8 by 1
    assert len(INSTANCES) == 24 + 24 + (24 - 4) + (3 * 4)
    with pytest.raises(ValueError, match="shared memory"):
        small_matmul.kernel(mx.bfloat16, 8, 16, 1, 1)
    with pytest.raises(ValueError, match="shared memory"):
        small_matmul.kernel(mx.bfloat16, 8, 8, 1, 2)
    assert "1 to 32" in small_matmul.unsupported_kernel(1, 64, 1, 1)
    assert "column tiles" in small_matmul.unsupported_kernel(1, 8, 0, 1)
    assert "column tiles" in small_matmul.unsupported_kernel(1, 8, 1, 0)


def test_a_call_naming_no_choice_takes_the_modules(monkeypatch):
    assert [small_matmul.default_chunks(count) for count in (1, 2, 4, 8)] == [4, 2, 1, 1]  # the kernel's first rule
    assert small_matmul.default_cols(48) == 1
    monkeypatch.setattr(small_matmul, "CHUNKS", 8)
    monkeypatch.setattr(small_matmul, "COLS", 2)
    assert [small_matmul.default_chunks(count) for count in (1, 2, 4, 8)] == [8] * 4
    assert small_matmul.default_cols(4096) == 2
    assert small_matmul.default_cols(48) == 1  # 3 column tiles: in blocks of 1


def test_columns_not_in_blocks_of_cols_tiles_are_refused():
    w = mx.zeros((48, 128), dtype=mx.bfloat16)
    assert small_matmul.unsupported_weight(w) is None
    assert "32 x 32 tiles" in small_matmul.unsupported_weight(w, cols=2)
    assert "32 x 32 tiles" in small_matmul.unsupported(mx.zeros((8, 128), dtype=mx.bfloat16), w, cols=2)
    with pytest.raises(ValueError, match="48 columns are not in blocks of 2"):
        small_matmul.matmul(mx.zeros((8, 128), dtype=mx.bfloat16), w, cols=2)


@pytest.mark.parametrize(("rows", "tiles"), [(1, 1), (8, 1), (9, 2), (16, 2), (17, 4), (33, 8), (64, 8)])
def test_rows_take_the_fewest_tiles(rows, tiles):
    assert small_matmul.tiles(rows) == tiles


def test_what_the_kernel_cannot_compute_is_said():
    w = mx.zeros((64, 128), dtype=mx.bfloat16)
    assert small_matmul.unsupported(mx.zeros((8, 128), dtype=mx.bfloat16), w) is None
    assert "float32" in small_matmul.unsupported_weight(w.astype(mx.float32))
    assert "tiles" in small_matmul.unsupported_weight(mx.zeros((60, 128), dtype=mx.bfloat16))
    assert "tiles" in small_matmul.unsupported_weight(mx.zeros((64, 100), dtype=mx.bfloat16))
    assert "rows" in small_matmul.unsupported(mx.zeros((8, 128), dtype=mx.float16), w)
    assert "multiply" in small_matmul.unsupported(mx.zeros((8, 64), dtype=mx.bfloat16), w)
    assert "more than 64 rows" in small_matmul.unsupported(mx.zeros((65, 128), dtype=mx.bfloat16), w)


@on_cuda
def test_the_self_test_passes():
    assert small_matmul.self_test() is None


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32, 64])
@pytest.mark.parametrize(("n", "k"), [(64, 4096), (1024, 1024), (4096, 96)])
def test_it_computes_what_mlx_does(dtype, rows, n, k):
    mx.random.seed(rows)
    w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
    x = mx.random.normal((1, rows, k)).astype(dtype)  # a batch's leading axes are kept
    got = small_matmul.matmul(x, w)
    want = x @ w.T
    assert got.shape == want.shape and got.dtype == dtype
    err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
    assert err <= mx.max(mx.abs(want.astype(mx.float32))).item() / 128


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 8, 13, 32])  # 1, 2 and 4 tiles
@pytest.mark.parametrize(("n", "k"), [(64, 4096), (1024, 1024), (4096, 96)])
@pytest.mark.parametrize(("warps", "chunks", "cols"), CHOICES)
def test_every_choice_computes_what_mlx_does(dtype, rows, n, k, warps, chunks, cols):
    mx.random.seed(rows)
    w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
    x = mx.random.normal((rows, k)).astype(dtype)
    got = small_matmul.matmul(x, w, warps=warps, chunks=chunks, cols=cols)
    want = (x @ w.T).astype(mx.float32)
    err = mx.max(mx.abs(got.astype(mx.float32) - want)).item()
    assert err <= mx.max(mx.abs(want)).item() / 128


@on_cuda
@pytest.mark.parametrize("n", [48, 4096])  # 3 column tiles: COLS = 2 falls back to 1
def test_the_modules_choices_compute_what_mlx_does(n, monkeypatch):
    for name, value in (("WARPS", 4), ("CHUNKS", 8), ("COLS", 2)):
        monkeypatch.setattr(small_matmul, name, value)
    w = (mx.random.normal((n, 1024)) / 32).astype(mx.bfloat16)
    x = mx.random.normal((8, 1024)).astype(mx.bfloat16)
    assert mx.allclose(small_matmul.matmul(x, w), x @ w.T, atol=0.05, rtol=0.02)


@on_cuda
def test_a_strided_input_is_made_contiguous_first():
    w = (mx.random.normal((128, 256)) / 16).astype(mx.bfloat16)
    x = mx.random.normal((256, 8)).astype(mx.bfloat16).T  # 8 rows, column-major
    assert mx.allclose(small_matmul.matmul(x, w), x @ w.T, atol=0.05, rtol=0.02)
