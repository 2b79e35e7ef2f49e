"""The small-matmul kernel: its instances compile wherever NVRTC is installed, and on an
NVIDIA GPU it computes what MLX's matmul does (`bench/gpu_run.sh kernels` runs it there)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from appliance.kernels import cubins, small_matmul
from appliance.kernels.registry import backend

on_cuda = pytest.mark.skipif(backend() != "cuda", reason=f"small_matmul runs on CUDA; this backend is {backend()}")


@pytest.mark.usefixtures("needs_nvrtc")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("tiles", [1, 2, 4, 8])
@pytest.mark.parametrize("warps", [4, 8])
def test_every_instance_compiles_for_hopper(dtype, tiles, warps, monkeypatch):
    compiled = {}
    monkeypatch.setattr(small_matmul, "compiled", lambda src, name: compiled.setdefault(
        name, cubins.cubin(src, name=name, arch="sm_90", directory=None)))
    monkeypatch.setattr(small_matmul, "_kernels", {})
    name, cubin = small_matmul.kernel(getattr(mx, {"bf16": "bfloat16", "f16": "float16"}[dtype]), tiles, warps)
    assert name == f"omlx_small_matmul_{dtype}_{tiles}_{warps}"
    assert cubin.startswith(b"\x7fELF")


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
def test_a_strided_input_is_made_contiguous_first():
    w = (mx.random.normal((128, 256)) / 16).astype(mx.bfloat16)
    x = mx.random.normal((256, 8)).astype(mx.bfloat16).T  # 8 rows, column-major
    assert mx.allclose(small_matmul.matmul(x, w), x @ w.T, atol=0.05, rtol=0.02)
