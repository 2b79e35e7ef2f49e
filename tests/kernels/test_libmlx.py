"""What libmlx holds, read without running it: a CUDA build's device headers (here from a
cubin NVRTC compiles with such symbols), the build's RECORD hash, the include paths."""

from __future__ import annotations

import base64
import hashlib

import pytest

from appliance.kernels import libmlx, nvrtc

SOURCES = r'''
namespace mlx { namespace core {
static __device__ const char jit_source_utils[] = "// utils\n#pragma once\n";
static __device__ const char jit_source_config[] = "// config";
} }
extern "C" __global__ void k(char* out) {
  out[threadIdx.x] = mlx::core::jit_source_utils[threadIdx.x] + mlx::core::jit_source_config[threadIdx.x];
}
'''


@pytest.mark.usefixtures("needs_nvrtc")
def test_the_device_headers_are_read_from_the_symbol_table_under_mlxs_include_names(tmp_path):
    library = tmp_path / "libmlx.so"
    library.write_bytes(nvrtc.compile_cubin(SOURCES, name="sources", arch="sm_90"))  # an ELF with such symbols
    assert libmlx.headers(library) == {
        "mlx/backend/cuda/device/utils.cuh": "// utils\n#pragma once\n",
        "mlx/backend/cuda/device/config.h": "// config",
    }


def test_a_build_without_cuda_sources_has_no_headers():
    library = libmlx.path()  # the CPU build the tests run on
    assert library is not None and library.name == "libmlx.so"
    assert libmlx.headers(library) == {}


def test_a_file_that_is_not_a_library_has_no_headers(tmp_path):
    junk = tmp_path / "libmlx.so"
    junk.write_bytes(b"not an ELF file at all")
    assert libmlx.headers(junk) == {}


def test_the_build_id_is_the_sha256_the_wheels_record_gives_the_library():
    library = libmlx.path()
    digest = base64.urlsafe_b64encode(hashlib.sha256(library.read_bytes()).digest()).rstrip(b"=").decode()
    assert libmlx.build_id(library) == digest


def test_a_library_no_record_names_has_no_build_id(tmp_path):
    library = tmp_path / "mlx" / "lib" / "libmlx.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF")
    assert libmlx.build_id(library) is None


def test_the_include_paths_are_mlxs_own_then_cccls_then_cudas(tmp_path, monkeypatch):
    library = tmp_path / "site" / "mlx" / "lib" / "libmlx.so"
    for d in ("site/mlx/lib", "site/mlx/include/cccl", "site/nvidia/cu13/include"):
        (tmp_path / d).mkdir(parents=True)
    assert libmlx.include_paths(library) == (f"--include-path={tmp_path}/site/mlx/include",
                                             f"--include-path={tmp_path}/site/mlx/include/cccl",
                                             f"--include-path={tmp_path}/site/nvidia/cu13/include")
    (tmp_path / "site/nvidia/cu13/include").rmdir()
    (tmp_path / "toolkit/include").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert libmlx.include_paths(library)[-1] == f"--include-path={tmp_path}/toolkit/include"
