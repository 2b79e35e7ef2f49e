"""MLX's kernels shipped compiled: a pack's modules are written where and as MLX reads them
instead of compiled, only for the build, architecture and driver they fit, only where the
source is the manifest's, and a pack that cannot be read costs nothing but the compile."""

from __future__ import annotations

import logging
import struct
import zipfile
from dataclasses import replace

import pytest

from appliance.kernels import ahead, packs
from appliance.kernels.cuda_driver import CudaError
from tests.kernels.test_ahead import FLAGS, HEADERS, SOURCE, manifest, module

CUBIN = b"\x7fELF a cubin"
NAMES = "mlx::core::cu::scale<float, 2>\t_Z5scaleIfLi2EEvPT_\n"
EM_CUDA = 190


def shipped(tmp_path, *modules: packs.Compiled, build: str = "build-a", arch: str = "sm_90a",
            nvrtc: tuple[int, int] = (13, 0)) -> packs.Pack:
    path = packs.pack_path(tmp_path, "0.0.1", arch)
    packs.write(path, mlx="0.0.1", build=build, arch=arch, nvrtc=nvrtc, modules=list(modules))
    return packs.load(path)


def test_a_module_in_the_pack_is_written_as_mlx_reads_it_and_not_compiled(tmp_path):
    pack = shipped(tmp_path, packs.Compiled("first", SOURCE, CUBIN, NAMES))
    cache = tmp_path / "cache"
    # No NVRTC is needed: nothing compiles (a compile would fail here, without the headers).
    report = ahead.compile_ahead(manifest(module("first"), marks=("omlx-batch-changes-v2-bfloat16",)), cache,
                                 flags=FLAGS, headers={}, workers=1, pack=pack)
    assert report.shipped == 1 and report.compiled == {} and report.present == 0
    ptx = ahead.module_path(cache, "first")
    assert ptx.read_bytes() == CUBIN
    assert ptx.with_suffix(".txt").read_text() == NAMES
    assert ptx.with_suffix(".cu").read_text() == SOURCE
    assert (cache / "omlx-batch-changes-v2-bfloat16").is_file()  # every module there: the mark too
    assert not list(cache.rglob(".ahead-*"))
    again = ahead.compile_ahead(manifest(module("first")), cache, flags=FLAGS, headers={}, workers=1)
    assert again.present == 1 and again.shipped == 0  # a later start finds it there


@pytest.mark.usefixtures("needs_nvrtc")
def test_what_the_pack_lacks_or_holds_of_another_source_is_compiled(tmp_path):
    pack = shipped(tmp_path, packs.Compiled("first", SOURCE, CUBIN, NAMES),
                   packs.Compiled("changed", SOURCE.replace("twice", "twice "), CUBIN, NAMES))
    cache = tmp_path / "cache"
    report = ahead.compile_ahead(manifest(module("first"), module("changed"), module("new")), cache, flags=FLAGS,
                                 headers=HEADERS, workers=2, pack=pack)
    assert report.shipped == 1 and set(report.compiled) == {"changed", "new"}
    assert ahead.module_path(cache, "first").read_bytes() == CUBIN
    assert ahead.module_path(cache, "changed").read_bytes().startswith(b"\x7fELF\x02")  # NVRTC's, not the pack's


@pytest.mark.usefixtures("needs_nvrtc")
def test_a_cubin_this_gpu_cannot_load_is_compiled_instead(tmp_path):
    def refuse(cubin: bytes) -> None:  # the driver's answer to a cubin of a newer format, injected
        raise CudaError("cuModuleLoadData failed with CUDA driver error 222")

    pack = replace(shipped(tmp_path, packs.Compiled("first", SOURCE, CUBIN, NAMES)), verify=refuse)
    report = ahead.compile_ahead(manifest(module("first")), tmp_path / "cache", flags=FLAGS, headers=HEADERS,
                                 workers=1, pack=pack)
    assert report.shipped == 0 and set(report.compiled) == {"first"}
    assert ahead.module_path(tmp_path / "cache", "first").read_bytes() != CUBIN


def test_a_pack_is_found_only_for_its_build_and_architecture_and_a_driver_as_new_as_its_nvrtc(tmp_path):
    shipped(tmp_path, packs.Compiled("first", SOURCE, CUBIN, NAMES), nvrtc=(13, 0))
    found = packs.find(tmp_path, mlx="0.0.1", build="build-a", arch="sm_90a", driver=(13, 0))
    assert found is not None and found.sources == {"first": packs.digest(SOURCE)}
    assert packs.find(tmp_path, mlx="0.0.1", build="build-b", arch="sm_90a", driver=(13, 0)) is None
    assert packs.find(tmp_path, mlx="0.0.1", build="build-a", arch="sm_100a", driver=(13, 0)) is None
    assert packs.find(tmp_path, mlx="0.0.1", build="build-a", arch="sm_90a", driver=(12, 9)) is None
    assert packs.find(tmp_path, mlx="0.0.2", build="build-a", arch="sm_90a", driver=(13, 0)) is None


@pytest.mark.usefixtures("needs_nvrtc")
def test_a_pack_that_cannot_be_read_is_not_used_and_every_module_still_compiles(tmp_path, caplog):
    path = packs.pack_path(tmp_path, "0.0.1", "sm_90a")
    path.write_bytes(b"PK\x03\x04 half a zip")
    with caplog.at_level(logging.WARNING, logger="omlx.kernels"):
        assert packs.find(tmp_path, mlx="0.0.1", build="build-a", arch="sm_90a", driver=(13, 0)) is None
    assert "cannot be read" in caplog.text
    # An index that names a module the archive lacks: that module compiles.
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(packs.INDEX, '{"mlx": "0.0.1", "build": "build-a", "arch": "sm_90a", "nvrtc": [13, 0], '
                                f'"modules": {{"first": "{packs.digest(SOURCE)}"}}}}')
    pack = packs.find(tmp_path, mlx="0.0.1", build="build-a", arch="sm_90a", driver=(13, 0))
    assert pack is not None
    report = ahead.compile_ahead(manifest(module("first")), tmp_path / "cache", flags=FLAGS, headers=HEADERS,
                                 workers=1, pack=pack)
    assert report.shipped == 0 and set(report.compiled) == {"first"}
    assert ahead.module_path(tmp_path / "cache", "first").read_bytes().startswith(b"\x7fELF\x02")


def test_the_shipped_packs_hold_every_module_of_their_manifest_for_their_architecture():
    zips = sorted(ahead.MANIFESTS.glob("mlx-*-sm_*.zip"))
    assert zips, "omlx ships at least the pack for H100s and H200s"
    for path in zips:
        pack = packs.load(path)
        assert path == packs.pack_path(ahead.MANIFESTS, pack.mlx, pack.arch)
        recorded = ahead.load(ahead.MANIFESTS / f"mlx-{pack.mlx}.json")
        assert pack.build == recorded.build
        assert pack.sources == {m.name: packs.digest(m.source) for m in recorded.modules}
        sm = int(pack.arch.removeprefix("sm_").rstrip("a"))
        for m in recorded.modules:
            cubin, names = pack.read(m.name, m.source)
            assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<H", cubin, 0x12)[0] == EM_CUDA
            assert struct.unpack_from("<I", cubin, 0x30)[0] >> 8 & 0xFF == sm  # e_flags: the SM it runs on
            assert [line.split("\t")[0] for line in names.splitlines()] == list(m.kernels)
