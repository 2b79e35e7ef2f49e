"""MLX's kernels compiled ahead: modules of a manifest compiled by NVRTC in processes of their
own (no GPU is needed to compile) and written where and as MLX CUDA reads them, recorded
back from such a directory, and never applied to another build of MLX."""

from __future__ import annotations

import pytest

from appliance.kernels import ahead

HEADERS = {"mlx/backend/cuda/device/utils.cuh": "#pragma once\ntemplate <typename T> __device__ T twice(T x) "
                                                 "{ return x + x; }\n"}
SOURCE = '''#include "mlx/backend/cuda/device/utils.cuh"
namespace mlx::core::cu {
template <typename T, int N>
__global__ void scale(T* out) { out[threadIdx.x] = twice(out[threadIdx.x]) * N; }
}
'''
FLAGS = ("--device-as-default-execution-space", "--gpu-architecture=sm_90a", "--split-compile=0")
ELF = b"\x7fELF"


BF16, QUANTIZED = ("bfloat16",), ("bfloat16", "uint32")


def module(name: str, source: str = SOURCE, kinds: tuple[str, ...] = ()) -> ahead.Module:
    return ahead.Module(name, source, ("mlx::core::cu::scale<float, 2>", "mlx::core::cu::scale<int, 3>"), kinds)


def manifest(*modules: ahead.Module, marks: tuple[str | ahead.Mark, ...] = ()) -> ahead.Manifest:
    return ahead.Manifest(mlx="0.0.1", build="build-a", modules=modules,
                          marks=tuple(ahead.Mark(m) if isinstance(m, str) else m for m in marks))


def test_a_module_is_kept_where_mlx_keeps_it_long_names_in_directories(tmp_path):
    assert ahead.module_path(tmp_path, "gather_bfloat16_int32_1") == tmp_path / "gather_bfloat16_int32_1.ptx"
    long = "a" * 245 + "b" * 245 + "c" * 10
    assert ahead.module_path(tmp_path, long) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")


