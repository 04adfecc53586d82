"""Fixtures shared by the test modules, and the skips behind the `gpu`,
`hopper` and `multi_gpu` markers (registered in pyproject.toml)."""

import functools
import zlib

import numpy as np
import pytest

from cuflash import backward, dispatch, forward, tune_cache, varlen


@functools.cache
def gpu_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy, a driver or a device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return 0


def gpu_available():
    """True when CuPy imports and sees at least one CUDA device."""
    return gpu_count() > 0


@functools.cache
def hopper_available():
    """True when the current CUDA device is an sm_90 GPU."""
    if not gpu_available():
        return False
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


@pytest.fixture(autouse=True)
def require_gpu(request):
    """Skip tests marked `gpu` when no CUDA device is usable, tests marked
    `hopper` when the device is not an sm_90 GPU, and tests marked `multi_gpu`
    where fewer than two devices are."""
    if request.node.get_closest_marker("gpu") and not gpu_available():
        pytest.skip("no usable CUDA device")
    if request.node.get_closest_marker("multi_gpu") and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    if request.node.get_closest_marker("hopper") and not hopper_available():
        pytest.skip("needs an sm_90 GPU")


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test starts without launch plans: a plan keeps the dispatch choice it was made with, and
    tests change dispatch's tables (monkeypatch) for the same shapes."""
    for plans in (forward._plans, backward._plans, varlen._fwd_plans, varlen._bwd_plans):
        plans.clear()


@pytest.fixture(params=[pytest.param("hopper", marks=pytest.mark.hopper), "sm80"])
def kernel(request, monkeypatch):
    """The kernel family under test on a Hopper GPU, the tuning cache out of the choice: "hopper" (the
    default tables), "sm80" (dispatch's Hopper tables emptied). A test that parametrizes `kernel`
    itself overrides this fixture."""
    if request.param == "sm80":
        monkeypatch.setattr(dispatch, "HEURISTIC_SM90", {})
        monkeypatch.setattr(dispatch, "SM90_SHORT_KEYS", {})
        monkeypatch.setattr(dispatch, "HEURISTIC_BWD_SM90", {})
    with dispatch.heuristic_only():
        yield request.param


@pytest.fixture
def rng(request):
    """Different inputs for every case, reproducible from the test id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty tuning-cache directory and fresh per-process cache state."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune_cache, "_memo", {})
    monkeypatch.setattr(tune_cache, "_warned", set())
    return tmp_path


@pytest.fixture
def torch_cuda():
    """Skips a test unless torch is installed and sees a CUDA device."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
