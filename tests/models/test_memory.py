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
