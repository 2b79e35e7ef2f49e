"""Fixtures of the kernel tests."""

import pytest

from appliance.kernels import nvrtc


@pytest.fixture
def needs_nvrtc():
    """Skips the test where no libnvrtc is installed (the test extra brings it on Linux x86-64)."""
    try:
        nvrtc.version()
    except nvrtc.CompileError as e:
        pytest.skip(str(e))
