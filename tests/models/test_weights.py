"""appliance/models/weights.py and the load through it (models/loaded.py's
`load_with_weights`): every tensor as `mx.load` reads it, and the model mlx-lm's own `load`
builds.

The tests named test_on_cuda_* run the pinned path itself; they run on an NVIDIA GPU with
MLX CUDA (`bench/gpu_run.sh`'s kernels step names them) and are skipped elsewhere with the
reason printed (`pytest -rs`). The rest run everywhere, on the real converted test model.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import save_model

from appliance.kernels.cuda_driver import CudaError
from appliance.models import weights
from appliance.models.headers import tensors, weight_files
from appliance.models.loaded import load_model, load_with_weights
from appliance.models.weights import ALIGN, DTYPES, load_mlx, load_weights, plan, read_into
from appliance.spec import ModelSpec

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the pinned path is CUDA only; no CUDA here")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def same_bits(a: mx.array, b: mx.array) -> bool:
    """Returns whether two arrays have the same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and mx.array_equal(mx.view(a.reshape(-1), mx.uint8), mx.view(b.reshape(-1), mx.uint8)).item())


def unequal(got: dict[str, mx.array], want: dict[str, mx.array]) -> list[str]:
    """Returns the names whose tensors differ, missing on either side included."""
    return sorted(set(got) ^ set(want)) + [n for n in sorted(set(got) & set(want)) if not same_bits(got[n], want[n])]


def edge_cases(path: Path, *, large: int = 9_000_001) -> Path:
    """Writes tensors of every dtype mx.save_safetensors writes, sizes that are not a multiple
    of 16 bytes, empty ones, a scalar and one of `large` bytes; returns the file."""
    mx.random.seed(7)
    ints = {mx.int8: (-128, 128), mx.uint8: (0, 256), mx.int16: (-30000, 30000), mx.uint16: (0, 60000),
            mx.int32: (-2**31, 2**31 - 1), mx.uint32: (0, 2**31 - 1), mx.int64: (-2**31, 2**31 - 1),
            mx.uint64: (0, 2**31 - 1)}
    arrays = {f"int.{dtype}".replace("mlx.core.", ""): mx.random.randint(*bounds, (13,)).astype(dtype)
              for dtype, bounds in ints.items()}
    arrays |= {
        "f32.odd": mx.random.normal((3, 5, 7)),  # 420 bytes
        "f32.exact": mx.random.normal((4, 4)),  # 64 bytes
        "bf16.odd": mx.random.normal((7, 3)).astype(mx.bfloat16),
        "f16.row": mx.random.normal((1, 9)).astype(mx.float16),
        "bool": mx.random.uniform(shape=(11,)) > 0.5,
        "c64": mx.random.normal((3,)) + 1j * mx.random.normal((3,)),
        "scalar": mx.array(3.25),
        "one": mx.array([200], dtype=mx.uint8),
        "empty": mx.zeros((0, 4)),
        "empty.bf16": mx.zeros((2, 0), dtype=mx.bfloat16),
        "large": mx.random.randint(0, 256, (large,)).astype(mx.uint8),  # more than one sweep of the kernel's grid
    }
    arrays |= {f"f16.mid.{i}": mx.random.normal((1_500_001,)).astype(mx.float16) for i in range(4)}
    mx.save_safetensors(str(path), arrays)
    return path


