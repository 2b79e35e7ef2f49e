from appliance.models import memory

GIB = 2**30


def test_free_memory_on_a_gpu_is_no_more_than_the_device_has_free(monkeypatch):
    """On CUDA, another process's share of the device counts: MLX's own limit does not see it."""
    monkeypatch.setattr(memory, "device_kind", lambda: "gpu")
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 140 * GIB)
    monkeypatch.setattr(memory, "cuda_free_bytes", lambda: 3 * GIB)
    assert memory.free_bytes() == 3 * GIB
    monkeypatch.setattr(memory, "cuda_free_bytes", lambda: None)  # Metal: the limit alone
    assert memory.free_bytes() > 3 * GIB


def test_cuda_free_bytes_is_none_without_cuda():
    import mlx.core as mx

    if not mx.cuda.is_available():
        assert memory.cuda_free_bytes() is None
    else:
        assert memory.cuda_free_bytes() > 0


def test_room_beside_counts_weights_already_on_the_device_once(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)  # weights of 1000 bytes: 1200 with the headroom
    monkeypatch.setattr(memory, "free_bytes", lambda: 5000)
    assert memory.room_beside(tmp_path) == 3800
    assert memory.room_beside(tmp_path, resident=700) == 4500  # a preload's 700 bytes are taken from free already
    assert memory.room_beside(tmp_path, resident=1500) == 5000
    monkeypatch.setattr(memory, "free_bytes", lambda: None)
    assert memory.room_beside(tmp_path, resident=700) is None
