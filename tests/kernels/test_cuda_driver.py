import pytest

from appliance.kernels.cuda_driver import CudaError, device_memory, driver_version
from appliance.kernels.pinned import available


def test_device_memory_is_free_and_total_or_says_why():
    if available() is not None:  # no CUDA driver here
        with pytest.raises(CudaError, match="CUDA"):
            device_memory()
        return
    free, total = device_memory()
    assert 0 < free <= total


def test_driver_version_is_a_cuda_version_or_says_why():
    if available() is not None:  # no CUDA driver here
        with pytest.raises(CudaError, match="CUDA"):
            driver_version()
        return
    major, minor = driver_version()
    assert major >= 12 and 0 <= minor < 100
