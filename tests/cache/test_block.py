import errno
import os
import struct
from array import array

import orjson
import pytest

from appliance.cache import block as block_module
from appliance.cache.block import (
    FORMAT_VERSION,
    MAGIC,
    PAYLOAD_ALIGN,
    PRELUDE,
    Block,
    BlockError,
    decode,
    encode_head,
    is_valid_dir,
    read_block,
    read_file,
    relative_path,
)

KEY = bytes(range(32))
DIR = "a1b2c3d4e5f6a7b8/default"


def block(payload: bytes | memoryview = b"kv" * 1000, tokens=(1, 2, 3)) -> Block:
    return Block(key=KEY, parent=b"\x01" * 32, dir=DIR, tokens=tokens,
                 meta={"dtype": "float32", "layers": 30}, payload=payload)


def file_bytes(b: Block) -> bytes:
    return encode_head(b) + bytes(b.payload)


def reason(data: bytes, **kw) -> str:
    args = {"key": KEY, "dir": DIR, "tokens": (1, 2, 3), **kw}
    with pytest.raises(BlockError) as e:
        decode(memoryview(data), **args)
    return e.value.reason


def test_round_trip_keeps_every_field():
    b = block()
    back = decode(memoryview(file_bytes(b)), key=KEY, dir=DIR, tokens=(1, 2, 3))
    assert back == b
    assert bytes(back.payload) == bytes(b.payload)
    assert back.meta == {"dtype": "float32", "layers": 30}
    assert back.parent == b"\x01" * 32


def test_a_block_always_has_a_parent_the_first_one_the_root_key():
    for missing in (None, b""):
        with pytest.raises(ValueError):
            Block(key=KEY, parent=missing, dir=DIR, tokens=(7,), meta={}, payload=b"x")


def test_a_header_without_a_parent_is_corrupt():
    data = file_bytes(block())
    _, _, header_nbytes = PRELUDE.unpack_from(data)
    header = orjson.loads(data[PRELUDE.size:PRELUDE.size + header_nbytes])
    header["parent"] = None  # as format 1 wrote a first block
    raw = orjson.dumps(header)
    raw += b" " * (header_nbytes - len(raw))
    edited = PRELUDE.pack(MAGIC, FORMAT_VERSION, header_nbytes) + raw + data[PRELUDE.size + header_nbytes:]
    assert reason(edited) == "corrupt"


def test_payload_starts_aligned_and_is_a_zero_copy_view():
    head = encode_head(block())
    assert len(head) % PAYLOAD_ALIGN == 0
    data = bytearray(file_bytes(block()))
    back = decode(memoryview(data), key=KEY, dir=DIR, tokens=(1, 2, 3))
    data[len(head)] ^= 0xFF  # the view sees writes to the buffer it came from
    assert back.payload[0] == data[len(head)]


def test_memoryview_payload_counts_bytes_not_items():
    floats = memoryview(array("f", [1.0] * 100))
    b = block(payload=floats)
    assert b.payload_nbytes == 400
    back = decode(memoryview(file_bytes(b)), key=KEY, dir=DIR, tokens=(1, 2, 3))
    assert bytes(back.payload) == floats.tobytes()


def test_bad_magic_is_corrupt():
    data = bytearray(file_bytes(block()))
    data[0:8] = b"NOTOMLX!"
    assert reason(bytes(data)) == "corrupt"


def test_unknown_version_is_its_own_reason():
    data = bytearray(file_bytes(block()))
    struct.pack_into("<I", data, 8, 99)
    assert reason(bytes(data)) == "version"


def test_short_files_are_truncated():
    data = file_bytes(block())
    assert reason(data[:10]) == "truncated"
    assert reason(data[:PRELUDE.size + 5]) == "truncated"
    assert reason(data[:-1]) == "truncated"


def test_trailing_bytes_are_corrupt():
    assert reason(file_bytes(block()) + b"\0") == "corrupt"


def test_flipped_payload_byte_is_corrupt():
    data = bytearray(file_bytes(block()))
    data[-7] ^= 0x01
    assert reason(bytes(data)) == "corrupt"


def test_other_key_or_dir_is_foreign():
    data = file_bytes(block())
    assert reason(data, key=b"\xff" * 32) == "foreign"
    assert reason(data, dir="other/default") == "foreign"


def test_tokens_are_compared_unless_none():
    data = file_bytes(block())
    assert reason(data, tokens=(1, 2, 4)) == "token_mismatch"
    assert decode(memoryview(data), key=KEY, dir=DIR, tokens=None).tokens == (1, 2, 3)


def test_checksum_covers_tokens():
    # Rewrite the header with other token ids but the old checksum: the edit is caught.
    data = file_bytes(block())
    _, _, header_nbytes = PRELUDE.unpack_from(data)
    header = orjson.loads(data[PRELUDE.size:PRELUDE.size + header_nbytes])
    header["tokens"] = [1, 2, 4]
    raw = orjson.dumps(header)
    raw += b" " * (header_nbytes - len(raw))
    edited = PRELUDE.pack(MAGIC, FORMAT_VERSION, header_nbytes) + raw + data[PRELUDE.size + header_nbytes:]
    assert reason(edited, tokens=(1, 2, 4)) == "corrupt"