@pytest.mark.usefixtures("needs_nvrtc")
def test_the_modules_compile_each_in_a_process_and_record_back_as_they_were(tmp_path):
    long = "fused_" + "x" * 300
    wanted = manifest(module("first"), module(long), marks=("omlx-batch-changes-v2-bfloat16",))
    report = ahead.compile_ahead(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=2)
    assert set(report.compiled) == {"first", long} and not report.failed and report.workers == 2
    ptx = ahead.module_path(tmp_path, "first")
    assert ptx.read_bytes().startswith(ELF)
    lines = ptx.with_suffix(".txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == list(module("first").kernels)
    assert all(line.split("\t")[1].startswith("_ZN3mlx4core2cu5scale") for line in lines)  # lowered names
    assert ptx.with_suffix(".cu").read_text() == SOURCE
    assert (tmp_path / "omlx-batch-changes-v2-bfloat16").is_file()  # every module there: the mark too
    assert not list(tmp_path.rglob(".ahead-*"))  # no temporary file left
    again = ahead.record(tmp_path, mlx="0.0.1", build="build-a")
    assert again == manifest(module("first"), module(long), marks=("omlx-batch-changes-v2-bfloat16",))
    tagged = ahead.record(tmp_path, mlx="0.0.1", build="build-a", kinds=BF16)
    assert tagged == manifest(module("first", kinds=BF16), module(long, kinds=BF16),
                              marks=(ahead.Mark("omlx-batch-changes-v2-bfloat16", BF16),))


@pytest.mark.usefixtures("needs_nvrtc")
def test_a_model_gets_the_modules_of_its_kinds_of_weights_and_its_marks_once_they_are_there(tmp_path):
    plain, quantized = ahead.Mark("omlx-plain", BF16), ahead.Mark("omlx-quantized", QUANTIZED)
    wanted = manifest(module("gather", kinds=BF16), module("qmm", kinds=QUANTIZED), module("any"),
                      marks=(plain, quantized))
    compiles = ahead.Compiles(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=2)
    try:
        for future in compiles.request(BF16):  # a bfloat16 model's: not the quantized matmul
            future.result(timeout=120)
        assert set(compiles.report.compiled) == {"gather", "any"}
        assert (tmp_path / "omlx-plain").is_file() and not (tmp_path / "omlx-quantized").exists()
        assert len(compiles.request(("float16",))) == 1  # "any" alone, compiled already: nothing starts
        assert set(compiles.report.compiled) == {"gather", "any"}
        for future in compiles.request(QUANTIZED):  # then a quantized model's: what it lacks
            future.result(timeout=120)
        assert set(compiles.report.compiled) == {"gather", "any", "qmm"}
        assert (tmp_path / "omlx-quantized").is_file()
    finally:
        compiles.close()
    report = ahead.compile_ahead(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=2, kinds=QUANTIZED)
    assert report.present == 3 and report.compiled == {}


@pytest.mark.usefixtures("needs_nvrtc")
def test_modules_there_already_are_not_compiled_again(tmp_path):
    wanted = manifest(module("first"))
    ahead.compile_ahead(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=1)
    report = ahead.compile_ahead(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=4)
    assert report.present == 1 and report.compiled == {} and report.failed == {}


@pytest.mark.usefixtures("needs_nvrtc")
def test_a_module_that_fails_is_left_to_mlx_and_the_others_are_written(tmp_path):
    wanted = manifest(module("good"), module("bad", "__global__ void k() { undefined_thing(); }"),
                      marks=("omlx-batch-changes-v2-bfloat16",))
    report = ahead.compile_ahead(wanted, tmp_path, flags=FLAGS, headers=HEADERS, workers=2)
    assert set(report.compiled) == {"good"}
    assert "bad.cu did not compile" in report.failed["bad"]
    assert ahead.module_path(tmp_path, "good").is_file()
    assert not list(tmp_path.glob("bad.*"))  # nothing of it for MLX to read
    assert not (tmp_path / "omlx-batch-changes-v2-bfloat16").exists()  # not every module is there


@pytest.mark.usefixtures("needs_nvrtc")
def test_a_cache_dir_that_cannot_be_written_leaves_every_module_to_mlx(tmp_path):
    blocked = tmp_path / "kernels"
    blocked.write_text("a file where the directory should be")
    report = ahead.compile_ahead(manifest(module("first")), blocked, flags=FLAGS, headers=HEADERS, workers=1)
    assert report.compiled == {} and set(report.failed) == {"first"}


def test_a_manifest_applies_only_to_the_build_it_was_recorded_with(tmp_path, monkeypatch):
    monkeypatch.setattr(ahead, "MANIFESTS", tmp_path)
    kept = manifest(module("first", kinds=QUANTIZED), marks=(ahead.Mark("omlx-m", BF16),))
    (tmp_path / "mlx-0.0.1.json").write_bytes(ahead.dump(kept))
    assert ahead.manifest_for("0.0.1", "build-a") == kept
    assert ahead.manifest_for("0.0.1", "build-b") is None
    assert ahead.manifest_for("0.0.1", None) is None
    assert ahead.manifest_for("0.0.2", "build-a") is None


def test_the_shipped_manifests_load_and_are_of_the_version_they_are_named_for():
    for path in sorted(ahead.MANIFESTS.glob("mlx-*.json")):
        shipped = ahead.load(path)
        assert path.name == f"mlx-{shipped.mlx}.json"
        assert shipped.build and shipped.modules
        assert all(m.source and m.kernels for m in shipped.modules)


def test_two_recordings_of_one_build_merge_and_of_two_do_not():
    first, second = manifest(module("b"), marks=("omlx-x",)), manifest(module("a"), module("b"), marks=("omlx-y",))
    assert ahead.merged(first, second) == manifest(module("a"), module("b"), marks=("omlx-x", "omlx-y"))
    plain = manifest(module("gather", kinds=BF16), marks=(ahead.Mark("omlx-x", BF16),))
    quantized = manifest(module("gather", kinds=QUANTIZED), module("qmm", kinds=QUANTIZED),
                         marks=(ahead.Mark("omlx-x", QUANTIZED), ahead.Mark("omlx-y", QUANTIZED)))
    assert ahead.merged(plain, quantized) == manifest(  # what both recorded is for the kinds both had
        module("gather", kinds=BF16), module("qmm", kinds=QUANTIZED),
        marks=(ahead.Mark("omlx-x", BF16), ahead.Mark("omlx-y", QUANTIZED)))
    with pytest.raises(ValueError, match="two MLX builds"):
        ahead.merged(first, ahead.Manifest("0.0.1", "build-b", ()))


@pytest.mark.usefixtures("needs_nvrtc")
def test_the_flags_are_mlxs_with_the_optimizations_split_over_the_cores(tmp_path):
    library = tmp_path / "mlx" / "lib" / "libmlx.so"
    (tmp_path / "mlx" / "include").mkdir(parents=True)
    assert ahead.compile_flags("sm_90a", library)[:3] == (
        "--device-as-default-execution-space", "--gpu-architecture=sm_90a", f"--include-path={tmp_path}/mlx/include")
    assert ahead.compile_flags("sm_90a", library)[-1] == "--split-compile=0"
    assert "--split-compile=0" not in ahead.compile_flags("sm_90a", library, split=False)


def test_mlx_compiles_for_the_architecture_specific_target_from_hopper_on():
    assert ahead.architecture(9, 0) == "sm_90a"
    assert ahead.architecture(10, 0) == "sm_100a"
    assert ahead.architecture(8, 6) == "sm_86"


def test_off_cuda_nothing_is_compiled_and_a_wait_returns_at_once(tmp_path):
    assert ahead.prepare(tmp_path) is None  # the CPU build: no CUDA
    ahead.start(tmp_path, lambda: BF16)
    ahead.wait(BF16, timeout=30)
    assert ahead._prepared is not None and ahead._prepared.is_set() and ahead._compiles is None
