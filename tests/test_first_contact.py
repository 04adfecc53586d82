"""What a newcomer sees first without a usable GPU or without CuPy: one clear error that says what
was found. No GPU needed: CuPy's runtime is replaced by stand-ins."""

import sys
import types

import pytest

from cuflash import device


def fake_cupy(get_count, runtime_version=13020, driver_version=13020):
    runtime = types.SimpleNamespace(getDeviceCount=get_count, runtimeGetVersion=lambda: runtime_version,
                                    driverGetVersion=lambda: driver_version)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


@pytest.fixture
def fresh_device_check():
    device.require_device.cache_clear()
    yield
    device.require_device.cache_clear()


def raising(message):
    def get_count():
        raise RuntimeError(message)
    return get_count


INSUFFICIENT = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


@pytest.mark.parametrize("error,driver,expected", [
    (INSUFFICIENT, 12040, r"driver \(CUDA 12\.4\) is older than CuPy's CUDA runtime \(13\.2\)"),
    (INSUFFICIENT, 0, "no NVIDIA driver was found"),  # CUDA says "insufficient" without any driver too
    ("cudaErrorNoDevice: no CUDA-capable device is detected", 13020, "sees no CUDA device"),
    ("cudaErrorUnknown: unknown error", 13020, "the CUDA runtime failed"),
])
def test_device_check_says_what_it_found(monkeypatch, fresh_device_check, error, driver, expected):
    monkeypatch.setattr(device, "cupy", lambda: fake_cupy(raising(error), driver_version=driver))
    with pytest.raises(RuntimeError, match=expected) as info:
        device.require_device(0)
    assert "python -m cuflash info" in str(info.value)


def test_no_device_and_old_gpu(monkeypatch, fresh_device_check):
    monkeypatch.setattr(device, "cupy", lambda: fake_cupy(lambda: 0))
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        device.require_device(0)
    device.require_device.cache_clear()
    monkeypatch.setattr(device, "cupy", lambda: fake_cupy(lambda: 1))
    monkeypatch.setattr(device, "compute_capability", lambda device_id: 75)
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0 .* has 7\.5"):
        device.require_device(0)


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(ImportError, match=r"cuflash\[cuda12\]"):
        device.cupy()


def test_jax_on_a_cpu_backend_says_so(monkeypatch):
    jax = pytest.importorskip("jax")
    import cuflash.jax

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    q = jax.numpy.zeros((1, 8, 1, 64), dtype=jax.numpy.float16)
    with pytest.raises(RuntimeError, match="JAX's default backend is 'cpu'"):
        cuflash.jax.attention(q, q, q)