def test_garbage_header_is_corrupt():
    data = bytearray(file_bytes(block()))
    data[PRELUDE.size:PRELUDE.size + 4] = b"\xff\xfe{["
    assert reason(bytes(data)) == "corrupt"


def test_dir_must_be_a_safe_relative_path():
    assert is_valid_dir("a1b2c3d4e5f6a7b8/default")
    assert is_valid_dir("m.v2/tenant_1-x")
    for bad in ("", "/abs", "a/../b", "..", "a//b", "a/.hidden", "a b", "a/"):
        assert not is_valid_dir(bad), bad
        with pytest.raises(ValueError):
            Block(key=KEY, parent=b"\x01" * 32, dir=bad, tokens=(), meta={}, payload=b"")


def test_relative_path_shards_by_first_key_byte():
    assert relative_path("g/t", KEY) == f"g/t/00/{KEY.hex()}.kv"


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 2**20 + 5])
def test_read_file_returns_every_byte_whatever_the_size(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "b.kv"
    path.write_bytes(data)
    assert bytes(read_file(path)) == data


def page_buffers(given: list[memoryview]):
    import mmap

    def buffer(nbytes: int) -> memoryview:
        given.append(memoryview(mmap.mmap(-1, nbytes)))  # page-aligned, like a pinned slot
        return given[-1]
    return buffer


def test_read_file_reads_into_the_buffer_it_is_given(tmp_path):
    """A whole file into a page-aligned buffer (as O_DIRECT wants it); a block's payload
    alone goes to pinned memory this way on CUDA (read_block)."""
    data = os.urandom(3 * 4096 + 17)
    path = tmp_path / "b.kv"
    path.write_bytes(data)
    given: list[memoryview] = []
    read = read_file(path, page_buffers(given))
    assert bytes(read) == data and read.obj is given[0].obj
    # No buffer to give (no free pinned slot): fresh aligned memory, still read directly.
    assert bytes(read_file(path, lambda nbytes: None)) == data


@pytest.mark.parametrize("tokens", [(1, 2, 3), tuple(range(2000))])  # a head of one page, of two
def test_read_block_reads_the_payload_alone_into_a_buffer_of_its_size(tmp_path, tokens):
    """On CUDA the payload lands in a pinned slot the size a demoted block of the same
    precision takes: the head is read apart, so it does not push the read into a bigger one."""
    b = block(payload=os.urandom(3 * 4096 + 17), tokens=tokens)
    path = tmp_path / "b.kv"
    path.write_bytes(file_bytes(b))
    given: list[memoryview] = []
    head, payload = read_block(path, page_buffers(given))
    assert [len(g) for g in given] == [4 * 4096] and payload.obj is given[0].obj
    back = decode(head, key=KEY, dir=DIR, tokens=tokens, payload=payload)
    assert bytes(back.payload) == bytes(b.payload) and back.tokens == tokens
    # Without a buffer: one read of the whole file.
    whole, rest = read_block(path)
    assert rest is None and bytes(whole) == file_bytes(b)


def test_read_block_reads_a_file_with_a_64_byte_aligned_payload_whole(tmp_path):
    """Files written while PAYLOAD_ALIGN was 64 still restore."""
    b = block()
    raw = encode_head(b)[PRELUDE.size:].rstrip(b" ")
    raw += b" " * (-(PRELUDE.size + len(raw)) % 64)
    old = PRELUDE.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw + bytes(b.payload)
    assert (PRELUDE.size + len(raw)) % 4096  # the payload at a multiple of 64, not of a page
    path = tmp_path / "b.kv"
    path.write_bytes(old)
    given: list[memoryview] = []
    data, payload = read_block(path, page_buffers(given))
    assert payload is None and bytes(data) == old
    assert bytes(decode(data, key=KEY, dir=DIR, tokens=(1, 2, 3)).payload) == bytes(b.payload)


def test_read_block_of_a_short_or_long_file_is_truncated_or_corrupt(tmp_path):
    data = file_bytes(block())
    path = tmp_path / "b.kv"
    for cut, why in ((data[:-1], "truncated"), (data[:PRELUDE.size + 5], "truncated"), (data + b"\0", "corrupt")):
        path.write_bytes(cut)
        head, payload = read_block(path, page_buffers([]))
        with pytest.raises(BlockError) as e:
            decode(head, key=KEY, dir=DIR, tokens=(1, 2, 3), payload=payload)
        assert e.value.reason == why


def test_read_file_falls_back_to_an_ordinary_read_where_direct_io_is_refused(tmp_path, monkeypatch):
    data = os.urandom(10_000)
    path = tmp_path / "b.kv"
    path.write_bytes(data)
    real_open = os.open
    refused = []

    def open_refusing_direct(p, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(p)
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs and some mounts answer
        return real_open(p, flags, *args)

    monkeypatch.setattr(block_module.os, "open", open_refusing_direct)
    assert bytes(read_file(path)) == data
    assert refused == ([path] if hasattr(os, "O_DIRECT") else [])


def test_read_file_of_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "gone.kv")
