"""A conversion's manifest vouches for its files: sizes and checksums, or a reason why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.models.manifest import MANIFEST, verify, write_manifest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    write_manifest(d, source="x.gguf", dtype="float32")
    return d


def test_a_fresh_conversion_verifies(model_dir: Path):
    assert verify(model_dir) is None
    manifest = json.loads((model_dir / MANIFEST).read_text())
    assert manifest["dtype"] == "float32"
    assert manifest["files"]["model.safetensors"]["bytes"] == 256_000


def test_a_flipped_byte_is_found(model_dir: Path):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[1234] ^= 0x40
    path.write_bytes(data)
    assert verify(model_dir) == "model.safetensors: checksum mismatch"


def test_a_truncated_file_is_found(model_dir: Path):
    (model_dir / "model.safetensors").write_bytes(b"")
    assert verify(model_dir) == "model.safetensors: 0 bytes, 256000 expected"


def test_a_missing_file_is_found(model_dir: Path):
    (model_dir / "config.json").unlink()
    assert verify(model_dir) == "config.json: missing"


@pytest.mark.parametrize("content", [None, b"", b"\xff\xfe not json", b'{"format": 99, "files": {}}',
                                     b'{"format": 1, "files": {"config.json": "?"}}'])
def test_a_missing_or_damaged_manifest_does_not_verify(model_dir: Path, content: bytes | None):
    if content is None:
        (model_dir / MANIFEST).unlink()
    else:
        (model_dir / MANIFEST).write_bytes(content)
    assert verify(model_dir) is not None
