"""NVRTC compiles the native kernels' sources on any Linux x86-64 machine (the test extra
brings libnvrtc; no GPU is needed to compile), so a source that NVRTC refuses fails here
rather than on a GPU's first start."""

from __future__ import annotations

import pytest

from appliance.kernels import cubins, kv_move, nvrtc

pytestmark = pytest.mark.usefixtures("needs_nvrtc")

ELF = b"\x7fELF"


def test_the_gather_to_host_compiles_to_a_cubin():
    cubin = nvrtc.compile_cubin(cubins.source("kv_to_host"), name="kv_to_host", arch="sm_90",
                                options=cubins.OPTIONS)
    assert cubin.startswith(ELF)
    assert b"omlx_kv_to_host" in cubin  # extern "C": the name precompiled_cuda_kernel asks for


def test_the_copy_from_host_compiles_to_a_cubin():
    cubin = nvrtc.compile_cubin(cubins.source("copy_from_host"), name="copy_from_host", arch="sm_90",
                                options=cubins.OPTIONS)
    assert cubin.startswith(ELF)
    assert b"omlx_copy_from_host" in cubin  # the name models/weights.py runs it under


@pytest.mark.parametrize("dtype", sorted(cubins.DTYPES))
@pytest.mark.parametrize("bits,group", [(16, 1), (8, 64), (4, 32)])
def test_every_dequantize_instance_compiles_under_its_name(dtype, bits, group):
    name, instance = kv_move.to_block_kernel(dtype, 128, bits, group)
    cubin = nvrtc.compile_cubin(cubins.source("kv_to_block", instance), name=name, arch="sm_90",
                                options=cubins.OPTIONS)
    assert cubin.startswith(ELF)
    assert name.encode() in cubin


def test_a_source_nvrtc_refuses_raises_with_its_log():
    with pytest.raises(nvrtc.CompileError, match=r"(?s)broken did not compile for sm_90.*undefined_thing"):
        nvrtc.compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', name="broken", arch="sm_90")


def test_an_unknown_architecture_is_refused_with_a_reason():
    with pytest.raises(nvrtc.CompileError, match="sm_1"):
        nvrtc.compile_cubin('extern "C" __global__ void k() {}', name="k", arch="sm_1")
