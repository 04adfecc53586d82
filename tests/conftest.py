import functools
import zlib

import numpy as np

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a usable CUDA device")


@functools.cache
def gpu_available():
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return False


@pytest.fixture(autouse=True)
def require_gpu(request):
    """Skip tests marked `gpu` when no CUDA device is usable."""
    if request.node.get_closest_marker("gpu") and not gpu_available():
        pytest.skip("no usable CUDA device")


@pytest.fixture
def rng(request):
    """Different inputs for every case, reproducible from the test id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
