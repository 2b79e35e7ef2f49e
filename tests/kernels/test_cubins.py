"""Cubins kept on disk: compiled once, read back intact, recompiled when damaged, and a
directory that cannot be written costs only the compile (real NVRTC, real files)."""

from __future__ import annotations

import os

import pytest

from appliance.kernels import cubins

SOURCE = 'extern "C" __global__ void omlx_test_copy(const int* a, int* b) { b[threadIdx.x] = a[threadIdx.x]; }'


pytestmark = pytest.mark.usefixtures("needs_nvrtc")


def kept(directory):
    return sorted(directory.glob("*.cubin"))


def test_a_cubin_is_compiled_once_and_read_back(tmp_path):
    first = cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path)
    [path] = kept(tmp_path)
    assert path.name.startswith("copy-")
    written = path.stat().st_mtime_ns
    assert cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path) == first
    assert path.stat().st_mtime_ns == written  # read, not compiled and written again
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_another_source_or_architecture_is_kept_apart(tmp_path):
    cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path)
    cubins.cubin(SOURCE + "\n// changed", name="copy", arch="sm_90", directory=tmp_path)
    cubins.cubin(SOURCE, name="copy", arch="sm_80", directory=tmp_path)
    assert len(kept(tmp_path)) == 3


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_damaged_cubin_is_compiled_again_and_replaced(tmp_path, damage, caplog):
    good = cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path)
    [path] = kept(tmp_path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:100], "flipped": data[:50] + bytes([data[50] ^ 1]) + data[51:],
                      "empty": b""}[damage])
    assert cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path) == good
    assert "damaged" in caplog.text
    assert path.read_bytes() == data


def test_a_directory_that_cannot_be_written_costs_only_the_compile(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    cubin = cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=blocked / "kernels")
    assert cubin.startswith(b"\x7fELF")
    assert "not kept" in caplog.text


def test_a_full_disk_leaves_no_half_file(tmp_path, monkeypatch, caplog):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # the fault: the write's last step fails
    assert cubins.cubin(SOURCE, name="copy", arch="sm_90", directory=tmp_path).startswith(b"\x7fELF")
    assert list(tmp_path.iterdir()) == []
    assert "No space left" in caplog.text
