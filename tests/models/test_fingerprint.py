"""The weights' fingerprint, memoized in fingerprints.json: a damaged memo costs a rehash, never a wrong digest."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from appliance.models import fingerprint
from appliance.models.fingerprint import MEMO_FILE, SCHEME, weights_fingerprint


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"\x01" * 4096)
    return d


def expected(model_dir: Path, piece: int = fingerprint.PIECE_BYTES) -> str:
    """The scheme written out plainly: per file its name, size and each piece's sha256."""
    top = hashlib.sha256(SCHEME.encode() + b"\0")
    for name in ("config.json", "model.safetensors"):
        data = (model_dir / name).read_bytes()
        top.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        for i in range(0, max(len(data), 1), piece):
            top.update(hashlib.sha256(data[i:i + piece]).digest())
    return top.hexdigest()


def test_the_digest_is_memoized(model_dir: Path, tmp_path: Path):
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)
    memo = json.loads((tmp_path / MEMO_FILE).read_text())
    assert list(memo["entries"].values()) == [expected(model_dir)]


def test_pieces_hash_in_parallel_and_in_order(model_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(fingerprint, "PIECE_BYTES", 1000)
    monkeypatch.setattr(fingerprint, "READ_BYTES", 300)
    data = bytearray(range(256)) * 20  # 5,120 bytes: six pieces, the last one short
    (model_dir / "model.safetensors").write_bytes(bytes(data))
    first = weights_fingerprint(model_dir, memo_dir=tmp_path)
    assert first == expected(model_dir, piece=1000)
    data[-1] ^= 1  # one bit of the last piece
    (model_dir / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir, piece=1000) != first


def test_concurrent_callers_share_one_hash(model_dir: Path, tmp_path: Path, monkeypatch):
    calls, gate = [], threading.Event()
    real = fingerprint.tree_digest

    def slow(files, **kw):
        calls.append(files)
        gate.wait(5)
        return real(files, **kw)

    monkeypatch.setattr(fingerprint, "tree_digest", slow)
    started = fingerprint.start_fingerprint(model_dir, memo_dir=tmp_path)  # as load_model does
    results = []
    waiter = threading.Thread(target=lambda: results.append(weights_fingerprint(model_dir, memo_dir=tmp_path)))
    waiter.start()
    gate.set()
    waiter.join(5)
    assert results == [started.result()] == [expected(model_dir)]
    assert len(calls) == 1


def test_a_failed_hash_is_raised_and_retried(model_dir: Path, tmp_path: Path, monkeypatch):
    def broken(files, **kw):
        raise OSError("disk gone")

    monkeypatch.setattr(fingerprint, "tree_digest", broken)
    with pytest.raises(OSError, match="disk gone"):
        weights_fingerprint(model_dir, memo_dir=tmp_path)
    monkeypatch.undo()
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)


def test_an_older_scheme_is_rehashed_and_dropped(model_dir: Path, tmp_path: Path):
    stamp = "|".join(fingerprint._stamp(f) for f in (model_dir / "config.json", model_dir / "model.safetensors"))
    fingerprint._write(tmp_path / MEMO_FILE, {stamp: "0" * 64})  # the single-sha256 memo of before
    assert weights_fingerprint(model_dir, memo_dir=tmp_path) == expected(model_dir)
    assert list(json.loads((tmp_path / MEMO_FILE).read_text())["entries"].values()) == [expected(model_dir)]


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
