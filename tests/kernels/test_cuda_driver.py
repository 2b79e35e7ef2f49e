import pytest

from appliance.kernels.cuda_driver import CudaError, device_memory
from appliance.kernels.pinned import available


def test_device_memory_is_free_and_total_or_says_why():
    if available() is not None:  # no CUDA driver here
        with pytest.raises(CudaError, match="CUDA"):
            device_memory()
        return
    free, total = device_memory()
    assert 0 < free <= total
