"""The Linux process environment: OpenBLAS preloading, glibc malloc tunables, a pre-touched heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from appliance import platform
from appliance.platform import MALLOC_TUNABLES, process_env

OURS = ":".join(f"{k}={v}" for k, v in MALLOC_TUNABLES.items())
linux_glibc = pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.is_glibc()),
                                 reason="glibc on Linux only")


def test_adds_openblas_and_the_malloc_tunables_once():
    env = process_env({"PATH": "/bin", "LD_PRELOAD": "/x.so"}, blas="/blas.so", blas_loaded=False, glibc=True)
    assert env["LD_PRELOAD"] == "/blas.so:/x.so"
    assert env["GLIBC_TUNABLES"] == OURS
    assert env["PATH"] == "/bin"
    assert process_env(env, blas="/blas.so", blas_loaded=False, glibc=True) is None  # re-executed once only


def test_keeps_tunables_the_user_set():
    env = process_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.mem.tagging=1"}, blas=None,
                      blas_loaded=False, glibc=True)
    tunables = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.malloc.arena_max=4" in tunables and "glibc.mem.tagging=1" in tunables
    assert "glibc.malloc.arena_max=1" not in tunables
    assert f"glibc.malloc.trim_threshold={MALLOC_TUNABLES['glibc.malloc.trim_threshold']}" in tunables


def test_nothing_to_change_means_no_re_exec():
    assert process_env({"GLIBC_TUNABLES": OURS}, blas="/blas.so", blas_loaded=True, glibc=True) is None
    assert process_env({}, blas=None, blas_loaded=False, glibc=False) is None  # musl, no OpenBLAS


def test_preload_puts_the_library_first_once():
    assert platform.preload({"LD_PRELOAD": "/x.so"}, "/blas.so")["LD_PRELOAD"] == "/blas.so:/x.so"
    assert platform.preload({}, "/blas.so")["LD_PRELOAD"] == "/blas.so"
    assert platform.preload({"LD_PRELOAD": "/x.so:/blas.so"}, "/blas.so")["LD_PRELOAD"] == "/x.so:/blas.so"
    assert platform.preload({"PATH": "/bin"}, None) == {"PATH": "/bin"}  # not installed: unchanged


def test_a_child_environment_preloads_the_installed_openblas():
    env = platform.openblas_env({"PATH": "/bin"})
    assert env.get("LD_PRELOAD") == platform.openblas_path()  # None where OpenBLAS is absent
    assert env["PATH"] == "/bin"


def run_python(code: str) -> str:
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("GLIBC_TUNABLES", "OMLX_PROCESS_ENV")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@linux_glibc
def test_the_process_re_executes_itself_with_the_tunables():
    out = run_python("from appliance import platform; platform.ensure_process_env(); "
                     "print(platform.malloc_tuned())")
    assert out.split() == ["True"]


@linux_glibc
def test_the_malloc_tunables_can_be_left_out():
    out = run_python("from appliance import platform; platform.ensure_process_env(malloc=False); "
                     "print(platform.malloc_tuned())")
    assert out.split() == ["False"]


@linux_glibc
def test_omlx_serve_re_executes_before_the_cli_imports(tmp_path):
    # -X importtime survives the re-exec: what the first process imported shows twice.
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OMLX_PROCESS_ENV")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "appliance", "serve", "--config",
                           str(tmp_path / "missing.toml")], env=env, capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported.count("appliance.platform") == 2  # it did re-execute
    assert imported.count("pydantic") == 1 and imported.count("appliance.cli") == 1


@linux_glibc
def test_a_pre_touched_heap_serves_later_buffers_without_page_faults():
    # Fresh pages show as minor faults (how many pages one fault maps varies by kernel):
    # after prefault_heap, 200 MiB of buffers under the mmap threshold need almost none.
    code = """
import resource, sys
import numpy as np
from appliance import platform
platform.ensure_process_env()
touched = platform.prefault_heap(int(sys.argv[1]) << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bufs = [np.ones(10 << 20, dtype=np.uint8) for _ in range(20)]
print(touched >> 20, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    pages = (200 << 20) // 4096
    touched, warm_faults = map(int, run_python(code.replace("sys.argv[1]", "256")).split())
    assert touched == 256 and warm_faults < pages // 100
    touched, cold_faults = map(int, run_python(code.replace("sys.argv[1]", "0")).split())
    assert touched == 0 and cold_faults > 10 * max(warm_faults, 1)


def test_the_mlx_memory_limit_leaves_headroom_by_default_and_caps_the_spec():
    device = 141 * 10**9
    assert platform.memory_limit_bytes(device, None) == int(device * 0.85)
    assert platform.memory_limit_bytes(device, 100) == 100 * 2**30
    assert platform.memory_limit_bytes(device, 500) == int(device * 0.95)  # never the whole card


def test_no_memory_limit_is_set_on_a_cpu():
    if platform.device_kind() == "cpu":
        assert platform.limit_device_memory(10) is None


def test_compiled_kernels_are_kept_in_the_cache_dir_unless_the_environment_says(tmp_path, monkeypatch):
    import mlx.core as mx

    monkeypatch.delenv(platform.KERNEL_CACHE_ENV, raising=False)
    kept = platform.keep_compiled_kernels(tmp_path)
    assert kept == tmp_path / "kernels" / f"mlx-{mx.__version__}"
    assert os.environ[platform.KERNEL_CACHE_ENV] == str(kept)
    monkeypatch.setenv(platform.KERNEL_CACHE_ENV, "/elsewhere")
    assert platform.keep_compiled_kernels(tmp_path) is None
    assert os.environ[platform.KERNEL_CACHE_ENV] == "/elsewhere"


def test_auto_asks_for_a_feature_on_cuda_only():
    """The `auto` / `on` / `off` keys (`fuse_projections`, `compile_blocks`,
    `warm_up_beside_load`, `idle_shapes`)."""
    import mlx.core as mx

    assert platform.wanted_here("on") and not platform.wanted_here("off")
    assert platform.wanted_here("auto") == mx.cuda.is_available()