def raw_file(path: Path, entries: dict[str, tuple[str, list[int], bytes]]) -> Path:
    """Writes a safetensors file by hand (dtypes mx.save_safetensors does not write); returns it."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def fp8(path: Path) -> Path:
    return raw_file(path, {"e4m3": ("F8_E4M3", [5], bytes([0x38, 0x40, 0x7F, 0x01, 0xC0])),
                           "e8m0": ("F8_E8M0", [3, 1], bytes([127, 128, 1]))})


@pytest.fixture(scope="module")
def edge_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("edge")
    return [edge_cases(root / "model-00001-of-00002.safetensors"), fp8(root / "model-00002-of-00002.safetensors")]


def test_tensors_lists_what_mx_load_reads(model_dir: Path, edge_files: list[Path]):
    for file in [*weight_files(model_dir), *edge_files]:
        loaded = mx.load(str(file))
        listed = tensors(file)
        assert sorted(t.name for t in listed) == sorted(loaded)
        for t in listed:
            a = loaded[t.name]
            assert (DTYPES[t.dtype], t.shape, t.nbytes) == (a.dtype, a.shape, a.nbytes), t.name
        assert [t.offset for t in listed] == sorted(t.offset for t in listed)  # in the file's order


def test_every_tensor_of_the_model_loads_as_mx_load_reads_it(model_dir: Path):
    files = weight_files(model_dir)
    loaded = load_weights(files)
    assert loaded.loader == ("pinned" if mx.cuda.is_available() else "mx.load")
    assert not unequal(loaded.arrays, load_mlx(files))
    assert loaded.nbytes == sum(t.nbytes for f in files for t in tensors(f))


def test_odd_sizes_empty_tensors_and_every_dtype_load_as_mx_load_reads_them(edge_files: list[Path]):
    loaded = load_weights(edge_files)
    assert not unequal(loaded.arrays, load_mlx(edge_files))
    assert loaded.arrays["empty"].shape == (0, 4) and loaded.arrays["scalar"].shape == ()


def test_the_plan_places_each_tensor_once_aligned_and_apart(edge_files: list[Path]):
    staging = 10 << 20
    batches = plan(edge_files, staging)
    staged = [s for batch in batches for s in batch]
    assert sorted(s.tensor.name for s in staged) == sorted(t.name for f in edge_files for t in tensors(f))
    assert len(batches) >= 3  # the first buffer is refilled: its wait is exercised
    for batch in batches:
        ends = 0
        for s in batch:  # in order, each after the last one's end, aligned, inside the buffer
            assert s.place % ALIGN == 0 and s.place >= ends
            ends = s.place + s.tensor.nbytes
        assert ends <= staging


def test_a_tensor_larger_than_a_staging_buffer_is_refused(edge_files: list[Path]):
    with pytest.raises(ValueError, match=r"large \(9000001 bytes\) fits no staging buffer of 8388608 bytes"):
        plan(edge_files, 8 << 20)


def test_a_read_in_pieces_gets_the_file_bytes(edge_files: list[Path]):
    file = edge_files[0]
    data = file.read_bytes()
    for t in tensors(file):
        into = bytearray(t.nbytes)
        for at in range(0, t.nbytes, 1000):  # pieces, as the reader threads take them
            read_into(file, t.offset + at, memoryview(into)[at:at + 1000])
        assert bytes(into) == data[t.offset:t.offset + t.nbytes], t.name


def test_a_read_past_the_end_of_the_file_raises(edge_files: list[Path]):
    size = edge_files[1].stat().st_size
    with pytest.raises(OSError, match="short read"):
        read_into(edge_files[1], size - 4, memoryview(bytearray(8)))


def test_a_failing_pinned_path_falls_back_to_mx_load(model_dir: Path, monkeypatch, caplog):
    def refused(*args, **kwargs):
        raise CudaError("cuMemHostAlloc failed (injected)")

    monkeypatch.setattr(weights, "PinnedLoader", refused)
    files = weight_files(model_dir)
    with caplog.at_level(logging.WARNING, logger="omlx.models"):
        loaded = load_weights(files, pinned=True)
    assert loaded.loader == "mx.load"
    assert "the pinned load failed (CudaError: cuMemHostAlloc failed (injected))" in caplog.text
    assert not unequal(loaded.arrays, load_mlx(files))


def test_a_dtype_with_no_mlx_dtype_falls_back_before_anything_is_pinned(edge_files: list[Path], monkeypatch, caplog):
    def pinned(*args, **kwargs):
        raise AssertionError("pinned memory taken for a load that cannot use it")

    monkeypatch.setattr(weights, "PinnedLoader", pinned)
    monkeypatch.setattr(weights, "DTYPES", {k: v for k, v in DTYPES.items() if k != "F8_E8M0"})
    with caplog.at_level(logging.WARNING, logger="omlx.models"):
        loaded = load_weights(edge_files, pinned=True)
    assert loaded.loader == "mx.load"
    assert "no MLX dtype for safetensors dtype F8_E8M0" in caplog.text
    assert not unequal(loaded.arrays, load_mlx(edge_files))


def assert_same_model(path: Path):
    """Loads the model at `path` through `load_with_weights` and checks it against mlx-lm's `load`."""
    want, want_tokenizer, want_config = mlx_lm.load(str(path), return_config=True)
    arrays = load_weights(weight_files(path)).arrays
    given = dict(arrays)
    model, tokenizer, config = load_with_weights(path, arrays)
    mx.eval(model.parameters())
    got = dict(tree_flatten(model.parameters()))
    assert not unequal(got, dict(tree_flatten(want.parameters())))
    assert not arrays  # every tensor taken: none of mlx-lm's lazy reads was needed
    assert all(got[name] is a for name, a in given.items() if name in got)  # the loaded arrays themselves
    assert type(model) is type(want)
    assert config == want_config
    assert tokenizer.eos_token_ids == want_tokenizer.eos_token_ids
    return model, tokenizer


