"""The weights' fingerprint, memoized in fingerprints.json: a damaged memo costs a rehash, never a wrong digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from appliance.models.fingerprint import MEMO_FILE, weights_fingerprint


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"\x01" * 4096)
    return d


def expected(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    return digest.hexdigest()


def test_the_digest_is_memoized(model_dir: Path, tmp_path: Path):
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)
    memo = json.loads((tmp_path / MEMO_FILE).read_text())
    assert list(memo["entries"].values()) == [expected(model_dir)]


@pytest.mark.parametrize("damage", ["garbage", "wrong digest", "old format"])
def test_a_damaged_memo_is_recomputed(model_dir: Path, tmp_path: Path, damage: str):
    weights_fingerprint(model_dir, memo_dir=tmp_path)
    path = tmp_path / MEMO_FILE
    memo = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "wrong digest":  # valid JSON, one digit changed: caught by the checksum
        stamp, digest = next(iter(memo["entries"].items()))
        memo["entries"][stamp] = ("0" if digest[0] != "0" else "1") + digest[1:]
        path.write_text(json.dumps(memo))
    else:
        path.write_text(json.dumps(memo["entries"]))
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)
    assert json.loads(path.read_text())["entries"]  # rewritten in the current format


def test_changed_weights_are_rehashed(model_dir: Path, tmp_path: Path):
    first = weights_fingerprint(model_dir, memo_dir=tmp_path)
    (model_dir / "model.safetensors").write_bytes(b"\x02" * 4096)
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) not in (first, None)
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)
