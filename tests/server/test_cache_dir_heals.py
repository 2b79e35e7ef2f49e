"""Everything under cache.dir is derived data: damage any kind of file there, restart, and the
server serves again on its own, with the same answers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import free_port, start_server, write_config
from tests.server.test_cache_api import chat

pytestmark = pytest.mark.slow

QUESTION = "Summarize the rules."


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x20
    path.write_bytes(data)


def damage_conversion(cache: Path) -> None:
    (conversion,) = (cache / "models").iterdir()
    (conversion / "tokenizer_config.json").write_bytes(b"\xff\xfe not utf-8")  # broke every load before
    flip_byte(conversion / "model.safetensors", 10_000_000)


def damage_blocks(cache: Path) -> None:
    blocks = sorted((cache / "kv").rglob("*.kv"))
    assert len(blocks) >= 3
    flip_byte(blocks[0], 5000)
    blocks[1].write_bytes(blocks[1].read_bytes()[:100])
    blocks[2].write_bytes(b"")


def damage_index(cache: Path) -> None:
    for f in (cache / "kv").glob("index.sqlite*"):
        f.write_bytes(b"this is no SQLite database" * 100)


def damage_fingerprints(cache: Path) -> None:
    (cache / "fingerprints.json").write_text('{"crc32": 1, "entries": {"x": "0000"}}')


def delete_everything(cache: Path) -> None:
    shutil.rmtree(cache)


DAMAGE = [damage_conversion, damage_blocks, damage_index, damage_fingerprints, delete_everything]


def test_each_kind_of_damage_heals_on_restart(tmp_path: Path):
    cache = tmp_path / "cache"  # its own: the conversion gets damaged too
    port = free_port()
    config = write_config(tmp_path / "omlx.toml", port=port, cache_dir=cache, cache_extra="block_tokens = 64")
    server = start_server(config, port, tmp_path / "first.log")
    try:
        first = chat(server, QUESTION)
    finally:
        assert server.stop() == 0
    for damage in DAMAGE:
        damage(cache)
        log = tmp_path / f"after-{damage.__name__}.log"
        server = start_server(config, port, log)  # waits for /health 200
        try:
            again = chat(server, QUESTION)
        finally:
            assert server.stop() == 0, server.output()
        assert again["text"] == first["text"], damage.__name__
        assert "Traceback" not in server.output(), damage.__name__
        if damage is damage_conversion:
            assert "does not verify" in server.output()