def test_the_model_loaded_with_the_weights_is_the_one_mlx_lm_loads(model_dir: Path):
    model, tokenizer = assert_same_model(model_dir)
    prompt = mx.array([tokenizer.encode("The capital of France is")])
    want, _ = mlx_lm.load(str(model_dir))
    assert mx.array_equal(model(prompt), want(prompt)).item()


def test_a_quantized_model_loads_with_the_weights_as_mlx_lm_loads_it(model_dir: Path, tmp_path: Path):
    model, _ = mlx_lm.load(str(model_dir))
    nn.quantize(model, group_size=64, bits=4)  # uint32 weights with scales and biases, as mlx-lm's convert
    save_model(tmp_path, model)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in MODEL_FILES[1:]:
        shutil.copy(model_dir / name, tmp_path / name)
    assert any(t.dtype == "U32" for f in weight_files(tmp_path) for t in tensors(f))
    assert_same_model(tmp_path)


def test_load_model_says_which_loader_read_the_weights_and_how_fast(model_dir: Path, caplog):
    repo = Path(__file__).resolve().parents[2]
    spec = ModelSpec(name="smollm2-135m", source=str(model_dir), max_context_tokens=2048)
    with caplog.at_level(logging.INFO, logger="omlx.models"):
        load_model(spec, base_dir=repo, cache_dir=repo / ".cache" / "test")
    loader = "pinned" if mx.cuda.is_available() else "mx.load"
    assert f"weights by {loader}, 0.54 GB in" in caplog.text and "GB/s)" in caplog.text


@on_cuda
def test_on_cuda_every_tensor_is_copied_bit_for_bit(tmp_path: Path, monkeypatch):
    files = [edge_cases(tmp_path / "model-00001-of-00002.safetensors"),
             fp8(tmp_path / "model-00002-of-00002.safetensors")]
    monkeypatch.setattr(weights, "PIECE_BYTES", 1 << 20)  # tensors read in several pieces
    loaded = load_weights(files, staging_bytes=10 << 20)  # several loads of each buffer
    assert loaded.loader == "pinned"
    assert not unequal(loaded.arrays, load_mlx(files))


@on_cuda
def test_on_cuda_a_read_failing_midway_falls_back_to_mx_load(tmp_path: Path, monkeypatch, caplog):
    files = [edge_cases(tmp_path / "model.safetensors")]
    calls = []

    def failing(file, offset, into):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError("the disk went away (injected)")
        read_into(file, offset, into)

    monkeypatch.setattr(weights, "read_into", failing)
    with caplog.at_level(logging.WARNING, logger="omlx.models"):
        loaded = load_weights(files, staging_bytes=10 << 20)
    assert loaded.loader == "mx.load"
    assert "the pinned load failed (OSError: the disk went away (injected))" in caplog.text
    assert not unequal(loaded.arrays, load_mlx(files))
